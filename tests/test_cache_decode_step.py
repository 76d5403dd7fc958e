"""Planned decode steps (QuantizedKVCache.plan_decode_step + write_decode_step) against
append + plan, bit for bit: every pool and window tensor and every decode output after every
step, over lengths 1, primes, page and window boundaries, sink filling and ring eviction, several
layers, the torch and the fused write (the Triton interpreter on a CPU), padding rows; the
step's device tensors keep their address; and the calls it must refuse, leaving state as it was.
"""

import pytest
import torch
from conftest import KERNEL_DEVICE

from foscar import KVFormat, QuantFormat, QuantizedKVCache, decode_attention
from foscar.backends import triton as triton_backend

H, HQ, D, PAGE, LAYERS = 2, 4, 64, 16, 3

FORMATS = {
    # windows: sink 4, recent 8 (ring of 9 slots): short prompts fill the sink, long ones evict
    "int4-windows": KVFormat(
        QuantFormat(4, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4, recent_tokens=8
    ),
    # no windows: every token is quantized at once (the new token itself is demoted)
    "int2-no-windows": KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 32)),
    # one format per layer, a sink only
    "per-layer-sink": [
        KVFormat(QuantFormat(4, "token", 64), QuantFormat(2, "token", 64), sink_tokens=3),
        KVFormat(QuantFormat(2, "token", 32), QuantFormat(4, "token", 64), sink_tokens=3),
        KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), sink_tokens=3),
    ],
    # channel-wise V: groups of 32 tokens demoted at once, written by torch
    "channel-v": KVFormat(
        QuantFormat(2, "token", 64), QuantFormat(2, "channel", 32), sink_tokens=2, recent_tokens=5
    ),
}
TOKEN_WISE = [name for name in FORMATS if name != "channel-v"]
PROMPTS = [0, 1, 3, 13, 17, 31]  # empty, inside the sink, across windows and pages


def _cache(fmt, decode_write="torch", **kw):
    args = dict(num_kv_heads=H, head_dim=D, num_pages=64, max_seqs=8, num_layers=LAYERS,
                page_size=PAGE, device=KERNEL_DEVICE, decode_write=decode_write)
    return QuantizedKVCache(fmt, **{**args, **kw})


def _snapshot(cache):
    """Every pool tensor's bytes (NaN and the sign of zero compared bit for bit)."""
    return [t.contiguous().view(torch.uint8).clone() for st in cache.layers
            for t in st.tensors().values()]


def _unchanged(cache, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_snapshot(cache), before, strict=True))


def _prefilled(fmt, gen, decode_write="torch", **kw):
    """Two caches holding the same prompts (PROMPTS, one sequence each, ids 0..5)."""
    caches = [_cache(fmt), _cache(fmt, decode_write, **kw)]
    for c in caches:
        for sid in range(len(PROMPTS)):
            c.add_sequence(sid)
    for layer in range(LAYERS):
        for sid, n in enumerate(PROMPTS):
            if n:
                k, v = (torch.randn(n, H, D, generator=gen) for _ in range(2))
                for c in caches:
                    c.append([sid], k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), [n], layer=layer)
    return caches


def _order(step):
    """The decoding sequences of step ``step``: all, or a subset, in changing orders."""
    ids = list(range(len(PROMPTS)))
    ids = ids[step % len(ids):] + ids[: step % len(ids)]
    return ids if step % 3 else ids[::2]


