"""Parallel samples of one prompt in the engine (``add_request(..., num_children=k)``): the
prompt is prefilled once and the request forked; a foscar cache copies the parent's pages and
windows into each child's blocks. Child ``i`` draws with ``seed + i + 1``, so each sample is the
answer a request of that seed gets alone, and greedy children answer as their parent does.
"""

import time

import pytest

pytest.importorskip("transformers")

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.serving.sampling import child_request_id, request_seed  # noqa: E402

PROMPT = [(7 * i + 3) % 89 + 5 for i in range(75)]
# small windows, so that the parent holds quantized pages, one of them partly filled, when it
# forks (74 tokens: 4 sink, 8 recent, 62 quantized: 3 full pages of 16 and 14 tokens)
KVS = {
    "bf16": "bf16",
    "int4": KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4,
                     recent_tokens=8),
    "int2": KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 32), sink_tokens=4,
                     recent_tokens=8),
    # FlashInfer's pages through the torch reference attention (what runs off a GPU)
    "flashinfer-fp8": "flashinfer-fp8",
}


@pytest.fixture(scope="module")
def llama(sampling_llama):
    return sampling_llama


def _answers(manager, count: int, *, skip=()) -> dict:
    """The next ``count`` answers ``manager`` finishes, by request id (``skip``: ids whose
    outputs are passed over)."""
    done = {}
    while len(done) < count:
        out = manager.get_result(timeout=60)
        assert out is not None and out.error is None, out
        if out.is_finished() and out.request_id not in skip:
            done[out.request_id] = out.generated_tokens
    return done


def _run(model, kv: str, requests: list[tuple[str, int | None, dict]], **manager_args):
    """``requests``: ``(request_id, num_children, sampling)``; returns every answer by request id
    (children included) and the manager's kv_stats."""
    from foscar.serving import build_manager
    from foscar.serving.sampling import enable_sampling

    args = dict(num_blocks=64, block_size=16, max_new_tokens=10,
                backend="reference" if kv == "flashinfer-fp8" else "auto")
    manager = build_manager(model, kv, **{**args, **manager_args})
    enable_sampling(manager)
    manager.start()
    expected = sum(1 + (children or 0) for _, children, _ in requests)
    try:
        for request_id, children, sampling in requests:
            manager.add_request(PROMPT, request_id=request_id, num_children=children,
                                **sampling)
        done = _answers(manager, expected)
        stats = manager.kv_stats()
        if kv != "bf16":
            stats["pool_empty"] = _pool_empties(manager.cache)
    finally:
        manager.stop(block=True)
    return done, stats


def _pool_empties(cache, timeout: float = 10.0) -> bool:
    """Whether every block of the engine's pool comes back free (its last frees follow the last
    outputs) and foscar's pages too."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free = (cache.compute_free_capacity() if hasattr(cache, "compute_free_capacity")
                else cache.get_num_free_blocks() / cache.num_blocks)
        pages = getattr(getattr(cache, "paged", None), "cache", None)
        if free == 1.0 and (pages is None or pages.num_free_pages == pages.num_pages):
            return True
        time.sleep(0.05)
    return False


def test_child_ids_and_seeds():
    assert child_request_id("r", 0) == "r__child#0"
    assert request_seed(5, "r") == 5
    assert request_seed(5, child_request_id("r", 0)) == 6
    assert request_seed(5, child_request_id("r__child#9x", 2)) == 8


@pytest.mark.parametrize("name", list(KVS))
def test_each_sample_is_the_answer_of_its_seed_alone(llama, name):
    kv, hot = KVS[name], {"temperature": 1.0}
    forked, stats = _run(llama, kv, [("p", 2, {**hot, "seed": 5}), ("g", 1, {})])
    # each alone, its prompt cut as the engine cuts a prompt it forks: all tokens but the last,
    # then the last as a decode row (over the quantized history, where a one-piece prefill
    # attends over the prompt's exact K/V)
    alone = {}
    for request_id, sampling in [("s5", {**hot, "seed": 5}), ("s6", {**hot, "seed": 6}),
                                 ("s7", {**hot, "seed": 7}), ("g", {})]:
        answer, _ = _run(llama, kv, [(request_id, None, sampling)],
                         max_batch_tokens=len(PROMPT) - 1)
        alone.update(answer)
    assert forked["p"] == alone["s5"]
    assert forked[child_request_id("p", 0)] == alone["s6"]
    assert forked[child_request_id("p", 1)] == alone["s7"]
    assert len({tuple(forked[i]) for i in ("p", "p__child#0", "p__child#1")}) == 3
    assert forked["g"] == forked["g__child#0"] == alone["g"]
    if name != "bf16":  # (the engine's own cache keeps finished blocks for reuse)
        assert stats["forks"] == 3 and stats["restarts"] == 0 and stats["pool_empty"]


def test_children_beyond_the_window_slots_are_prefilled_on_their_own(llama):
    """Three window slots: the parent and two children fork, the third child is prefilled as a
    request of its own (the engine's way when a fork does not fit); all answer alike."""
    done, stats = _run(llama, KVS["int4"], [("g", 3, {})], max_requests=3)
    assert stats["forks"] == 2
    forked, _ = _run(llama, KVS["int4"], [("g", None, {})], max_batch_tokens=len(PROMPT) - 1)
    whole, _ = _run(llama, KVS["int4"], [("g", None, {})])  # prefilled in one piece
    assert done["g"] == done["g__child#0"] == done["g__child#1"] == forked["g"]
    assert done["g__child#2"] == whole["g"] and len(whole["g"]) == 10


def test_num_children_is_checked(llama):
    from foscar.serving import build_manager

    manager = build_manager(llama, "int4", num_blocks=16, block_size=16)
    for children, message in [(-1, "num_children must be an int >= 0"),
                              (True, "num_children must be an int >= 0")]:
        with pytest.raises(ValueError, match=message):
            manager.add_request(PROMPT[:8], request_id="r", num_children=children)
    with pytest.raises(ValueError, match="ends as the engine names a forked request's children"):
        manager.add_request(PROMPT[:8], request_id=child_request_id("r", 3))


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:1]])
def test_manager_wide_samples_fork_each_request(llama, prompt):
    """``num_return_sequences=3`` forks every request into two children (a one-token prompt's
    are requests of their own); an id is drawn for a request added without one."""
    from foscar.serving import build_manager

    manager = build_manager(llama, KVS["int4"], num_blocks=64, block_size=16, max_new_tokens=5,
                            num_return_sequences=3)
    manager.start()
    try:
        first = manager.add_request(prompt)
        done = _answers(manager, 3)
        stats = manager.kv_stats()
    finally:
        manager.stop(block=True)
    assert sorted(done) == [first, child_request_id(first, 0), child_request_id(first, 1)]
    assert len({tuple(a) for a in done.values()}) == 1  # greedy
    assert stats["forks"] == (2 if len(prompt) > 1 else 0)


