"""Shared prefixes in the cache (QuantizedKVCache.shareable_pages / adopt_prefix): a sequence that
adopts another's full history pages holds them counted, not copied, and decodes bit for bit as the
same sequence writing every token itself; pages go back to the pool with their last holder; the
calls refuse what would break a holder, before changing anything.
"""

import pytest
import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache, decode_attention

H, HQ, D, PAGE, LAYERS = 2, 4, 64, 16, 2

FORMATS = {
    "int4-windows": KVFormat(
        QuantFormat(4, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4, recent_tokens=8
    ),
    "int2-no-windows": KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 32)),
    "per-layer-sink": [
        KVFormat(QuantFormat(4, "token", 64), QuantFormat(2, "token", 64), sink_tokens=3,
                 recent_tokens=5),
        KVFormat(QuantFormat(2, "token", 32), QuantFormat(4, "token", 64), sink_tokens=3,
                 recent_tokens=5),
    ],
    # channel-wise V: groups of 32 tokens demoted at once (the quantum), two pages each
    "channel-v": KVFormat(
        QuantFormat(2, "token", 64), QuantFormat(2, "channel", 32), sink_tokens=2, recent_tokens=5
    ),
}


def _cache(fmt, **kw):
    args = dict(num_kv_heads=H, head_dim=D, num_pages=32, max_seqs=4, num_layers=LAYERS,
                page_size=PAGE, decode_write="torch")
    return QuantizedKVCache(fmt, **{**args, **kw})


def _tokens(n, gen):
    """K or V of ``n`` tokens, BF16 values (what a model hands the cache)."""
    return torch.randn(n, LAYERS, H, D, generator=gen).to(torch.bfloat16).float()


def _write(cache, sid, k, v, start=0):
    n = k.shape[0] - start
    if n:
        for layer in range(LAYERS):
            cache.append([sid], k[start:, layer], v[start:, layer], [n], layer=layer)


def _decode_equal(caches_ids, steps, gen, *, planned=False):
    """Decode ``steps`` equal tokens into each ``(cache, seq_id)`` and check the outputs are
    equal, bit for bit, at every layer and step."""
    for step in range(steps):
        k, v = _tokens(1, gen), _tokens(1, gen)
        q = torch.randn(1, HQ, D, generator=gen).to(torch.bfloat16)
        outs = []
        for cache, sid in caches_ids:
            plan = cache.plan_decode_step([sid]) if planned else None
            per_layer = []
            for layer in range(LAYERS):
                if planned:
                    cache.write_decode_step(layer, k[:, layer], v[:, layer], plan)
                    batch = plan.batches[layer]
                else:
                    cache.append([sid], k[:, layer], v[:, layer], layer=layer)
                    batch = cache.plan([sid], layer)
                per_layer.append(decode_attention(q, cache, batch, backend="reference"))
            outs.append(per_layer)
        for other in outs[1:]:
            for layer, (a, b) in enumerate(zip(outs[0], other)):
                assert torch.equal(a, b), f"step {step} layer {layer}"


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("planned", [False, True])
def test_adopted_prefix_decodes_as_written(name, planned):
    fmt = FORMATS[name]
    if planned and name == "channel-v":
        planned = False  # planned steps are token-wise only; the append path covers it
    gen = torch.Generator().manual_seed(0)
    common, prompt_b, prompt_a = 75, 83, 97
    k_a, v_a = _tokens(prompt_a, gen), _tokens(prompt_a, gen)
    k_b, v_b = torch.cat([k_a[:common], _tokens(prompt_b - common, gen)]), None
    v_b = torch.cat([v_a[:common], _tokens(prompt_b - common, gen)])

    shared, alone = _cache(fmt), _cache(fmt)
    shared.add_sequence("a")
    _write(shared, "a", k_a, v_a)
    shared.add_sequence("b")
    pages = shared.shareable_pages("a", common, prompt_b)
    assert pages >= 2
    start = shared.adopt_prefix("b", "a", pages)
    assert start == shared.formats[0].sink_tokens + pages * PAGE <= common
    assert shared.pages_of("b") == shared.pages_of("a")[:pages]
    _write(shared, "b", k_b, v_b, start)
    alone.add_sequence("b")
    _write(alone, "b", k_b, v_b)

    # the prefix is stored once: the pool holds a's pages and b's own ones
    held = shared.num_pages - shared.num_free_pages
    assert held == len(shared.pages_of("a")) + len(shared.pages_of("b")) - pages
    assert held == len(shared.pages_of("a")) + len(alone.pages_of("b")) - pages
    assert shared.num_shared_pages == pages
    assert shared.memory_stats()["shared_pages"] == pages
    assert all(shared.page_holders(p) == 2 for p in shared.pages_of("b")[:pages])
    for layer in range(LAYERS):
        got, want = shared.plan(["b"], layer), alone.plan(["b"], layer)
        assert got.num_quantized_host == want.num_quantized_host
        assert got.seq_lens_host == want.seq_lens_host

    _decode_equal([(shared, "b"), (alone, "b")], 6, gen, planned=planned)
    # the donor ends: b keeps the shared pages and decodes on unchanged
    a_pages = shared.pages_of("a")
    shared.free("a")
    assert shared.num_shared_pages == 0
    assert not any(shared.page_is_free(p) for p in a_pages[:pages])
    assert all(shared.page_is_free(p) for p in a_pages[pages:])
    _decode_equal([(shared, "b"), (alone, "b")], 6, gen, planned=planned)
    shared.free("b")
    assert shared.num_free_pages == shared.num_pages