def _run_pair(fmt, steps, *, decode_write="torch", padding=0, backend="reference", seed=0):
    """Decode ``steps`` steps through append + plan (``ref``) and through planned steps
    (``got``), comparing every output and every pool tensor after every step."""
    gen = torch.Generator().manual_seed(seed)
    ref, got = _prefilled(fmt, gen, decode_write)
    for step in range(steps):
        ids = _order(step)
        n = len(ids)
        planned = got.plan_decode_step(ids, padding_rows=padding)
        assert planned.rows == n + padding and planned.batches[0].batch_size == n + padding
        for layer in range(LAYERS):
            # padding rows carry garbage: they must be written nowhere
            k, v = (torch.randn(n + padding, H, D, generator=gen) * 3 for _ in range(2))
            q = torch.randn(n + padding, HQ, D, generator=gen).to(torch.bfloat16)
            k, v, q = k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), q.to(KERNEL_DEVICE)
            ref.append(ids, k[:n], v[:n], layer=layer)
            plan = ref.plan(ids, layer)
            want = decode_attention(q[:n], ref, plan, backend=backend)
            got.write_decode_step(layer, k, v, planned)
            out = decode_attention(q, got, planned.batches[layer], backend=backend)
            assert torch.equal(out[:n], want), f"step {step} layer {layer}"
            assert torch.isfinite(out[n:]).all()
        for a, b in zip(_snapshot(ref), _snapshot(got)):
            assert torch.equal(a, b), f"step {step}"
    for sid in range(len(PROMPTS)):
        for layer in range(LAYERS):
            assert got.seq_len(sid, layer) == ref.seq_len(sid, layer)
        assert got.pages_of(sid) == ref.pages_of(sid)
    return ref, got


@pytest.mark.parametrize("name", list(FORMATS))
def test_planned_steps_equal_append_and_plan(name):
    _run_pair(FORMATS[name], 20)


fused_available = pytest.mark.skipif(
    not triton_backend.available(torch.device(KERNEL_DEVICE)), reason="Triton is not installed"
)


@fused_available
@pytest.mark.parametrize("name", TOKEN_WISE)
def test_planned_steps_fused_write_equal_append(name, monkeypatch):
    """The fused write reads the step's descriptors (one launch per role and layer)."""
    from foscar.cache import fused_write

    launches = []
    launch = fused_write.write_decode_tokens
    monkeypatch.setattr(
        fused_write, "write_decode_tokens", lambda *a: launches.append(a[2]) or launch(*a)
    )
    _run_pair(FORMATS[name], 14, decode_write="fused", seed=1)
    # every planned step and layer, and the one-token prompt's append (a decode step too)
    assert launches == ["k", "v"] * (14 + 1) * LAYERS


@pytest.mark.parametrize("name", ["int4-windows", "int2-no-windows", "channel-v"])
def test_padding_rows_write_nothing_and_read_a_stored_token(name):
    _run_pair(FORMATS[name], 9, padding=3, seed=2)


