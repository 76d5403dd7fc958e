"""Reading a cache's stored tokens in torch, as the decode kernels read them: a sequence's
history operands through its page table, its BF16 windows, and the whole sequence dequantized.

The torch paths that attend over stored tokens (the dequantized decode of
foscar.integrations.transformers, the chunk attention of foscar.attention) and the references
(foscar.reference) read the cache through these.
"""

from __future__ import annotations

import torch

from ..formats import GroupAxis, QuantFormat, operand_values, unpack_codes
from ..quantize import dequantize
from .kv_cache import QuantizedKVCache
from .pages import DecodeBatch
from .transforms import rotate_rows

__all__ = ["dequantize_sequence", "history_operands", "window_values"]


def history_operands(
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


def window_values(cache: QuantizedKVCache, batch: DecodeBatch, i: int, name: str):
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
        sink, tail = window_values(cache, batch, i, name)
        parts = [sink.to(dtype)]
        if lq:
            y, s, z = history_operands(cache, batch, i, name, 0, lq)
            parts.append(dequantize(y, s, z, f, dtype=torch.float64).to(dtype))
        parts.append(tail.to(dtype))
        x = torch.cat(parts, dim=1)
        r = tr.key_rotation if name == "k" else tr.value_rotation
        if r is not None and not stored:
            x = rotate_rows(x.to(torch.float64).transpose(0, 1), r, inverse=True)
            x = x.transpose(0, 1).to(dtype)
        out.append(x)
    return out[0], out[1]
