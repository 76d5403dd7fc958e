"""Shared helpers for kernel tests: caches with zero-mean data, the bf16 error bar, poisoning."""

from __future__ import annotations

import math

import torch

from foscar import KVFormat, QuantizedKVCache
from foscar.reference import attend_dequantized, dequantize_sequence


def build_cache(
    fmt: KVFormat,
    lengths,
    *,
    num_kv_heads=2,
    head_dim=128,
    page_size=64,
    device="cpu",
    seed=0,
    decode_steps=2,
    shuffle_pages=True,
    v_offset=0.0,
):
    """A cache of ragged sequences (prefill + a few decode steps) with zero-mean K and V.

    Zero-mean data matter: with y = q + 128 operands the offsets nearly cancel the +128, which
    is where a correction computed from the wrong operand shows (Note [offset cancellation]).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_needed = sum(math.ceil((n + decode_steps) / page_size) for n in lengths)
    num_pages = pages_needed + 5
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        max_seqs=len(lengths),
        page_size=page_size,
        device=device,
    )
    if shuffle_pages:  # pages out of order, so page-table indexing is exercised
        perm = torch.randperm(num_pages, generator=g).tolist()
        cache.set_free_order(perm)
    ids = [cache.add_sequence() for _ in lengths]
    total = sum(lengths)
    spread = torch.linspace(0.3, 2.0, head_dim)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g) * spread
    v = torch.randn(total, num_kv_heads, head_dim, generator=g) * spread.flip(0) + v_offset
    cache.append(ids, k.to(device), v.to(device), list(lengths))
    for _ in range(decode_steps):
        k = torch.randn(len(ids), num_kv_heads, head_dim, generator=g)
        v = torch.randn(len(ids), num_kv_heads, head_dim, generator=g)
        cache.append(ids, k.to(device), v.to(device))
    return cache, cache.plan(ids)


def queries(batch, num_q_heads, head_dim, device, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(batch.batch_size, num_q_heads, head_dim, generator=g).to(
        device, torch.bfloat16
    )


def bf16_torch_attention(q, cache, batch, sm_scale):
    """What a plain bf16 attention over the same dequantized cache computes (the error bar)."""
    outs = []
    h = cache.num_kv_heads
    for i in range(batch.batch_size):
        k, v = dequantize_sequence(cache, batch, i, torch.float32)
        ratio = q.shape[1] // h
        qq = q[i].float().reshape(h, ratio, -1)
        s = torch.einsum("hqd,hld->hql", qq, k.bfloat16().float()) * sm_scale
        p = torch.softmax(s, dim=-1).bfloat16().float()
        o = torch.einsum("hql,hld->hqd", p, v.bfloat16().float())
        outs.append(o.reshape(h * ratio, -1).bfloat16())
    return torch.stack(outs)


def _e4m3_round_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to E4M3 after a power-of-two scale per slice along ``dim`` that puts the
    slice's largest magnitude in [128, 256) (the Gluon kernel's Q and, up to the power of two,
    its P'), returned in x's scale and dtype."""
    amax = x.abs().amax(dim=dim, keepdim=True)
    scale = torch.exp2(7 - torch.floor(torch.log2(amax.clamp_min(1e-30))))
    return (x * scale).to(torch.float8_e4m3fn).to(x.dtype) / scale


def e4m3_torch_attention(q, cache, batch, sm_scale):
    """The error bar of the Gluon E4M3 operand path (GluonFlag.E4M3), as it rounds: attention
    over the same dequantized cache in fp64 with Q rounded to E4M3 per head, and the
    probabilities rounded (per head, relative to their largest) where they meet the centred
    codes only: ``sum_t P^_t (x_t - m_t) + P_t m_t`` with m_t the middle of the row's range
    (z + s c, c the middle code: token-wise min-max groups of head_dim, the only V the path
    reads). Returns (o, lse) like attend_dequantized."""
    outs, lses = [], []
    h = cache.num_kv_heads
    for i in range(batch.batch_size):
        k, v = dequantize_sequence(cache, batch, i, torch.float64)
        ratio = q.shape[1] // h
        qq = _e4m3_round_rows(q[i].double().reshape(h, ratio, -1), -1)
        s = torch.einsum("hqd,hld->hql", qq, k) * sm_scale
        lses.append(torch.logsumexp(s, dim=-1).reshape(h * ratio))
        p = torch.softmax(s, dim=-1)
        mid = (v.amin(-1, keepdim=True) + v.amax(-1, keepdim=True)) / 2  # [h, l, 1]
        o = torch.einsum("hql,hld->hqd", _e4m3_round_rows(p, -1), v - mid)
        o = o + torch.einsum("hql,hld->hqd", p, mid)
        outs.append(o.reshape(h * ratio, -1))
    return torch.stack(outs), torch.stack(lses)


def check_e4m3_against_reference(o, lse, q, cache, batch, *, sm_scale=None):
    """The E4M3 operand path's error against fp64 over the dequantized cache is at E4M3 level:
    within 2x that of an fp64 attention with Q and P rounded to E4M3 (e4m3_torch_attention);
    bf16's 5e-3 bar does not apply (3 mantissa bits; docs/tuning.md)."""
    sm_scale = 1 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    assert torch.isfinite(o).all(), "unwritten or non-finite output"
    ref, ref_lse = attend_dequantized(q.double(), cache, batch, sm_scale)
    o_e4m3, lse_e4m3 = e4m3_torch_attention(q, cache, batch, sm_scale)
    bar = rel_l2(o_e4m3, ref)
    err = rel_l2(o, ref)
    assert err <= max(2 * bar, 5e-3), f"error {err:.2e} > 2 x E4M3 torch attention {bar:.2e}"
    if lse is not None:
        assert torch.isfinite(lse).all()
        # the logits carry Q's E4M3 rounding (P's does not reach the LSE): within 2e-2 of the
        # deviation of the emulation's LSE, which rounds Q for every token (the kernel's BF16
        # windows take the bf16 Q: the H200 measured such a case past 2e-2 of the emulation)
        dev = float((lse.double() - ref_lse).abs().max())
        assert dev <= float((lse_e4m3 - ref_lse).abs().max()) + 2e-2, f"LSE off by {dev:.2e}"
    return err, bar


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def check_against_reference(o, lse, q, cache, batch, *, sm_scale=None):
    """The kernel's error against fp64 over the dequantized cache is at bf16 level."""
    sm_scale = 1 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    assert torch.isfinite(o).all(), "unwritten or non-finite output"
    ref, ref_lse = attend_dequantized(q.double(), cache, batch, sm_scale)
    bar = rel_l2(bf16_torch_attention(q, cache, batch, sm_scale), ref)
    err = rel_l2(o, ref)
    assert err <= max(2 * bar, 1e-3), f"error {err:.2e} > 2 x bf16 torch attention {bar:.2e}"
    assert err <= 5e-3, f"error {err:.2e} > 5e-3"
    if lse is not None:
        assert torch.isfinite(lse).all()
        # the logits carry bf16-level error (Q*s' rounds for channel-wise K)
        assert float((lse.double() - ref_lse).abs().max()) <= 2e-2
    return err, bar
