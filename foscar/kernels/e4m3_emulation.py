"""The Gluon kernel's E4M3 operand path (GluonFlag.E4M3) in torch: where it rounds to E4M3 and
how it scales, for one sequence and one KV head. It documents the arithmetic of
foscar.kernels.gluon (kernel._stage_q, kernel._consume, tiles._tile and tiles._tile_pair_packed)
and lets CPU tests check it against fp64 attention; it is no kernel (no GPU here, no speed).

Math, log2 domain (c = sm_scale log2 e), token-wise K and V of one group per token (g = D),
x = s' (q + 128) + z' with codes q in [0, 2^bits), C = (2^bits - 1) / 2 the middle code:
    Q^ = hi + lo,  hi = e4m3(Q 2^sigma),  lo = e4m3(Q 2^sigma - hi)
                   per head: max |Q| 2^sigma in [128, 256); Q~ = Q^ 2^-sigma
    S  = c Q~ . x = c (s'_K Q~ . q_K + (z'_K + 128 s'_K) sum(Q~))   (two products, one acc)
    M  = the running max of S + log2 s'_V;  P = exp2(S - M);  P'^ = e4m3(256 P s'_V)
    O  = (sum P'^ (q_V - C) / 256 + sum P (z'_V + s'_V (128 + C))) / sum P
The codes meet E4M3 only as q 2^-9 (exact). Q's high term alone leaves each value's rounding
error (up to 2^-4 of it), which the logits carry times their spread: 0.35 relative L2 against
fp64 for keys 100x the Gaussian's (tests/test_e4m3_accuracy.py); the low term takes it down
to 2^-8 (or 2^-17 of the head's largest |Q|, E4M3's smallest subnormal at the head's scale).
P' meets E4M3 once, 256 P' <= 256 (the max of S + log2 s'_V), and its rounding meets the
centred codes q - C only: the rows' middles go through fp32 with the unrounded P.

``q_two_terms=False`` gives the earlier arithmetic (Q^ = hi).

Data contract: q [H, D]; k_codes, v_codes [n, D] integer codes in natural channel order;
k_scale, k_zero, v_scale, v_zero [n] the folded (s', z') of each token; returns o [H, D] and the
natural-log LSE [H], float64.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
LOG2E = 1.4426950408889634


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3 (nearest even, saturating at +-448 as the kernel's F2FP.SATFINITE),
    returned as float64."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64)


def _pow2_floor_exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) of positive fp32 values, from the exponent bits (the kernel's bit trick)."""
    return ((x.to(torch.float32).view(torch.int32) >> 23) & 0xFF).to(torch.int64) - 127


def stage_q(
    q: torch.Tensor, scaled_columns: torch.Tensor | None = None, two_terms: bool = True
) -> torch.Tensor:
    """kernel._stage_q's E4M3 branch: Q~ [H, D], the E4M3 terms (hi + lo, or hi alone) scaled
    back. ``scaled_columns`` [D] bool: channels whose copy is scaled by 4^-1 before rounding
    (the INT2 scaled extraction), exact except in E4M3's subnormal range."""
    qf = q.to(torch.float32).to(torch.float64)
    if scaled_columns is not None:
        qf = qf * torch.where(scaled_columns, 0.25, 1.0)
    amax = qf.abs().amax(dim=-1, keepdim=True)
    ebits = (261 - (_pow2_floor_exponent(amax) + 127)).clamp(1, 254)
    scale = torch.exp2((ebits - 127).to(torch.float64))
    q8 = qf * scale
    hi = e4m3(q8)
    q_tilde = (hi + e4m3(q8 - hi) if two_terms else hi) / scale
    if scaled_columns is not None:
        q_tilde = q_tilde * torch.where(scaled_columns, 4.0, 1.0)
    return q_tilde


