"""Reference (b), the folded tiled split-KV computation, against reference (a).

In float64 the two must agree to 1e-10 for every format, page size, ragged length, GQA ratio,
head_dim and window setting: folding is exact in exact arithmetic (error source (c) is zero).
"""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.reference import attend_dequantized, attend_folded, attention, merge_partials

NUM_KV_HEADS = 2
GQA_RATIOS = (1, 2, 3, 4, 8)
# lengths 1, primes, and non-multiples of every page and group size
LENGTHS = (1, 17, 113, 263)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def build(fmt, head_dim, page_size, lengths, *, seed=0, decode_steps=3, dtype=torch.float32):
    """A cache holding ragged sequences written by a prefill and a few decode steps."""
    g = torch.Generator().manual_seed(seed)
    pages = sum(math.ceil((n + decode_steps) / page_size) for n in lengths) + 1
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        num_pages=pages,
        max_seqs=len(lengths),
        page_size=page_size,
    )
    ids = [cache.add_sequence() for _ in lengths]
    total = sum(lengths)
    # zero-mean K and V with per-channel spread, so offsets and scales both matter
    spread = torch.linspace(0.2, 3.0, head_dim)
    k = torch.randn(total, NUM_KV_HEADS, head_dim, generator=g) * spread + 0.3
    v = torch.randn(total, NUM_KV_HEADS, head_dim, generator=g) * spread.flip(0) - 0.2
    cache.append(ids, k.to(dtype), v.to(dtype), list(lengths))
    for _ in range(decode_steps):
        k = torch.randn(len(ids), NUM_KV_HEADS, head_dim, generator=g)
        cache.append(ids, k, torch.randn(len(ids), NUM_KV_HEADS, head_dim, generator=g))
    return cache, cache.plan(ids)


def queries(batch, ratio, head_dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(
            batch.batch_size, NUM_KV_HEADS * ratio, head_dim, generator=g, dtype=torch.float64
        )
        * 2
    )


def grid():
    # The page size rotates over the cases instead of multiplying them by five (a grid reduced
    # from 840 cases: every page size still meets every bit pair, axis pair, head_dim, group
    # size and window setting).
    index = 0
    for (kb, vb), (ka, va), head_dim, g, windows in itertools.product(
        [(2, 2), (4, 4), (2, 4), (4, 2)],
        [("token", "token"), ("token", "channel"), ("channel", "token"), ("channel", "channel")],
        [64, 128],
        [32, 64, 128],
        [False, True],
    ):
        if g > head_dim and "token" in (ka, va):
            continue  # token-wise groups must divide head_dim
        page_size = (16, 32, 64, 128, 256)[index % 5]
        index += 1
        yield kb, vb, ka, va, head_dim, g, page_size, windows


GRID = list(grid())


@pytest.mark.parametrize(
    "kb,vb,ka,va,head_dim,g,page_size,windows",
    GRID,
    ids=[f"K{a}{c}-V{b}{d}-D{e}-g{f}-ps{p}-w{int(w)}" for a, b, c, d, e, f, p, w in GRID],
)
def test_folded_equals_dequantized_float64(kb, vb, ka, va, head_dim, g, page_size, windows):
    # The tile and split shapes are the folded computation's own knobs, not the cache's: they
    # rotate with the case instead of multiplying the grid.
    index = GRID.index((kb, vb, ka, va, head_dim, g, page_size, windows))
    block_n = (64, 48, 128, 100)[index % 4]
    num_splits = (1, 3, 5)[index % 3]
    fmt = KVFormat(
        QuantFormat(kb, ka, g),
        QuantFormat(vb, va, g if va == ka else min(g, 64)),
        sink_tokens=5 if windows else 0,
        recent_tokens=11 if windows else 0,
    )
    cache, batch = build(fmt, head_dim, page_size, LENGTHS, seed=index)
    for ratio in GQA_RATIOS:
        q = queries(batch, ratio, head_dim, seed=ratio)
        o_a, lse_a = attend_dequantized(q, cache, batch)
        o_b, lse_b = attend_folded(q, cache, batch, block_n=block_n, num_splits=num_splits)
        assert rel(o_b, o_a) <= 1e-10, (ratio, rel(o_b, o_a))
        assert float((lse_b - lse_a).abs().max()) <= 1e-10
        assert o_b.shape == (len(LENGTHS), NUM_KV_HEADS * ratio, head_dim)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_every_page_size_with_a_long_sequence(page_size):
    fmt = KVFormat(
        QuantFormat(2, "channel", 128), QuantFormat(4, "token", 32), sink_tokens=4, recent_tokens=64
    )
    cache, batch = build(fmt, 128, page_size, (4097, 1, 300), decode_steps=2)
    q = queries(batch, 4, 128)
    o_a, lse_a = attend_dequantized(q, cache, batch)
    o_b, lse_b = attend_folded(q, cache, batch, block_n=128, num_splits=7)
    assert rel(o_b, o_a) <= 1e-10
    assert float((lse_b - lse_a).abs().max()) <= 1e-10


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bits=st.tuples(st.sampled_from([2, 4]), st.sampled_from([2, 4])),
    axes=st.tuples(st.sampled_from(["token", "channel"]), st.sampled_from(["token", "channel"])),
    head_dim=st.sampled_from([64, 128]),
    groups=st.tuples(st.sampled_from([32, 64]), st.sampled_from([32, 64])),
    page_size=st.sampled_from([16, 32, 64, 128, 256]),
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=4),
    ratio=st.sampled_from(GQA_RATIOS),
    sink=st.integers(0, 20),
    recent=st.integers(0, 40),
    block_n=st.integers(16, 160),
    num_splits=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_folded_equals_dequantized_property(
    bits, axes, head_dim, groups, page_size, lengths, ratio, sink, recent, block_n, num_splits, seed
):
    fmt = KVFormat(
        QuantFormat(bits[0], axes[0], groups[0]),
        QuantFormat(bits[1], axes[1], groups[1]),
        sink_tokens=sink,
        recent_tokens=recent,
    )
    cache, batch = build(fmt, head_dim, page_size, lengths, seed=seed, decode_steps=1)
    q = queries(batch, ratio, head_dim, seed=seed)
    o_a, lse_a = attend_dequantized(q, cache, batch)
    o_b, lse_b = attend_folded(q, cache, batch, block_n=block_n, num_splits=num_splits)
    assert rel(o_b, o_a) <= 1e-10
    assert float((lse_b - lse_a).abs().max()) <= 1e-10