def test_adopted_prefix_fused_decode_write():
    """The fused decode write (Triton; the interpreter on a CPU) of an adopted sequence's planned
    steps gives the bits the torch write gives the same sequence written alone."""
    fmt = FORMATS["int4-windows"]
    gen = torch.Generator().manual_seed(6)
    k, v = _tokens(60, gen), _tokens(60, gen)
    shared, alone = _cache(fmt, decode_write="fused"), _cache(fmt)
    shared.add_sequence("a")
    _write(shared, "a", k, v)
    shared.add_sequence("b")
    start = shared.adopt_prefix("b", "a", shared.shareable_pages("a", 60, 60))
    _write(shared, "b", k, v, start)
    alone.add_sequence("b")
    _write(alone, "b", k, v)
    _decode_equal([(shared, "b"), (alone, "b")], 3, gen, planned=True)


def test_adopter_freed_first_leaves_the_donor_unchanged():
    """Preempting or cancelling a sharer: the donor (and a third sharer) decode as before."""
    fmt = FORMATS["int4-windows"]
    gen = torch.Generator().manual_seed(1)
    k, v = _tokens(90, gen), _tokens(90, gen)
    shared, alone = _cache(fmt), _cache(fmt)
    for cache in (shared, alone):
        cache.add_sequence("a")
        _write(cache, "a", k, v)
    pages = shared.shareable_pages("a", 80, 90)
    assert pages == 4
    for sid in ("b", "c"):
        shared.add_sequence(sid)
        start = shared.adopt_prefix(sid, "a", pages)
        _write(shared, sid, k, v, start)
    assert [shared.page_holders(p) for p in shared.pages_of("b")] == [3] * pages + [1]
    own = shared.pages_of("b")[pages:]
    shared.free("b")
    assert all(shared.page_is_free(p) for p in own)
    assert [shared.page_holders(p) for p in shared.pages_of("c")] == [2] * pages + [1]
    # c holds a's 90 tokens too: all three decode alike
    _decode_equal([(shared, "a"), (shared, "c"), (alone, "a")], 4, gen)
    # a restarted sharer adopts the pages again
    shared.add_sequence("b")
    assert shared.shareable_pages("a", 80, 90) == shared.shareable_pages("c", 80, 90) > 0


def test_multi_turn_reuses_the_earlier_turns_pages():
    """A chat's next turn (its history plus new tokens) adopts the pages of its previous turn."""
    fmt = FORMATS["int4-windows"]
    gen = torch.Generator().manual_seed(2)
    k, v = _tokens(150, gen), _tokens(150, gen)
    shared, alone = _cache(fmt), _cache(fmt)
    shared.add_sequence("turn1")
    _write(shared, "turn1", k[:70], v[:70])
    shared.add_sequence("turn2")
    pages = shared.shareable_pages("turn1", 70, 150)
    assert pages == (70 - 4 - 8) // PAGE  # every full page the first turn quantized
    start = shared.adopt_prefix("turn2", "turn1", pages)
    shared.free("turn1")  # the first turn's request ended before the second arrives
    _write(shared, "turn2", k, v, start)
    alone.add_sequence("turn2")
    _write(alone, "turn2", k, v)
    _decode_equal([(shared, "turn2"), (alone, "turn2")], 4, gen)