@fused_available
def test_padding_rows_fused_write_and_kernel():
    """Padding through the fused write and the Triton decode kernel, whose split count is
    planned for a fixed history (split_history) as a captured step's is."""
    fmt = FORMATS["int4-windows"]
    gen = torch.Generator().manual_seed(3)
    ref, got = _prefilled(fmt, gen, "fused")
    for step in range(3):
        ids = _order(step)
        n = len(ids)
        planned = got.plan_decode_step(ids, padding_rows=2, split_history=4096)
        assert all(b.split_history == 4096 for b in planned.batches)
        for layer in range(LAYERS):
            k, v = (torch.randn(n + 2, H, D, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
            q = torch.randn(n + 2, HQ, D, generator=gen).to(torch.bfloat16).to(KERNEL_DEVICE)
            ref.append(ids, k[:n], v[:n], layer=layer)
            want = decode_attention(q[:n], ref, ref.plan(ids, layer), backend="triton")
            got.write_decode_step(layer, k, v, planned)
            out = decode_attention(q, got, planned.batches[layer], backend="triton")
            # the split count differs (fixed history): the merge rounds differently
            torch.testing.assert_close(out[:n], want, atol=2e-2, rtol=2e-2)
            assert torch.isfinite(out[n:].float()).all()
        for a, b in zip(_snapshot(ref), _snapshot(got)):
            assert torch.equal(a, b), f"step {step}"


def test_step_tensors_keep_their_address():
    """Every step of as many rows hands the kernels the same tensors (a captured graph's
    pointers stay right); a reserved storage never moves, whatever the row count."""
    gen = torch.Generator().manual_seed(4)
    cache = _cache(FORMATS["int4-windows"])
    cache.reserve_decode_rows(12)
    for sid in range(6):
        cache.add_sequence(sid)
    seen = {}
    for step in range(8):
        ids = list(range(6)) if step % 2 else [1, 4]
        planned = cache.plan_decode_step(ids, padding_rows=6 - len(ids) + 4)
        assert planned.rows == 10
        b = planned.batches[0]
        ptrs = (id(b), planned.desc.data_ptr(), b.kv_indptr.data_ptr(), b.kv_indices.data_ptr(),
                b.seq_lens.data_ptr(), b.num_quantized.data_ptr(), b.slots.data_ptr(),
                b.kv_last_page_len.data_ptr())
        seen.setdefault("ptrs", ptrs)
        assert ptrs == seen["ptrs"]
        for layer in range(LAYERS):
            x = torch.randn(10, H, D, generator=gen).to(KERNEL_DEVICE)
            cache.write_decode_step(layer, x, x, planned)
        # the device tensors say what the host lists say
        assert b.seq_lens.tolist() == b.seq_lens_host
        assert b.slots.tolist() == b.slots_host
        assert b.num_quantized.tolist() == b.num_quantized_host
        pages = b.kv_indices[: int(b.kv_indptr[-1])].tolist()
        assert pages == [p for ps in b.pages_host for p in ps]
    assert cache.seq_len(1, LAYERS - 1) == 8 and cache.seq_len(0, 0) == 4


def test_planned_step_refusals_change_nothing():
    fmt = FORMATS["int4-windows"]
    cache = _cache(fmt, num_pages=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    x = torch.randn(20, H, D).to(KERNEL_DEVICE)
    for layer in range(LAYERS):
        cache.append([a], x, x, [20], layer=layer)
    cache.append([b], x[:1], x[:1], layer=0)  # b holds a token in layer 0 only

    def state():
        return ([cache.seq_len(s, layer) for s in (a, b) for layer in range(LAYERS)],
                cache.pages_of(a), cache.pages_of(b), cache.num_free_pages)

    current = cache.plan_decode_step([a])  # a refused plan must leave it the latest step
    for layer in range(LAYERS):
        cache.write_decode_step(layer, x[:1], x[:1], current)
    before = state()
    with pytest.raises(ValueError, match=r"holds \[1, 0, 0\] tokens per layer"):
        cache.plan_decode_step([a, b])
    with pytest.raises(ValueError, match="distinct"):
        cache.plan_decode_step([a, a])
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.plan_decode_step([a, 7])
    with pytest.raises(ValueError, match="at least one"):
        cache.plan_decode_step([])
    with pytest.raises(ValueError, match="padding_rows must be >= 0"):
        cache.plan_decode_step([a], padding_rows=-1)
    with pytest.raises(ValueError, match="split_history must be >= 1"):
        cache.plan_decode_step([a], split_history=0)
    assert state() == before
    cache.record_replayed_step(current)  # raises if a refusal had made it stale
    # 21 tokens now; 44 tokens fill both pages, the 45th needs a third
    for _ in range(23):
        step = cache.plan_decode_step([a])
        for layer in range(LAYERS):
            cache.write_decode_step(layer, x[:1], x[:1], step)
    assert cache.num_free_pages == 0
    full = state()
    with pytest.raises(ValueError, match="page pool exhausted"):
        cache.plan_decode_step([a])
    assert state() == full


def test_write_refuses_a_stale_step_or_wrong_tensors():
    fmt = FORMATS["int4-windows"]
    cache = _cache(fmt)
    other = _cache(fmt)
    a, b = cache.add_sequence(), cache.add_sequence()
    other.add_sequence(a)
    first = cache.plan_decode_step([a, b])
    x = torch.randn(2, H, D).to(KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"must have shape \[rows=2"):
        cache.write_decode_step(0, x[:1], x[:1], first)
    with pytest.raises(ValueError, match="layer must be in"):
        cache.write_decode_step(LAYERS, x, x, first)
    with pytest.raises(TypeError, match="DecodeStep"):
        cache.write_decode_step(0, x, x, first.batches[0])
    with pytest.raises(ValueError, match="latest planned step"):
        other.write_decode_step(0, x, x, first)
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"unwritten in layers \[0, 1, 2\]"):
        cache.plan_decode_step([a, b])
    assert _unchanged(cache, before) and [cache.seq_len(s) for s in (a, b)] == [1, 1]
    for layer in range(LAYERS):
        cache.write_decode_step(layer, x, x, first)
    second = cache.plan_decode_step([a, b])
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="latest planned step"):
        cache.write_decode_step(0, x, x, first)
    assert _unchanged(cache, before)
    cache.write_decode_step(0, x, x, second)
    cache.free(b)
    with pytest.raises(ValueError, match="latest planned step"):
        cache.write_decode_step(1, x, x, second)
    cache.plan_decode_step([a])  # the half-written step's sequences are not all live: a new one


def test_write_refuses_a_step_whose_sequence_was_appended_to():
    """An append to a planned sequence in the layer being written makes the step stale there
    (its positions would overwrite the appended token); other layers and other sequences'
    appends leave it valid."""
    fmt = FORMATS["int4-windows"]
    cache = _cache(fmt)
    a, b, c = (cache.add_sequence() for _ in range(3))
    step = cache.plan_decode_step([a, b])
    x = torch.randn(2, H, D).to(KERNEL_DEVICE)
    one = torch.randn(1, H, D).to(KERNEL_DEVICE)
    cache.append([c], one, one, [1], layer=0)  # another sequence: the step stays valid
    cache.write_decode_step(0, x, x, step)
    cache.append([a], one, one, [1], layer=1)
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="stale plan"):
        cache.write_decode_step(1, x, x, step)
    assert _unchanged(cache, before)