def test_dequantized_reference_is_plain_attention():
    """Reference (a) on a BF16-only cache (everything in the windows) is textbook attention."""
    fmt = KVFormat(sink_tokens=8, recent_tokens=100)
    cache = QuantizedKVCache(fmt, num_kv_heads=2, head_dim=128, num_pages=2, max_seqs=1)
    sid = cache.add_sequence()
    k = torch.randn(50, 2, 128).bfloat16()
    v = torch.randn(50, 2, 128).bfloat16()
    cache.append([sid], k, v, [50])
    batch = cache.plan([sid])
    q = torch.randn(1, 6, 128, dtype=torch.float64)
    o, lse = attend_dequantized(q, cache, batch)
    kk = k.double().repeat_interleave(3, dim=1)  # [L, Hq, D]
    s = torch.einsum("hd,lhd->hl", q[0], kk) / math.sqrt(128)
    expected = torch.einsum("hl,lhd->hd", s.softmax(-1), v.double().repeat_interleave(3, dim=1))
    torch.testing.assert_close(o[0], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[0], s.logsumexp(-1), rtol=1e-12, atol=1e-12)


def test_merge_skips_empty_partials():
    o1, l1 = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    empty_o = torch.full_like(o1, math.nan)
    empty_l = torch.full_like(l1, -math.inf)
    o, lse = merge_partials([empty_o, o1, empty_o], [empty_l, l1, empty_l])
    torch.testing.assert_close(o, o1)
    torch.testing.assert_close(lse, l1)


# ---------------------------------------------------------------------------- bf16 operands
def test_bf16_operands_stay_at_bf16_level_with_zero_mean_values():
    """Note [offset cancellation]: with y = q + 128 operands, a correction computed from the
    rounded operand keeps the error at bf16 level; a naive one (from unrounded P) does not.

    Zero-mean V over a long context, where the ``-128 s`` part of ``z'`` nearly cancels the
    ``+128`` of every operand and a rounding error is multiplied by 128.
    """
    length = 4096
    fmt = KVFormat(QuantFormat(4, "channel", 64), QuantFormat(2, "token", 128))
    g = torch.Generator().manual_seed(5)
    cache = QuantizedKVCache(
        fmt, num_kv_heads=1, head_dim=128, num_pages=length // 64 + 1, max_seqs=1
    )
    sid = cache.add_sequence()
    k = torch.randn(length, 1, 128, generator=g)
    v = torch.randn(length, 1, 128, generator=g)
    cache.append([sid], k, v, [length])
    batch = cache.plan([sid])
    q = torch.randn(1, 4, 128, generator=g).bfloat16().double()
    o_ref, _ = attend_dequantized(q, cache, batch)
    o_bf16, _ = attend_folded(
        q, cache, batch, block_n=64, num_splits=4, operand_dtype=torch.bfloat16
    )
    # a bf16 torch attention over the same dequantized cache sets the bar
    kd, vd = (
        t.to(torch.bfloat16).double()
        for t in __import__("foscar.reference", fromlist=["x"]).dequantize_sequence(cache, batch, 0)
    )
    o_torch, _ = attention(q[0].reshape(1, 4, 128), kd, vd, 1 / math.sqrt(128))
    bar = rel(o_torch.reshape(1, 4, 128), o_ref)
    err = rel(o_bf16, o_ref)
    assert err <= max(2 * bar, 5e-3), (err, bar)
    assert err <= 5e-3

    # the naive correction: sum_n P_n z'_n from the unrounded P, beside bf16(P s') . y
    from foscar.reference import history_operands

    y, s, z = history_operands(cache, batch, 0, "v", 0, batch.num_quantized_host[0])
    yk, sk, zk = history_operands(cache, batch, 0, "k", 0, batch.num_quantized_host[0])
    logits = torch.einsum("hqd,hnd->hqn", q[0].reshape(1, 4, 128), kd) / math.sqrt(128)
    p = logits.softmax(-1)
    p_scaled = (p * s[..., 0].unsqueeze(1)).to(torch.bfloat16).double()
    naive = (
        torch.einsum("hqn,hnd->hqd", p_scaled, y)
        + torch.einsum("hqn,hn->hq", p, z[..., 0])[..., None]
    )
    exact = torch.einsum("hqn,hnd->hqd", p, vd)
    assert rel(naive, exact) > 10 * err  # the data is sensitive to the choice of correction


