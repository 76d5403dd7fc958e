"""Extend attention: a chunk of new tokens of one request (a chunked prefill's later chunk)
attending to the request's stored tokens and, causally, to itself.

:func:`extend_attention` is the one entry both callers use (``FoscarCache``'s extend path and the
serving core). ``path="triton"`` launches the Triton extend kernel (foscar.kernels.triton_extend)
over the quantized pages, the BF16 windows and the chunk's own BF16 keys and values; the default
takes the torch path (:func:`attend_chunk`: the history dequantized, then SDPA) on every device
until the kernel has passed its tests on a GPU and been timed there (docs/tuning.md, Extend
kernel).
On both paths a layer's OSCAR rotations are applied to the query, the chunk's keys and values and
the output (``q R_K``, ``k R_K``, ``v R_V``, ``o R_V^T``; per chunk token, not per token of the
history), and the pages are read as stored.

Shapes: ``T`` chunk tokens, ``H_q`` query heads, ``H`` KV heads (query head ``h`` reads KV head
``h // (H_q / H)``), ``D`` head_dim. Launches use keyword arguments only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention.bias import causal_lower_right

from .. import triton_runtime
from ..cache import DecodeBatch, QuantizedKVCache
from ..cache.read import dequantize_sequence
from ..configs import column_widths
from . import triton as triton_backend
from .combine import (
    LOG2E,
    MAGIC_BF16X2,
    format_constexprs,
    merge_partials,
    num_sms,
    pool_arguments,
)

try:
    from ..kernels import triton_extend
except Exception:  # no Triton, or an install without a backend: kernel_reason() says so
    triton_extend = None

__all__ = [
    "CHUNK_SCORE_BYTES",
    "ExtendConfig",
    "attend_chunk",
    "extend_attention",
    "extend_config",
    "extend_splits",
]

EXTEND_PATHS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class ExtendConfig:
    """Launch knobs of the extend kernel (not yet tuned on a GPU: ``run_device.sh extend``
    measures them beside FlashInfer's BF16 prefill)."""

    block_t: int = 4  # chunk tokens per program (query columns: block_t x query heads per KV head)
    block_n: int = 64  # tokens per tile of the quantized history
    block_window: int = 32  # tokens per tile of the BF16 sink/tail and of the chunk
    num_warps: int = 4
    num_stages: int = 2
    tile_acc: bool = True  # token-wise V: fresh PV accumulator per tile (triton_decode Note)


def extend_config(fmt, head_dim: int, heads_per_kv: int) -> ExtendConfig:
    """The config for a layer format and a GQA ratio: about 32 query columns per program, and
    64-token history tiles, except:

    - token-wise K of 2+ channel groups: 32-token tiles (4+ groups: as decode, whose larger
      tiles faulted on the H200, foscar.configs.triton_decode_config; 2 groups at head_dim 64:
      a 64-token tile spilled 6 KB per thread and compiled for minutes, a 32-token one 0.25 KB
      in 4 s; ``python benchmarks/tools/extend_sass.py --every-format``);
    - channel-wise K of groups shorter than 64 tokens: tiles of one token group, so that K
      folds into one column block per tile (a 64-token tile folds into two; with token-wise V
      that specialization spent 34 s (V g = 128) and over 90 s (V g = 32) in LLVM for sm_90a
      against 4-5 s for every other; ``python benchmarks/tools/extend_sass.py --every-format``).
    """
    block_t = max(1, 32 // heads_per_kv)
    block_n = 64
    if fmt.key.axis.value == "token" and head_dim // fmt.key.group_size >= 2:
        block_n = 32
    if fmt.key.axis.value == "channel" and fmt.key.group_size < block_n:
        block_n = fmt.key.group_size
    return ExtendConfig(block_t=block_t, block_n=block_n)


def query_columns(cfg: ExtendConfig, heads_per_kv: int) -> int:
    """Query columns HS of a program: ``block_t x heads_per_kv`` padded to a power of two >= 16."""
    return max(16, 1 << (cfg.block_t * heads_per_kv - 1).bit_length())


def extend_splits(num_tokens: int, num_kv_heads: int, history: int, cfg: ExtendConfig, sms: int):
    """History splits: one while the chunk's programs fill the device; else enough to fill it,
    each split at least two history tiles."""
    programs = math.ceil(num_tokens / cfg.block_t) * num_kv_heads
    if programs >= sms:
        return 1
    tiles = math.ceil(history / cfg.block_n)
    return max(1, min(math.ceil(sms / programs), tiles // 2))


def _check(q_chunk, k_chunk, v_chunk, cache, batch, row, out, new_mask) -> None:
    """ValueError naming the first argument that is not as extend_attention documents."""
    if q_chunk.dim() != 3 or q_chunk.shape[2] != cache.head_dim:
        raise ValueError(
            f"q_chunk must be [T, H_q, head_dim={cache.head_dim}], got {list(q_chunk.shape)}"
        )
    t, num_q_heads, d = q_chunk.shape
    if num_q_heads % cache.num_kv_heads:
        raise ValueError(
            f"q_chunk's heads ({num_q_heads}) must be a multiple of num_kv_heads "
            f"({cache.num_kv_heads})"
        )
    for name, x in (("k_chunk", k_chunk), ("v_chunk", v_chunk)):
        if tuple(x.shape) != (t, cache.num_kv_heads, d):
            raise ValueError(
                f"{name} must be [T={t}, H={cache.num_kv_heads}, D={d}], got {list(x.shape)}"
            )
    if not 0 <= row < len(batch.seq_ids):
        last = len(batch.seq_ids) - 1
        raise ValueError(f"row must name a planned sequence (0..{last}), got {row}")
    if out is not None and (tuple(out.shape) != tuple(q_chunk.shape) or out.stride(-1) != 1):
        raise ValueError(f"out must be [T, H_q, D] = {list(q_chunk.shape)} with unit stride in D")
    if new_mask is not None and (new_mask.dtype != torch.bool or tuple(new_mask.shape) != (t,)):
        raise ValueError(
            f"new_mask must be bool [T={t}], got {new_mask.dtype} {list(new_mask.shape)}"
        )


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


def extend_attention(
    q_chunk: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    row: int,
    sm_scale: float | None = None,
    *,
    new_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    path: str = "auto",
    config: ExtendConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of a chunk of new tokens of sequence ``batch.seq_ids[row]`` over its stored
    tokens in layer ``batch.layer`` and, bottom-right causal, over the chunk itself (the chunk
    is appended to the cache by the caller, after this call).

    Parameters
    ----------
    q_chunk : [T, H_q, D] the chunk's queries (model coordinates; any strides, unit in D).
    k_chunk, v_chunk : [T, H, D] the chunk's keys and values (model coordinates).
    cache, batch, row : the cache, a plan of it naming the layer, the sequence's row in it.
    sm_scale : softmax scale (default ``1 / sqrt(D)``).
    new_mask : bool [T], the chunk's real tokens (None: all); the others are neither keys nor
        computed (their output rows are zero on the kernel path).
    out : [T, H_q, D] output buffer (q's dtype); allocated when None.
    path : ``"auto"`` (the torch path, for now on every device: module docstring), ``"triton"``
        (the kernel; on the CPU through the Triton interpreter) or ``"torch"``.
    config, num_splits : kernel launch knobs (:func:`extend_config`, :func:`extend_splits`).

    Returns
    -------
    [T, H_q, D] in q's dtype (``out`` when given).

    Example
    -------
    >>> plan = cache.plan([seq], layer)
    >>> o = extend_attention(q, k, v, cache, plan, 0)  # then cache.append([seq], k, v, [T])
    """
    if path not in EXTEND_PATHS:
        raise ValueError(f"path must be one of {EXTEND_PATHS}, got {path!r}")
    _check(q_chunk, k_chunk, v_chunk, cache, batch, row, out, new_mask)
    sm_scale = 1.0 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    use_kernel = path == "triton"  # "auto": the torch path (module docstring)
    if use_kernel:
        reason = kernel_reason(q_chunk, cache)
        if reason is not None and path == "triton":
            raise ValueError(f"path='triton': {reason}")
        use_kernel = reason is None
    if not use_kernel:
        o = _torch_path(q_chunk, k_chunk, v_chunk, cache, batch, row, sm_scale, new_mask)
        if out is None:
            return o
        out.copy_(o)
        return out
    if out is None:
        out = torch.empty_like(q_chunk)
    if new_mask is not None and not bool(new_mask.all()):
        keep = new_mask.nonzero().squeeze(1)
        out.zero_()
        o = _kernel(q_chunk[keep], k_chunk[keep], v_chunk[keep], cache, batch, row, sm_scale,
                    None, config, num_splits)  # fmt: skip
        out[keep] = o
        return out
    return _kernel(q_chunk, k_chunk, v_chunk, cache, batch, row, sm_scale, out, config, num_splits)


def _torch_path(q, k, v, cache, batch, row, sm_scale, new_mask) -> torch.Tensor:
    """:func:`attend_chunk` over the history as stored: a layer's OSCAR
    rotations go on the query, the chunk and the output (fp32), not undone over the history."""
    tr = cache.transforms[batch.layer]
    dtype = q.dtype
    if tr.key_rotation is not None:
        q, k = tr.rotate(q, "key"), tr.rotate(k, "key")
    if tr.value_rotation is not None:
        v = tr.rotate(v, "value")
    o = attend_chunk(
        cache, batch, row, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), sm_scale,
        new_mask, stored=True,
    ).transpose(0, 1)  # fmt: skip
    if tr.value_rotation is not None:
        o = tr.rotate(o, "value", inverse=True)
    return o.to(dtype)


def kernel_reason(q_chunk: torch.Tensor, cache: QuantizedKVCache) -> str | None:
    """None if the extend kernel can run ``q_chunk`` on ``cache`` here, else why not."""
    if not triton_runtime.available(q_chunk.device, triton_extend):
        return (
            "the extend kernel needs Triton on CUDA (or the interpreter), q is on "
            f"{q_chunk.device}"
        )
    return triton_backend.supports(cache, q_chunk.shape[1])


def _kernel(q, k, v, cache, batch, row, sm_scale, out, config, num_splits) -> torch.Tensor:
    """The rotations, the kernel and (several splits) the merge; returns ``[T, H_q, D]``."""
    cache.check_plan(batch)
    tr = cache.transforms[batch.layer]
    dtype = q.dtype
    if tr.key_rotation is not None:
        q = tr.rotate(q, "key")
        k = tr.rotate(k, "key")
    if tr.value_rotation is not None:
        v = tr.rotate(v, "value")
    interp = triton_runtime.interpreting()
    operand = torch.float32 if interp else cache.window_dtype
    q = q.to(torch.bfloat16)  # the GPU's operand; the interpreter computes on its fp32 values
    if interp:
        q = q.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    # the chunk's keys and values as the windows would store them (rounded to the window dtype)
    k = k.to(cache.window_dtype).to(operand).contiguous()
    v = v.to(cache.window_dtype).to(operand).contiguous()
    rotated_out = tr.value_rotation is not None
    target = None if rotated_out else out
    o = launch_extend(q, k, v, cache, batch, row, sm_scale, target, config, num_splits, dtype)
    if rotated_out:
        o = tr.rotate(o, "value", inverse=True).to(dtype)
        if out is None:
            return o
        out.copy_(o)
        return out
    return o


def launch_extend(
    q, k, v, cache, batch, row, sm_scale, out=None, config=None, num_splits=None, dtype=None
) -> torch.Tensor:
    """The extend kernel on the stored coordinates: ``q: [T, H_q, D]``, ``k, v: [T, H, D]``
    contiguous (bf16 on a GPU) -> ``out: [T, H_q, D]`` (``dtype``, default q's)."""
    kern = triton_extend
    t, num_q_heads, d = q.shape
    ratio = num_q_heads // cache.num_kv_heads
    fmt = cache.layer_format(batch.layer)
    cfg = config or extend_config(fmt, d, ratio)
    hs = query_columns(cfg, ratio)
    # the product widths of decode's tile at HS query columns
    _, hpk, hpv = column_widths(fmt, d, hs, cfg.block_n, False)
    if num_splits is None:
        sms = num_sms(q.device.index or 0) if q.is_cuda else 4
        num_splits = extend_splits(t, cache.num_kv_heads, batch.num_quantized_host[row], cfg, sms)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype or q.dtype, device=q.device)
    direct = num_splits == 1
    if direct:
        o_part = lse_part = out  # unused
        part_strides = (0,) * 6
    else:
        # the merge's layout (foscar.backends.combine): splits after the heads
        o_part = torch.empty(t, num_q_heads, num_splits, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(t, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides = (o_part.stride(2), o_part.stride(0), o_part.stride(1), lse_part.stride(2),
                        lse_part.stride(0), lse_part.stride(1))  # fmt: skip
    with triton_runtime.on_device(q.device):
        triton_runtime.launch(
            kern.extend_kernel,
            (math.ceil(t / cfg.block_t), cache.num_kv_heads, num_splits),
            q_ptr=q,
            k_chunk_ptr=k,
            v_chunk_ptr=v,
            **pool_arguments(cache, batch),
            o_ptr=out,
            o_part_ptr=o_part,
            lse_part_ptr=lse_part,
            row=row,
            num_tokens=t,
            qk_scale=sm_scale * LOG2E,
            magic=MAGIC_BF16X2,
            zero=0.0,
            num_splits=num_splits,
            stride_q_t=q.stride(0),
            stride_q_h=q.stride(1),
            stride_kc_t=k.stride(0),
            stride_kc_h=k.stride(1),
            stride_o_t=out.stride(0),
            stride_o_h=out.stride(1),
            stride_op_split=part_strides[0],
            stride_op_t=part_strides[1],
            stride_op_h=part_strides[2],
            stride_lp_split=part_strides[3],
            stride_lp_t=part_strides[4],
            stride_lp_h=part_strides[5],
            H=ratio,
            BLOCK_T=cfg.block_t,
            HS=hs,
            D=d,
            PAGE=cache.page_size,
            BLOCK_N=cfg.block_n,
            **format_constexprs(fmt),
            BLOCK_W=cfg.block_window,
            HPK=hpk,
            HPV=hpv,
            DIRECT=direct,
            ROUND_OUT=out.dtype == torch.bfloat16,
            INTERP=triton_runtime.interpreting(),
            TILE_ACC=cfg.tile_acc,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if not direct:
            merge_partials(o_part, lse_part, out)
    return out
