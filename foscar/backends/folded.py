"""The folded decode computation in torch: the ``"reference"`` backend (CPUs, and any device
without a kernel), and the model of the kernels' arithmetic that tests compare them against
(re-exported by foscar.reference as its reference (b)).

:func:`attend_folded` never dequantizes a value: it computes the way a FOSCAR kernel does, over
tiles of ``block_n`` tokens read through the page table (foscar.cache.read), with group-local
partial products, the four affine folds of design.md, an online softmax (running max ``m_i``,
sum ``l_i``, accumulator ``acc``), split-KV partials, and the BF16 sink/tail merged as further
partials with the same log-sum-exp merge. With ``operand_dtype=torch.bfloat16`` it rounds
exactly the operands a kernel rounds and computes every offset correction from the rounded
operand (Note [offset cancellation]).

Shapes: ``q: [batch, num_q_heads, head_dim]``; query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)``. Outputs ``o: [batch, num_q_heads, head_dim]`` and
``lse: [batch, num_q_heads]`` (natural log of the softmax denominator of the scaled logits).
"""

from __future__ import annotations

import math

import torch

from ..cache import DecodeBatch, QuantizedKVCache
from ..cache.read import history_operands, window_values
from ..formats import GroupAxis, QuantFormat

__all__ = ["FoldedDecodePlan", "attend_folded", "merge_partials", "split_tiles"]


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]):
    """Log-sum-exp merge of normalised partial outputs (split-KV and BF16 segments).

    ``outs[j]: [..., D]``, ``lses[j]: [...]``; partials with ``lse = -inf`` (empty) are skipped:
    ``m = max lse_j; w_j = exp(lse_j - m); o = sum w_j o_j / sum w_j``.
    """
    lse = torch.stack(lses)
    m = lse.amax(dim=0)
    w = torch.exp(lse - m)  # exp(-inf - m) = 0 drops empty partials
    denom = w.sum(dim=0)
    o = sum(w_j.unsqueeze(-1) * torch.nan_to_num(o_j) for w_j, o_j in zip(w, outs))
    return o / denom.unsqueeze(-1), m + torch.log(denom)