def test_shareable_pages_stops_before_the_adopters_window():
    fmt = FORMATS["int4-windows"]  # sink 4, recent 8
    gen = torch.Generator().manual_seed(3)
    cache = _cache(fmt)
    cache.add_sequence("a")
    _write(cache, "a", _tokens(100, gen), _tokens(100, gen))  # 88 quantized: 5 full pages
    assert cache.shareable_pages("a", 100, 100) == 5
    assert cache.shareable_pages("a", 100, 40) == 1  # its own 28 quantized tokens: 1 full page
    assert cache.shareable_pages("a", 19, 100) == 0  # 15 common history tokens: no full page
    assert cache.shareable_pages("a", 0, 100) == 0


def test_adopt_refusals_change_nothing():
    fmt = FORMATS["int4-windows"]
    gen = torch.Generator().manual_seed(4)
    cache = _cache(fmt)
    cache.add_sequence("a")
    _write(cache, "a", _tokens(60, gen), _tokens(60, gen))  # 48 quantized: 3 pages
    cache.add_sequence("b")
    cache.add_sequence("c")
    _write(cache, "c", _tokens(3, gen), _tokens(3, gen))
    free = cache.num_free_pages
    with pytest.raises(ValueError, match="num_pages must be <= 3"):
        cache.adopt_prefix("b", "a", 4)
    with pytest.raises(ValueError, match="must be empty"):
        cache.adopt_prefix("c", "a", 1)
    with pytest.raises(ValueError, match="is seq_id itself"):
        cache.adopt_prefix("a", "a", 1)
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.adopt_prefix("b", "gone", 1)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        cache.adopt_prefix("b", "a", 0)
    assert cache.num_free_pages == free and cache.num_shared_pages == 0
    assert cache.pages_of("b") == [] and cache.seq_len("b") == 0


def test_wide_quantum_shares_whole_groups_only():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "channel", 32), sink_tokens=2)
    gen = torch.Generator().manual_seed(5)
    cache = _cache(fmt)
    cache.add_sequence("a")
    _write(cache, "a", _tokens(70, gen), _tokens(70, gen))  # 64 quantized: 4 pages
    cache.add_sequence("b")
    assert cache.shareable_pages("a", 70, 70) == 4
    assert cache.shareable_pages("a", 60, 70) == 2  # 58 history tokens: 3 pages, 1 group
    with pytest.raises(ValueError, match="multiple of the demotion quantum"):
        cache.adopt_prefix("b", "a", 3)


