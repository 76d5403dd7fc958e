"""Pure-torch references for decode attention over a :class:`~foscar.cache.QuantizedKVCache`.

(a) :func:`attend_dequantized` dequantizes every stored value (``x = s' * y + z'``) and runs
    plain softmax attention in fp64 (or fp32): the ground truth every kernel is tested against.
(b) :func:`attend_folded` never dequantizes a value: it computes the way a FOSCAR kernel does,
    over tiles of ``block_n`` tokens read through the page table, with group-local partial
    products, the four affine folds of design.md, an online softmax (running max ``m_i``, sum
    ``l_i``, accumulator ``acc``), split-KV partials, and the BF16 sink/tail merged as further
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
from torch.nn.attention.bias import causal_lower_right

from .cache import DecodeBatch, QuantizedKVCache, rotate_rows
from .formats import GroupAxis, QuantFormat, operand_values, unpack_codes
from .quantize import dequantize

__all__ = [
    "attend_chunk",
    "attend_dequantized",
    "attend_folded",
    "check_query",
    "dequantize_sequence",
    "attention",
    "merge_partials",
]


# ---------------------------------------------------------------------------- reading the cache
def _history_operands(
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    i: int,
    name: str,
    t0: int,
    t1: int,
    dtype: torch.dtype = torch.float64,
):
    """Operands ``y`` and folded ``(s', z')`` of history tokens ``[t0, t1)`` of sequence ``i``.

    Reads pages through ``batch.kv_indices`` exactly as a kernel does. Returns, in ``dtype``,
    ``y: [H, n, D]`` and the scales of the groups overlapping the range:
    token-wise ``[H, n, D/g]``; channel-wise ``[H, n_groups, D]`` for groups
    ``t0 // g .. (t1 - 1) // g``.
    """
    st = cache.layers[batch.layer]
    mapping = cache.layer_format(batch.layer).mapping
    f: QuantFormat = cache.role_format(batch.layer, name)
    ps, d, g = batch.page_size, cache.head_dim, f.group_size
    start = int(batch.kv_indptr[i])
    pages = batch.kv_indices[start : int(batch.kv_indptr[i + 1])].long()
    t = torch.arange(t0, t1, device=pages.device)
    words = getattr(st, f"{name}_words")[pages[t // ps], :, t % ps]  # [n, H, W]
    codes = unpack_codes(words, f.bits, mapping, cache.channel_order(name, batch.layer))
    y = operand_values(codes, f.bits, mapping, dtype).transpose(0, 1)  # [H, n, D]
    per_page = batch.page_size * d // g
    if f.axis is GroupAxis.TOKEN:
        e = torch.arange(t0 * d // g, t1 * d // g, device=pages.device)
        shape = (t1 - t0, d // g)
    else:
        g0, g1 = t0 // g, (t1 - 1) // g + 1
        e = torch.arange(g0 * d, g1 * d, device=pages.device)
        shape = (g1 - g0, d)
    sz = getattr(st, f"{name}_scales")[pages[e // per_page], :, e % per_page]  # [entries, H, 2]
    s = sz[..., 0].transpose(0, 1).reshape(-1, *shape).to(dtype)
    z = sz[..., 1].transpose(0, 1).reshape(-1, *shape).to(dtype)
    return y, s, z


def _window(cache: QuantizedKVCache, batch: DecodeBatch, i: int, name: str):
    """BF16 sink and tail values of sequence ``i``: two tensors ``[H, n, D]`` (stored dtype)."""
    st = cache.layers[batch.layer]
    slot = batch.slots_host[i]
    sink = getattr(st, f"{name}_sink")[slot, :, : batch.sink_len(i)]
    start, end = batch.tail_range(i)
    ring = (torch.arange(start, end) - batch.sink_tokens) % batch.tail_capacity
    tail = getattr(st, f"{name}_tail")[slot][:, ring.to(st.k_tail.device)]
    return sink, tail


def dequantize_sequence(
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    i: int,
    dtype: torch.dtype = torch.float64,
    *,
    stored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All tokens of sequence ``i`` of ``batch``, dequantized: ``k, v: [H, L, D]`` in ``dtype``.

    In the model's coordinates: a layer's OSCAR rotations are undone (``k R_K^T``, ``v R_V^T``,
    in float64) unless ``stored``, which returns what the pages hold.
    """
    cache.check_plan(batch)
    tr = cache.transforms[batch.layer]
    out = []
    lq = batch.num_quantized_host[i]
    for name in ("k", "v"):
        f = cache.role_format(batch.layer, name)
        sink, tail = _window(cache, batch, i, name)
        parts = [sink.to(dtype)]
        if lq:
            y, s, z = _history_operands(cache, batch, i, name, 0, lq)
            parts.append(dequantize(y, s, z, f, dtype=torch.float64).to(dtype))
        parts.append(tail.to(dtype))
        x = torch.cat(parts, dim=1)
        r = tr.key_rotation if name == "k" else tr.value_rotation
        if r is not None and not stored:
            x = rotate_rows(x.to(torch.float64).transpose(0, 1), r, inverse=True)
            x = x.transpose(0, 1).to(dtype)
        out.append(x)
    return out[0], out[1]


# ---------------------------------------------------------------------------- plain attention
#: bytes of fp32 attention scores ``[H_q, rows, L]`` that :func:`attend_chunk` computes at once:
#: a chunk's queries go through in blocks of rows under it, so a chunk of 8192 tokens on a
#: 32K history with 32 query heads (42 GB of scores, twice over in softmax) fits any device
CHUNK_SCORE_BYTES = 256 * 2**20