class _OnlineSoftmax:
    """State of one split: running max ``m_i``, denominator ``l_i`` and accumulator ``acc``."""

    def __init__(self, h: int, hq: int, d: int, dtype: torch.dtype, device) -> None:
        self.m_i = torch.full((h, hq), -math.inf, dtype=dtype, device=device)
        self.l_i = torch.zeros(h, hq, dtype=dtype, device=device)
        self.acc = torch.zeros(h, hq, d, dtype=dtype, device=device)

    def update(self, s: torch.Tensor) -> torch.Tensor:
        """Take logits ``s: [H, hq, n]`` of a tile; rescale the state; return ``P = exp(s - m)``."""
        m_new = torch.maximum(self.m_i, s.amax(dim=-1))
        alpha = torch.exp(self.m_i - m_new)  # exp(-inf) = 0 on the first tile
        p = torch.exp(s - m_new.unsqueeze(-1))
        self.l_i = self.l_i * alpha + p.sum(dim=-1)
        self.acc = self.acc * alpha.unsqueeze(-1)
        self.m_i = m_new
        return p

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised partial output and its LSE (``-inf`` and zeros if no token was seen)."""
        empty = self.l_i == 0
        o = self.acc / torch.where(empty, 1.0, self.l_i).unsqueeze(-1)
        lse = torch.where(empty, -math.inf, self.m_i + torch.log(self.l_i))
        return o, lse


def _round(x: torch.Tensor, operand_dtype: torch.dtype | None) -> torch.Tensor:
    """Round to the matrix-unit operand precision (no-op in exact mode)."""
    return x if operand_dtype is None else x.to(operand_dtype).to(x.dtype)


def _groups_in(t0: int, t1: int, g: int):
    """Sub-ranges of ``[t0, t1)`` that stay inside one token group of size ``g``."""
    a = t0
    while a < t1:
        b = min(t1, (a // g + 1) * g)
        yield a, b
        a = b


def _qk_tile(q, y, s, z, f: QuantFormat, t0: int, t1: int, operand_dtype):
    """Logits of a tile before sm_scale: ``q: [H, hq, D]``, ``y: [H, n, D]`` -> ``[H, hq, n]``."""
    h, hq, d = q.shape
    g = f.group_size
    if f.axis is GroupAxis.TOKEN:
        # acc-fold: S[:, n] = sum_G s'[n,G] * (Q_G . y[n,G]) + z'[n,G] * sum(Q_G)
        qg = q.reshape(h, hq, d // g, g)
        partial = torch.einsum("hqGc,hnGc->hqnG", qg, y.reshape(h, -1, d // g, g))
        return (partial * s.unsqueeze(1)).sum(-1) + torch.einsum("hqG,hnG->hqn", qg.sum(-1), z)
    # channel-wise K, operand-fold into Q per token group J:
    #   S[:, J] = (Q * s'_J) . y_J^T + sum_d (Q * s'_J)_d * (z'_J,d / s'_J,d)
    # with the correction computed from the operand the matrix unit consumes.
    out = []
    for a, b in _groups_in(t0, t1, g):
        j = a // g - t0 // g
        q_scaled = _round(q * s[:, j].unsqueeze(1), operand_dtype)  # [H, hq, D]
        corr = torch.einsum("hqd,hd->hq", q_scaled, z[:, j] / s[:, j])
        out.append(
            torch.einsum("hqd,hnd->hqn", q_scaled, y[:, a - t0 : b - t0]) + corr.unsqueeze(-1)
        )
    return torch.cat(out, dim=-1)


def _pv_tile(p, y, s, z, f: QuantFormat, t0: int, t1: int, operand_dtype):
    """Output contribution of one tile: ``p: [H, hq, n]``, ``y: [H, n, D]`` -> ``[H, hq, D]``."""
    h, hq, n = p.shape
    d = y.shape[-1]
    g = f.group_size
    if f.axis is GroupAxis.TOKEN:
        # operand-fold into P per channel group G:
        #   O[:, G] = (P * s'[:, G]) . y[:, G] + sum_n (P * s'[:, G])_n * (z'[n,G] / s'[n,G])
        p_scaled = _round(p.unsqueeze(-1) * s.unsqueeze(1), operand_dtype)  # [H, hq, n, D/g]
        o = torch.einsum("hqnG,hnGc->hqGc", p_scaled, y.reshape(h, n, d // g, g))
        corr = torch.einsum("hqnG,hnG->hqG", p_scaled, z / s)
        return (o + corr.unsqueeze(-1)).reshape(h, hq, d)
    # channel-wise V, acc-fold per token group J (group-local partial product):
    #   O += s'_J * (P_J . y_J) + rowsum(P_J) * z'_J, with P rounded as the matrix unit sees it
    p_op = _round(p, operand_dtype)
    o = torch.zeros(h, hq, d, dtype=p.dtype, device=p.device)
    for a, b in _groups_in(t0, t1, g):
        j = a // g - t0 // g
        pj = p_op[..., a - t0 : b - t0]
        partial = torch.einsum("hqn,hnd->hqd", pj, y[:, a - t0 : b - t0])
        o += partial * s[:, j].unsqueeze(1) + pj.sum(-1, keepdim=True) * z[:, j].unsqueeze(1)
    return o


def _attend_window(q, k, v, sm_scale, operand_dtype, dtype):
    """A BF16 segment as one partial (``-inf`` LSE when empty)."""
    h, hq, d = q.shape
    if k.shape[1] == 0:
        return torch.zeros(h, hq, d, dtype=dtype, device=q.device), torch.full(
            (h, hq), -math.inf, dtype=dtype, device=q.device
        )
    state = _OnlineSoftmax(h, hq, d, dtype, q.device)
    p = state.update(torch.einsum("hqd,hnd->hqn", q, k.to(dtype)) * sm_scale)
    state.acc += torch.einsum("hqn,hnd->hqd", _round(p, operand_dtype), v.to(dtype))
    return state.finish()


def split_tiles(num_tokens: int, block_n: int, num_splits: int) -> list[tuple[int, int]]:
    """Token ranges of ``num_splits`` runs of whole tiles (the last ones may be empty)."""
    tiles = math.ceil(num_tokens / block_n)
    per_split = math.ceil(tiles / num_splits) if tiles else 0
    return [
        (min(num_tokens, j * per_split * block_n), min(num_tokens, (j + 1) * per_split * block_n))
        for j in range(num_splits)
    ]


def attend_folded(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    sm_scale: float | None = None,
    *,
    block_n: int = 64,
    num_splits: int = 1,
    dtype: torch.dtype = torch.float64,
    operand_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine-folded, tiled, split-KV decode attention in torch.

    Parameters
    ----------
    q : [batch, num_q_heads, head_dim]
    block_n : tokens per tile (a tile may cross pages and channel-wise groups).
    num_splits : the quantized history is cut into this many runs of whole tiles, each with its
        own online softmax; the sink and the tail are two more partials.
    dtype : accumulation dtype (float64 for exactness tests, float32 as a kernel).
    operand_dtype : ``None`` for exact operands, or ``torch.bfloat16`` to round ``Q*s'``,
        ``P*s'`` and ``P`` as a bf16 matrix unit does.

    Returns ``o: [batch, num_q_heads, head_dim]`` and ``lse: [batch, num_q_heads]`` in ``dtype``.
    Like a kernel, it works in the stored coordinates: with OSCAR rotations, ``q`` must be
    rotated already and ``o`` comes out rotated (:func:`foscar.decode_attention` does both).
    """
    hq = cache.check_query(q, batch)
    cache.check_plan(batch)
    if block_n <= 0 or num_splits <= 0:
        raise ValueError(f"block_n and num_splits must be positive, got {block_n}, {num_splits}")
    sm_scale = 1.0 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    h, d = cache.num_kv_heads, cache.head_dim
    fmt = cache.layer_format(batch.layer)
    fk, fv = fmt.key, fmt.value
    outs, lses = [], []
    for i in range(batch.batch_size):
        qi = q[i].to(dtype).reshape(h, hq, d)
        parts_o, parts_lse = [], []
        for a, b in split_tiles(batch.num_quantized_host[i], block_n, num_splits):
            state = _OnlineSoftmax(h, hq, d, dtype, q.device)
            for t0 in range(a, b, block_n):
                t1 = min(b, t0 + block_n)
                yk, sk, zk = history_operands(cache, batch, i, "k", t0, t1, dtype)
                yv, sv, zv = history_operands(cache, batch, i, "v", t0, t1, dtype)
                s = _qk_tile(qi, yk, sk, zk, fk, t0, t1, operand_dtype)
                p = state.update(s * sm_scale)
                state.acc += _pv_tile(p, yv, sv, zv, fv, t0, t1, operand_dtype)
            o, lse = state.finish()
            parts_o.append(o)
            parts_lse.append(lse)
        (k_sink, k_tail), (v_sink, v_tail) = (
            window_values(cache, batch, i, "k"),
            window_values(cache, batch, i, "v"),
        )
        for kw, vw in ((k_sink, v_sink), (k_tail, v_tail)):
            o, lse = _attend_window(qi, kw, vw, sm_scale, operand_dtype, dtype)
            parts_o.append(o)
            parts_lse.append(lse)
        o, lse = merge_partials(parts_o, parts_lse)
        outs.append(o.reshape(h * hq, d))
        lses.append(lse.reshape(h * hq))
    return torch.stack(outs), torch.stack(lses)


class FoldedDecodePlan:
    """:func:`attend_folded` over one DecodeBatch (its layer) in fp32 (fp64 for fp64 queries),
    tiles of ``block_n`` tokens: the ``"reference"`` backend's plan. It keeps nothing between
    calls (the torch computation allocates its own)."""

    def __init__(
        self,
        cache: QuantizedKVCache,
        batch: DecodeBatch,
        num_q_heads: int,
        sm_scale: float,
        *,
        block_n: int,
    ) -> None:
        self.cache = cache
        self.batch = batch
        self.num_q_heads = num_q_heads
        self.sm_scale = sm_scale
        self.block_n = block_n

    def run(
        self,
        q: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """``q: [B, Hq, D]`` -> ``o`` in q's dtype (``out`` when given), and ``lse: [B, Hq]``
        float32 with ``return_lse``."""
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        o, lse_folded = attend_folded(
            q, self.cache, self.batch, self.sm_scale, block_n=self.block_n, dtype=dtype
        )
        o = o.to(q.dtype)
        if out is not None:
            out.copy_(o)
            o = out
        if not return_lse:
            return o
        if lse is not None:
            lse.copy_(lse_folded)
            return o, lse
        return o, lse_folded.to(torch.float32)