# ---------------------------------------------------------------------------- forks
def _fork_into(cache, child, parent, shared=False) -> int:
    """Fork ``parent`` into a new sequence ``child`` (a serving engine's fork: a fresh block for
    each block of the parent it does not share); ``shared``: share every page it may. Returns
    the pages shared."""
    length = cache.seq_len(parent)
    share = cache.shareable_pages(parent, length, length) if shared else 0
    pages = cache.free_page_order()[::-1][: len(cache.pages_of(parent)) - share]
    cache.add_sequence(child, pages=pages)
    cache.fork(child, parent, share)
    return share


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("length", [1, 5, 37, 64, 90])
@pytest.mark.parametrize("shared", [False, True])
def test_fork_continues_as_the_parent_and_then_apart(name, length, shared):
    """A fork decodes bit for bit as its parent; after that each takes its own tokens, and each
    decodes as a sequence that wrote its tokens alone (the other's writes never reach it), its
    full quantized pages shared or copied."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(length)
    k, v = _tokens(length, gen), _tokens(length, gen)
    forked, parent_alone, child_alone = _cache(fmt), _cache(fmt), _cache(fmt)
    for cache in (forked, parent_alone, child_alone):
        cache.add_sequence("a")
        _write(cache, "a", k, v)
    share = _fork_into(forked, "b", "a", shared)
    assert forked.sequence_state("b").lengths == forked.sequence_state("a").lengths
    common = set(forked.pages_of("a")) & set(forked.pages_of("b"))
    assert common == set(forked.pages_of("a")[:share])
    assert all(forked.page_holders(p) == 2 for p in common)
    if shared and length == 90:
        # the full pages of its quantized history (whole quanta): 78, 90, 82 and 64 tokens
        assert share == {"int4-windows": 4, "int2-no-windows": 5, "per-layer-sink": 5,
                         "channel-v": 4}[name]
    _decode_equal([(forked, "a"), (forked, "b"), (parent_alone, "a"), (child_alone, "a")], 3, gen)
    # apart: a and b take different tokens, past the recent window and a demotion quantum
    for cache, sid in ((forked, "a"), (parent_alone, "a"), (forked, "b"), (child_alone, "a")):
        seed = 100 if cache is forked and sid == "a" or cache is parent_alone else 200
        own = torch.Generator().manual_seed(seed)
        more_k, more_v = _tokens(40, own), _tokens(40, own)
        _write(cache, sid, more_k, more_v)
    _decode_equal([(forked, "a"), (parent_alone, "a")], 2, torch.Generator().manual_seed(7))
    _decode_equal([(forked, "b"), (child_alone, "a")], 2, torch.Generator().manual_seed(7))


@pytest.mark.parametrize("shared", [False, True])
def test_fork_of_a_sequence_that_adopted_pages(shared):
    """A fork of a sequence that adopted another's pages takes its history floor: it decodes as
    its parent, and freeing the parent leaves the fork and the donor as they were (the pages
    the three share held by the other two)."""
    fmt = FORMATS["int4-windows"]
    gen = torch.Generator().manual_seed(3)
    k, v = _tokens(90, gen), _tokens(90, gen)
    cache, alone = _cache(fmt), _cache(fmt)
    alone.add_sequence("a")
    _write(alone, "a", k, v)
    cache.add_sequence("d")
    _write(cache, "d", k, v)
    cache.add_sequence("a")
    start = cache.adopt_prefix("a", "d", cache.shareable_pages("d", 80, 90))
    _write(cache, "a", k, v, start)
    share = _fork_into(cache, "b", "a", shared)
    assert cache.sequence_state("b").history_floor == cache.sequence_state("a").history_floor > 0
    assert [cache.page_holders(p) for p in cache.pages_of("b")[:share]] == [3] * share
    cache.free("a")
    _decode_equal([(cache, "b"), (cache, "d"), (alone, "a")], 4, gen)


def test_fork_refusals_change_nothing():
    fmt = FORMATS["int4-windows"]
    gen = torch.Generator().manual_seed(4)
    k, v = _tokens(90, gen), _tokens(90, gen)
    cache = _cache(fmt)
    cache.add_sequence("a")
    _write(cache, "a", k, v)
    need = cache.history_pages("a")
    assert need == 5  # 90 - 4 sink - 8 recent = 78 quantized tokens: 4 full pages and a part
    cache.add_sequence("few", pages=cache.free_page_order()[::-1][: need - 1])
    cache.add_sequence("full")
    _write(cache, "full", k[:3], v[:3])
    before = {sid: cache.sequence_state(sid) for sid in cache.sequences}
    pools = [t.clone() for st in cache.layers for t in st.tensors().values()]
    with pytest.raises(ValueError, match="shared_pages must be <= 4"):
        cache.fork("few", "a", 5)
    for seq_id, parent_id, message in [
        ("few", "a", "holds 4 pages; the fork copies 5"),
        ("full", "a", "must be empty"),
        ("a", "a", "is seq_id itself"),
        ("few", "nobody", "parent_id 'nobody' is not a live sequence"),
        ("nobody", "a", "seq_id 'nobody' is not a live sequence"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.fork(seq_id, parent_id)
    assert {sid: cache.sequence_state(sid) for sid in cache.sequences} == before
    after = [t for st in cache.layers for t in st.tensors().values()]
    assert all(torch.equal(a, b) for a, b in zip(pools, after))