def test_reserved_rows_bound_a_step():
    cache = _cache(FORMATS["int4-windows"])
    cache.reserve_decode_rows(4)
    ids = [cache.add_sequence() for _ in range(3)]
    with pytest.raises(ValueError, match="reserved 4"):
        cache.plan_decode_step(ids, padding_rows=2)
    assert [cache.seq_len(s) for s in ids] == [0, 0, 0]
    cache.plan_decode_step(ids, padding_rows=1)
    with pytest.raises(ValueError, match="before the first plan_decode_step"):
        cache.reserve_decode_rows(8)


def test_replayed_step_counts_every_layer_written():
    """A CUDA graph replay runs the captured writes without their host code:
    record_replayed_step counts every layer written, so the next step may be planned; it
    refuses anything but the latest step and changes nothing then."""
    cache = _cache(FORMATS["int4-windows"])
    a, b = cache.add_sequence(), cache.add_sequence()
    first = cache.plan_decode_step([a, b])
    x = torch.randn(2, H, D).to(KERNEL_DEVICE)
    cache.write_decode_step(0, x, x, first)  # (a graph captures layer 0's host code too)
    with pytest.raises(TypeError, match="DecodeStep"):
        cache.record_replayed_step(first.batches[0])
    cache.record_replayed_step(first)
    assert first.written == set(range(LAYERS))
    second = cache.plan_decode_step([a, b])
    with pytest.raises(ValueError, match="latest planned step"):
        cache.record_replayed_step(first)
    assert second.written == set()
    with pytest.raises(ValueError, match=r"unwritten in layers \[0, 1, 2\]"):
        cache.plan_decode_step([a, b])
    assert [cache.seq_len(s) for s in (a, b)] == [2, 2]