@pytest.mark.parametrize("score_bytes", [1, 5 * 4 * 4 * 300])
def test_attend_chunk_in_query_blocks_equals_one_block(score_bytes, monkeypatch):
    """A long chunk on a long history goes through in blocks of query rows (the scores of one
    block under ``CHUNK_SCORE_BYTES``): all rows at once to fp32 rounding, padding included."""
    from foscar.backends import extend as core

    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(4, "token", 32),
                   sink_tokens=4, recent_tokens=16)
    cache, batch = build(fmt, 32, 16, [263, 17])
    g = torch.Generator().manual_seed(3)
    t = 37
    q = torch.randn(NUM_KV_HEADS * 2, t, 32, generator=g)
    k_new, v_new = (torch.randn(NUM_KV_HEADS, t, 32, generator=g) for _ in range(2))
    real = torch.arange(t) < 31  # the chunk's last tokens are padding
    whole = core.attend_chunk(cache, batch, 0, q, k_new, v_new, 0.2, real)
    monkeypatch.setattr(core, "CHUNK_SCORE_BYTES", score_bytes)  # 1 row, then 4 rows
    blocks = core.attend_chunk(cache, batch, 0, q, k_new, v_new, 0.2, real)
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)  # fp32 products in other shapes
    assert whole.shape == (NUM_KV_HEADS * 2, t, 32) and torch.isfinite(whole).all()


@pytest.mark.parametrize("t", [1, 37])
def test_attend_chunk_bf16_fused_equals_fp32_blocks(t):
    """A bf16 chunk with every token real goes through one fused SDPA call (bottom-right causal
    over history + chunk): the fp32 row blocks' values to bf16 rounding, a chunk of one token
    (all history visible) and a prime one on a history that is not a multiple of the group."""
    from foscar import reference
    from foscar.backends import extend as core

    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(4, "token", 32),
                   sink_tokens=4, recent_tokens=16)
    cache, batch = build(fmt, 32, 16, [263, 17])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(NUM_KV_HEADS * 2, t, 32, generator=g)
    k_new, v_new = (torch.randn(NUM_KV_HEADS, t, 32, generator=g) for _ in range(2))
    q, k_new, v_new = (x.to(torch.bfloat16) for x in (q, k_new, v_new))
    fused = core.attend_chunk(cache, batch, 0, q, k_new, v_new, 0.2)
    exact = core.attend_chunk(cache, batch, 0, q.float(), k_new.float(), v_new.float(), 0.2)
    assert fused.dtype == torch.float32 and fused.shape == exact.shape
    torch.testing.assert_close(fused, exact, rtol=2e-2, atol=2e-2)
    # an oracle apart from attend_chunk: float64 softmax, query head h reads KV head h // 2,
    # chunk token i sees the whole history and chunk tokens 0..i
    k_past, v_past = reference.dequantize_sequence(cache, batch, 0, torch.float64)
    keys = torch.cat([k_past, k_new.double()], dim=1)[torch.arange(NUM_KV_HEADS * 2) // 2]
    vals = torch.cat([v_past, v_new.double()], dim=1)[torch.arange(NUM_KV_HEADS * 2) // 2]
    past = k_past.shape[1]
    seen = torch.arange(past + t)[None, :] <= past + torch.arange(t)[:, None]
    scores = (q.double() @ keys.transpose(1, 2) * 0.2).masked_fill(~seen, -math.inf)
    oracle = scores.softmax(-1) @ vals
    torch.testing.assert_close(fused.double(), oracle, rtol=2e-2, atol=2e-2)
    # the causal edge: the chunk's first token must not see the chunk's later ones
    first = core.attend_chunk(cache, batch, 0, q[:, :1], k_new[:, :1], v_new[:, :1], 0.2)
    torch.testing.assert_close(fused[:, :1], first, rtol=2e-2, atol=2e-2)