def test_a_request_that_adopts_a_prefix_still_forks(llama):
    """Prefix sharing leaves a request that adopts a live donor's pages two prompt tokens to
    prefill, so that the engine can fork it (all but the last, then the last); without a recent
    window the adopted pages would reach its last token but one."""
    from foscar.serving import build_manager

    kv = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4)
    try:
        manager = build_manager(llama, kv, num_blocks=128, block_size=16, max_new_tokens=6,
                                prefix_sharing=True)
    except ValueError as e:  # transformers 5.17: no block ledger
        pytest.skip(str(e))
    manager.start()
    try:
        manager.add_request(PROMPT, request_id="donor", max_new_tokens=150, streaming=True)
        manager.get_result(timeout=60)  # the donor's first token: it is decoding
        manager.add_request(PROMPT[:69], request_id="x", num_children=2)
        done = _answers(manager, 3, skip={"donor"})
        stats = manager.kv_stats()
    finally:
        manager.stop(block=True)
    assert stats["shared_tokens"] > 0 and stats["forks"] == 2
    assert done["x"] == done["x__child#0"] == done["x__child#1"] and len(done["x"]) == 6


def test_a_one_token_prompt_gets_its_children_as_requests_of_their_own(llama):
    """The engine forks after prefilling all of a prompt but its last token; a one-token prompt's
    children are requests of their own, named and seeded as forks are."""
    from foscar.serving import build_manager
    from foscar.serving.sampling import enable_sampling

    answers = {}
    for children in (2, None):
        manager = build_manager(llama, KVS["int4"], num_blocks=16, block_size=16,
                                max_new_tokens=6)
        enable_sampling(manager)
        manager.start()
        try:
            manager.add_request([9], request_id="r", temperature=1.0, seed=5,
                                num_children=children)
            if not children:
                for request_id, seed in (("a6", 6), ("a7", 7)):
                    manager.add_request([9], request_id=request_id, temperature=1.0, seed=seed)
            answers.update({(children, i): a for i, a in _answers(manager, 3).items()})
        finally:
            manager.stop(block=True)
    assert answers[(2, "r")] == answers[(None, "r")]
    assert answers[(2, "r__child#0")] == answers[(None, "a6")]
    assert answers[(2, "r__child#1")] == answers[(None, "a7")]


def test_a_request_waits_for_its_childrens_window_slots(llama):
    """Three window slots, one held by a decoding request: a request of two children is admitted
    once three are free (its children's reserved with its own), so both fork; without the
    reservation one of them would find no slot at the fork and be prefilled again."""
    from foscar.serving import build_manager

    manager = build_manager(llama, KVS["int4"], num_blocks=64, block_size=16, max_new_tokens=6,
                            max_requests=3)
    manager.start()
    try:
        manager.add_request(PROMPT[:20], request_id="a", max_new_tokens=40, streaming=True)
        manager.get_result(timeout=60)  # a decodes: one slot is held
        manager.add_request(PROMPT, request_id="p", num_children=2)
        done = _answers(manager, 4)
        stats = manager.kv_stats()
    finally:
        manager.stop(block=True)
    assert stats["forks"] == 2 and stats["restarts"] == 0
    assert done["p"] == done["p__child#0"] == done["p__child#1"] and "a" in done


