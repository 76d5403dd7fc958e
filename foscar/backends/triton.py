"""The Triton backend: decode attention with the split kernel and the merge kernel of
foscar.kernels.triton_decode (launched by foscar.backends.combine).

Validates what only this backend requires, keeps the split workspace on the DecodeBatch (so a
CUDA-graph replay allocates nothing) and picks the launch config and the split count.
"""

from __future__ import annotations

import torch

from .. import triton_runtime
from ..cache import DecodeBatch, QuantizedKVCache
from ..configs import TritonDecodeConfig, num_splits, triton_decode_config
from ..formats import OperandMapping, Role, has_kernel_order
from .combine import (
    bound_key,
    has_window_program,
    launch_split,
    merge_partials,
    num_sms,
    outputs,
    workspace,
)

__all__ = ["available", "supports", "decode"]


def available(device: torch.device) -> bool:
    """Triton is importable and can run on ``device`` (CUDA, or the CPU interpreter)."""
    return triton_runtime.available(device, "triton_decode")


def supports(cache: QuantizedKVCache, num_q_heads: int) -> str | None:
    """``None`` if the kernels cover this cache (every layer's format) and head count, else the
    reason they do not."""
    mapping = cache.formats[0].mapping  # shared by the layers
    if mapping is not OperandMapping.BF16:
        return f"the Triton kernels build bf16 operands; mapping is {mapping.value!r}"
    if cache.head_dim not in (64, 128):
        return f"head_dim must be 64 or 128 for the Triton kernels, got {cache.head_dim}"
    for fmt in dict.fromkeys(cache.formats):
        for role, f in ((Role.KEY, fmt.key), (Role.VALUE, fmt.value)):
            if not has_kernel_order(role, cache.head_dim, f.bits):
                return f"no kernel layout for {role.value} rows of head_dim {cache.head_dim}"
    ratio = num_q_heads // cache.num_kv_heads
    if ratio > 16:
        return f"at most 16 query heads per KV head, got {ratio}"
    if cache.window_dtype not in (torch.bfloat16,):
        return f"the BF16 windows must be stored as bfloat16, got {cache.window_dtype}"
    return None


def decode(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    reconstruct: bool = False,
    config: TritonDecodeConfig | None = None,
    splits: int | None = None,
):
    """Run the split kernel and the merge kernel; returns ``out`` (and ``lse``). The launches
    are bound once per plan, layer and arguments (Note [bound launches] in
    foscar.triton_runtime)."""
    bsz, num_q_heads, d = q.shape
    ratio = num_q_heads // cache.num_kv_heads
    fmt = cache.layer_format(batch.layer)
    cfg = config or triton_decode_config(fmt, d, ratio, reconstruct, ctas=bsz * cache.num_kv_heads)
    if splits is None:
        sms = num_sms(q.device.index or 0) if q.is_cuda else 4
        splits = num_splits(bsz, cache.num_kv_heads, batch.split_history, cfg, sms)
    out, lse = outputs(q, out, lse, return_lse)
    key = ("triton", sm_scale, cfg, splits, reconstruct, return_lse, *bound_key(cache, batch))
    triton_runtime.bound_call(
        batch._launches,
        key,
        {"q": q, "out": out, "lse": lse},
        lambda: _launch(q, cache, batch, sm_scale, out, lse, return_lse, reconstruct, cfg, splits),
    )
    return (out, lse) if return_lse else out


def _launch(q, cache, batch, sm_scale, out, lse, return_lse, reconstruct, cfg, splits):
    """decode's launches of ``cfg`` at ``splits`` splits (resolved), into ``out`` (and
    ``lse``)."""
    bsz, num_q_heads, d = q.shape
    fmt = cache.layer_format(batch.layer)
    parts = splits + int(has_window_program(fmt))
    o_part, lse_part = workspace(batch, (bsz, num_q_heads, parts, d), q.device)
    launch_split(q, cache, batch, sm_scale, o_part, lse_part, splits, parts, cfg, reconstruct)
    merge_partials(o_part, lse_part, out, lse if return_lse else None)