def attend_chunk(
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    i: int,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    sm_scale: float,
    new_mask: torch.Tensor | None = None,
    *,
    stored: bool = False,
) -> torch.Tensor:
    """Attention of a chunk of new tokens over sequence ``i``'s stored tokens (dequantized) and
    the chunk itself, causal over the chunk: how several new tokens on a non-empty sequence
    attend before they are appended (a chunked prefill's later chunks).

    ``q: [H_q, t, D]``, ``k_new, v_new: [H_kv, t, D]``; ``new_mask: bool [t]`` marks the chunk's
    real tokens (``None``: all of them). Returns ``[H_q, t, D]`` float32. ``stored``: the
    history is read as stored (a layer's OSCAR rotations not undone): ``q``, ``k_new`` and
    ``v_new`` are in the rotated coordinates and so is the output.

    A query in bf16 or fp16 with every token real attends in its own dtype through one fused
    SDPA call (bottom-right causal: a chunk's token sees the whole history and the chunk
    up to itself), as the model's own prefill does; otherwise in fp32, in blocks of query rows
    whose scores stay under :data:`CHUNK_SCORE_BYTES`.
    """
    fused = new_mask is None and q.dtype in (torch.bfloat16, torch.float16)
    dtype = q.dtype if fused else torch.float32
    k_past, v_past = dequantize_sequence(cache, batch, i, dtype=torch.float32, stored=stored)
    num_q_heads, t, _ = q.shape
    group = num_q_heads // k_new.shape[0]
    keys = torch.cat([k_past.to(dtype), k_new.to(dtype)], dim=1).repeat_interleave(group, dim=0)
    vals = torch.cat([v_past.to(dtype), v_new.to(dtype)], dim=1).repeat_interleave(group, dim=0)
    q = q.to(dtype)
    if fused:
        bias = causal_lower_right(t, keys.shape[1])
        o = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), attn_mask=bias, scale=sm_scale
        )
        return o[0].float()
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if new_mask is not None:
        causal = causal & new_mask.unsqueeze(0)
    mask = torch.cat(
        [torch.ones(t, k_past.shape[1], dtype=torch.bool, device=q.device), causal], dim=1
    )
    rows = max(1, CHUNK_SCORE_BYTES // (num_q_heads * keys.shape[1] * 4))
    if rows >= t:
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, scale=sm_scale
        )
    out = torch.empty_like(q)
    for r in range(0, t, rows):  # each query row's softmax is its own: blocks change no value
        out[:, r : r + rows] = torch.nn.functional.scaled_dot_product_attention(
            q[:, r : r + rows], keys, vals, attn_mask=mask[r : r + rows], scale=sm_scale
        )
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float):
    """Softmax attention of grouped queries ``q: [H, hq, D]`` over ``k, v: [H, L, D]``.

    Returns ``o: [H, hq, D]`` and ``lse: [H, hq]`` in the dtype of the inputs.
    """
    s = torch.einsum("hqd,hld->hql", q, k) * sm_scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("hql,hld->hqd", p, v), lse


def check_query(q: torch.Tensor, cache: QuantizedKVCache, batch: DecodeBatch) -> int:
    """Raise unless ``q`` is ``[batch.batch_size, num_q_heads, head_dim]`` with ``num_q_heads``
    a multiple of the cache's KV heads; returns the query heads per KV head."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3 or q.shape[0] != batch.batch_size or q.shape[2] != cache.head_dim:
        raise ValueError(
            f"q must have shape [batch={batch.batch_size}, num_q_heads, head_dim="
            f"{cache.head_dim}], got {list(q.shape)}"
        )
    if q.shape[1] % cache.num_kv_heads:
        raise ValueError(
            f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({cache.num_kv_heads})"
        )
    return q.shape[1] // cache.num_kv_heads


def attend_dequantized(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (a): dequantize the whole cache, then attend in ``dtype``.

    Returns ``o: [batch, num_q_heads, head_dim]`` and ``lse: [batch, num_q_heads]`` in ``dtype``.
    """
    hq = check_query(q, cache, batch)
    cache.check_plan(batch)
    sm_scale = 1.0 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    h, d = cache.num_kv_heads, cache.head_dim
    outs, lses = [], []
    for i in range(batch.batch_size):
        k, v = dequantize_sequence(cache, batch, i, dtype)
        o, lse = attention(q[i].to(dtype).reshape(h, hq, d), k, v, sm_scale)
        outs.append(o.reshape(h * hq, d))
        lses.append(lse.reshape(h * hq))
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------------------- folded reference
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
    """Reference (b): affine-folded, tiled, split-KV decode attention.

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
    hq = check_query(q, cache, batch)
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
                yk, sk, zk = _history_operands(cache, batch, i, "k", t0, t1, dtype)
                yv, sv, zv = _history_operands(cache, batch, i, "v", t0, t1, dtype)
                s = _qk_tile(qi, yk, sk, zk, fk, t0, t1, operand_dtype)
                p = state.update(s * sm_scale)
                state.acc += _pv_tile(p, yv, sv, zv, fv, t0, t1, operand_dtype)
            o, lse = state.finish()
            parts_o.append(o)
            parts_lse.append(lse)
        (k_sink, k_tail), (v_sink, v_tail) = (
            _window(cache, batch, i, "k"),
            _window(cache, batch, i, "v"),
        )
        for kw, vw in ((k_sink, v_sink), (k_tail, v_tail)):
            o, lse = _attend_window(qi, kw, vw, sm_scale, operand_dtype, dtype)
            parts_o.append(o)
            parts_lse.append(lse)
        o, lse = merge_partials(parts_o, parts_lse)
        outs.append(o.reshape(h * hq, d))
        lses.append(lse.reshape(h * hq))
    return torch.stack(outs), torch.stack(lses)