def test_with_prefix_sharing_forks_share_the_parents_full_pages(llama):
    """With prefix sharing the children hold the parent's full quantized pages counted, not
    copied (three of 16 tokens at the fork: 62 quantized tokens), in the engine's ledger too;
    the answers are those of copies."""
    copied, copied_stats = _run(llama, KVS["int4"], [("p", 2, {"temperature": 1.0, "seed": 5})])
    try:
        shared, shared_stats = _run(llama, KVS["int4"],
                                    [("p", 2, {"temperature": 1.0, "seed": 5})],
                                    prefix_sharing=True)
    except ValueError as e:  # transformers 5.17: no block ledger
        pytest.skip(str(e))
    assert shared == copied and shared_stats["forks"] == copied_stats["forks"] == 2
    assert shared_stats["pool_empty"] and copied_stats["pool_empty"]
    assert shared_stats["peak_pages"] == copied_stats["peak_pages"] - 2 * 3


def test_a_request_with_children_is_not_passed_over_for_slots(llama):
    """Three window slots, two held: a request of two children needs all three, and the single
    requests queued behind it wait beside the slots it waits for (before, each slot that freed
    went to one of them, and it started last)."""
    from foscar.serving import build_manager

    manager = build_manager(llama, KVS["int4"], num_blocks=64, block_size=16, max_new_tokens=5,
                            max_requests=3)
    manager.start()
    try:
        for i in range(2):
            manager.add_request(PROMPT[:20], request_id=f"s{i}", max_new_tokens=6 + 3 * i,
                                streaming=True)
        while manager.cache is None or len(manager.cache.paged.live_requests) < 2:
            time.sleep(0.01)
        manager.add_request(PROMPT, request_id="p", num_children=2)
        for i in range(2, 12):
            manager.add_request(PROMPT[:20], request_id=f"s{i}")
        order = list(_answers(manager, 15))
        stats = manager.kv_stats()
    finally:
        manager.stop(block=True)
    assert order.index("p") < order.index("s11") and stats["forks"] == 2


def test_children_the_blocks_cannot_fork_keep_their_slots(llama):
    """Three window slots and 16 blocks, most held by a long request: the fork of a request
    finds no blocks, so its reserved child is queued as a request of its own, holding its slot
    while it runs; requests after them find the slots as they are (no step is refused)."""
    from foscar.serving import build_manager

    long_prompt = [(5 * i + 1) % 89 + 5 for i in range(100)]
    manager = build_manager(llama, KVS["int4"], num_blocks=16, block_size=16, max_new_tokens=10,
                            max_requests=3)
    manager.start()
    try:
        manager.add_request(long_prompt, request_id="a", max_new_tokens=12, streaming=True)
        manager.get_result(timeout=60)  # a decodes
        manager.add_request(PROMPT, request_id="p", num_children=1, max_new_tokens=40)
        done = _answers(manager, 1, skip={"a"})
        assert set(done) == {"p"}  # the child, prefilled after p, is still running
        for x in "xyz":
            manager.add_request(PROMPT[:20], request_id=x, max_new_tokens=30)
        done.update(_answers(manager, 4, skip={"a"}))
        stats = manager.kv_stats()
    finally:
        manager.stop(block=True)
    assert set(done) == {"p", "p__child#0", "x", "y", "z"} and stats["forks"] == 0


def test_a_request_cancelled_while_it_waits_for_slots_stops_holding_them_back(llama):
    """A request of two children waits for three window slots (two held by long requests);
    cancelled, it no longer holds newer requests back: one behind it starts in the free slot."""
    from foscar.serving import build_manager

    manager = build_manager(llama, KVS["int4"], num_blocks=64, block_size=16, max_new_tokens=5,
                            max_requests=3)
    manager.start()
    try:
        for i in range(2):
            manager.add_request(PROMPT[:20], request_id=f"s{i}", max_new_tokens=120,
                                streaming=True)
        while manager.cache is None or len(manager.cache.paged.live_requests) < 2:
            time.sleep(0.01)
        manager.add_request(PROMPT, request_id="p", num_children=2)
        time.sleep(0.2)  # p is refused for slots, step after step
        manager.cancel_request("p")
        manager.add_request(PROMPT[:20], request_id="x", max_new_tokens=3)
        order = list(_answers(manager, 3))
    finally:
        manager.stop(block=True)
    assert order[0] == "x"  # before the long requests end
