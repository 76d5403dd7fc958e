"""Launcher of the fused decode-step write (foscar.kernels.cache_write): one Triton launch per
role quantizes, packs and scatters one new token per sequence, bit for bit what the torch
writer (foscar.cache.write) stores (``tests/test_cache_write.py``).

Covers token-wise history formats (clipped per token, and keys rounded by GPTQ, as a layer's
transform says), head_dim a power of two >= 16, windows stored as 16- or 32-bit floats, on a
CUDA device or the Triton interpreter (:func:`fused_write_reason`).
"""

from __future__ import annotations

import torch

from .. import triton_runtime
from ..formats import GroupAxis

try:
    from ..kernels import cache_write
except Exception:  # no Triton, or an install without a backend: fused_write_reason says so
    cache_write = None

__all__ = ["fused_write_reason", "write_decode_tokens"]


def fused_write_reason(cache, layer: int = 0) -> str | None:
    """``None`` if a decode step of ``layer`` can take the fused write, else why not; ``cache``
    is a :class:`QuantizedKVCache` or a :class:`~foscar.cache.layout.CacheLayout`."""
    for name in ("k", "v"):
        f = cache.stored_format(layer, name)
        if f.axis is not GroupAxis.TOKEN:
            return f"{name} history groups run along tokens (channel-wise)"
    d = cache.head_dim
    if d & (d - 1) or d < 16:
        return f"head_dim must be a power of two >= 16, got {d}"
    if cache.window_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"window dtype {cache.window_dtype} (the kernel loads 16- or 32-bit floats)"
    if not triton_runtime.available(cache.device, cache_write):
        return f"Triton cannot run on {cache.device}"
    return None


def write_decode_tokens(cache, layer: int, name: str, src, desc) -> None:
    """One decode step's write of role ``name`` ("k" or "v") into ``layer``, one launch.

    src: ``[batch, H, D]`` the new tokens in the cache's window dtype (last axis contiguous);
    desc: ``[batch, 6]`` int32 on the cache's device (foscar.kernels.cache_write.DESC_FIELDS).
    The caller (:meth:`QuantizedKVCache.append`) has checked everything and chosen this path
    only where :func:`fused_write_reason` is None; the layer's clip ratio and (for K) GPTQ
    factors come from its transform.
    """
    st = cache.layers[layer]
    f = cache.stored_format(layer, name)
    d = cache.head_dim
    clip_index = -1 if f.clip is None else min(int(f.clip * d), d - 1)  # as clip_per_token
    gptq = cache.transforms[layer].key_gptq if name == "k" else None
    alpha, beta = cache.layer_format(layer).mapping.alpha_beta(f.bits)
    order, shifts = cache.packing_tables(name, layer)
    scales, tail = getattr(st, f"{name}_scales"), getattr(st, f"{name}_tail")
    sink = getattr(st, f"{name}_sink")
    with triton_runtime.on_device(src.device):
        cache_write.decode_write_kernel[(src.shape[0], cache.num_kv_heads)](
            src_ptr=src,
            src_stride_b=src.stride(0),
            src_stride_h=src.stride(1),
            desc_ptr=desc,
            sink_ptr=sink,
            tail_ptr=tail,
            words_ptr=getattr(st, f"{name}_words"),
            scales_ptr=scales,
            order_ptr=order,
            shifts_ptr=shifts,
            H=cache.num_kv_heads,
            SINK=sink.shape[2],
            RING=tail.shape[2],
            PAGE=cache.page_size,
            ENTRIES=scales.shape[2],
            D=cache.head_dim,
            GROUP=f.group_size,
            BITS=f.bits,
            LEVELS=float(f.levels),
            ALPHA_INV=1.0 / alpha,
            BETA=float(beta),
            clip_index=clip_index,
            factor_ptr=scales if gptq is None else gptq,  # (not read without GPTQ)
            CLIP=f.clip is not None,
            GPTQ=gptq is not None,
            PREFETCH=not triton_runtime.interpreting(),
            num_warps=1 if cache.head_dim <= 64 else 2,
            # z' = lo - beta * s' rounds once, as in fold_scale_offset; GPTQ's products and
            # differences round separately, as torch's
            enable_fp_fusion=False,
        )