def _tile(state, q_tilde, k, v, cfg):
    """One tile of one consumer: tiles._tile (64 tokens) or tiles._tile_pair_packed (128)."""
    m_i, l_i, num = state
    v_bits, c = cfg
    kq, ks, kz = k
    vq, vs, vz = v
    c_v = ((1 << v_bits) - 1) / 2
    x = ks[:, None] * (kq + 128.0) + kz[:, None]
    s = (c * (x @ q_tilde.T)).to(torch.float32).to(torch.float64)  # [n, H], fp32 logits
    lg = torch.log2(vs).clamp_min(-64.0)
    m_new = torch.maximum(m_i, (s + lg[:, None]).amax(dim=0))  # [H]
    alpha = torch.exp2(m_i - m_new)
    p = torch.exp2(s - m_new[None, :])
    l_i = l_i * alpha + p.sum(dim=0)
    pv = e4m3((p * (vs * 256.0)[:, None]).to(torch.float32).to(torch.float64))
    mid_v = vz + vs * (128.0 + c_v)
    o_t = (vq - c_v).T @ pv / 256.0 + mid_v[None, :] @ p  # [D, H]: centred codes + middles
    num = num * alpha[None, :] + o_t
    return m_new, l_i, num


def emulate_head(
    q: torch.Tensor,
    k: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    v: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    v_bits: int,
    sm_scale: float,
    tile_tokens: int = 64,
    num_splits: int = 1,
    scaled_columns: torch.Tensor | None = None,
    q_two_terms: bool = True,
):
    """The E4M3 path over one KV head's quantized history: k = (codes [n, D], s' [n], z' [n]),
    v likewise (``v_bits`` its code width); q [H, D]. Tiles of ``tile_tokens`` (64: one page;
    128: packed heads, one max over both pages) split as the kernel splits them (``num_splits``
    parts, each shared by two consumers, tiles t_begin + C + 2i), the parts merged by their
    LSEs. Returns (o [H, D], lse [H] natural log), float64."""
    n, d = k[0].shape
    h = q.shape[0]
    if tile_tokens not in (64, 128):
        raise ValueError(f"tile_tokens must be 64 or 128, got {tile_tokens}")
    if v_bits not in (2, 4):
        raise ValueError(f"v_bits must be 2 or 4, got {v_bits}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if n == 0:
        raise ValueError("the history must hold a token, got n = 0")
    q_tilde = stage_q(q, scaled_columns, q_two_terms)
    k = tuple(t.to(torch.float64) for t in k)
    v = tuple(t.to(torch.float64) for t in v)
    cfg = (v_bits, sm_scale * LOG2E)
    n_tiles = math.ceil(n / tile_tokens)
    per_split = math.ceil(n_tiles / num_splits)
    parts_o, parts_lse = [], []
    for split in range(num_splits):
        t_begin = min(split * per_split, n_tiles)
        t_end = min(t_begin + per_split, n_tiles)
        for consumer in (0, 1):
            state = (
                torch.full((h,), -math.inf, dtype=torch.float64),
                torch.zeros(h, dtype=torch.float64),
                torch.zeros(d, h, dtype=torch.float64),
            )
            for t in range(t_begin + consumer, t_end, 2):
                rows = slice(t * tile_tokens, min((t + 1) * tile_tokens, n))
                state = _tile(state, q_tilde, [x[rows] for x in k], [x[rows] for x in v], cfg)
            m_i, l_i, num = state
            if t_begin + consumer < t_end:
                parts_o.append((num / l_i[None, :]).T)
                parts_lse.append(m_i + torch.log2(l_i))
    lse2 = torch.stack(parts_lse)  # [parts, H], log2
    top = lse2.amax(dim=0)
    w = torch.exp2(lse2 - top[None, :])
    o = (torch.stack(parts_o) * w[:, :, None]).sum(dim=0) / w.sum(dim=0)[:, None]
    lse = (top + torch.log2(w.sum(dim=0))) / LOG2E
    return o, lse
