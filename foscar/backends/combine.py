"""Split-KV decode as both kernels run it: the workspace of partials, the Triton split kernel
(foscar.kernels.triton_decode) whose programs read history splits and the BF16 windows, and the
log-sum-exp merge of the partials.

A decode launch writes ``parts`` normalised partial outputs per (sequence, query head) into
``o_part: [B, Hq, parts, D]`` float32 with their ``lse_part: [B, Hq, parts]`` float32: split
``0 .. splits - 1`` over the quantized history (the Triton or the Gluon kernel), then, where the
format keeps BF16 tokens, one more from the Triton split kernel's window program. The merge
kernel combines them into ``out: [B, Hq, D]`` (and ``lse: [B, Hq]``). Launches use keyword
arguments only.
"""

from __future__ import annotations

import functools

import torch

from .. import triton_runtime
from ..cache import DecodeBatch, QuantizedKVCache
from ..configs import TritonDecodeConfig, column_widths, triton_decode_config

__all__ = [
    "has_window_program",
    "launch_split",
    "merge_partials",
    "num_sms",
    "window_partial",
    "workspace",
]

MAGIC_BF16X2 = 0x43004300  # two bf16 128.0: the mantissa-injection base of both halves


def has_window_program(fmt) -> bool:
    """Whether a format keeps BF16 tokens beside the history (sink, recent window, or the
    incomplete group of a channel-wise axis), read by the split kernel's window program as one
    more partial. Token-wise K and V without windows keep every token in the history."""
    return fmt.sink_tokens > 0 or fmt.tail_capacity > 1


def workspace(batch: DecodeBatch, shape: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials ``(o_part [B, Hq, parts, D], lse_part [B, Hq, parts])`` float32 for
    ``shape = (B, Hq, parts, D)``, allocated once per batch plan and shape (graph-safe reuse)."""
    memo = batch._workspaces
    key = (shape, device)
    if key not in memo:
        b, h, parts, d = shape
        memo[key] = (
            torch.empty(b, h, parts, d, dtype=torch.float32, device=device),
            torch.empty(b, h, parts, dtype=torch.float32, device=device),
        )
    return memo[key]


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def outputs(q: torch.Tensor, out, lse, return_lse: bool):
    """``out: [B, Hq, D]`` (q's dtype) and ``lse: [B, Hq]`` float32 (when ``return_lse``),
    each allocated where the caller gave none."""
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    return out, lse


def bound_key(cache: QuantizedKVCache, batch: DecodeBatch) -> tuple:
    """What a decode call's bound launches read besides the query and outputs (Note [bound
    launches] in foscar.triton_runtime): the layer, and the addresses of its pools and windows
    and of the plan's tables."""
    st = cache.layers[batch.layer]
    pools = (st.k_words, st.k_scales, st.v_words, st.v_scales, st.k_sink, st.v_sink, st.k_tail,
             st.v_tail)
    tables = (batch.kv_indptr, batch.kv_indices, batch.num_quantized, batch.seq_lens, batch.slots)
    return batch.layer, tuple(t.data_ptr() for t in pools + tables)


def partial_strides(o_part: torch.Tensor, lse_part: torch.Tensor) -> dict[str, int]:
    """The split partials' strides as every split kernel and the merge take them:
    ``o_part: [B, Hq, parts, D]``, ``lse_part: [B, Hq, parts]``."""
    return dict(
        stride_op_b=o_part.stride(0),
        stride_op_h=o_part.stride(1),
        stride_op_split=o_part.stride(2),
        stride_lp_b=lse_part.stride(0),
        stride_lp_h=lse_part.stride(1),
    )


def launch_split(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    sm_scale: float,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    splits: int,
    programs: int,
    cfg: TritonDecodeConfig,
    reconstruct: bool,
) -> None:
    """The Triton split kernel over ``programs`` split indices: ``0 .. splits - 1`` read the
    quantized history, index ``splits`` (when the format has windows) the BF16 sink and tail."""
    kern = triton_runtime.kernel_module("triton_decode")
    fmt = cache.layer_format(batch.layer)
    st = cache.layers[batch.layer]
    d = q.shape[2]
    ratio = q.shape[1] // cache.num_kv_heads
    hs, hpk, hpv = column_widths(fmt, d, ratio, cfg.block_n, reconstruct)
    triton_runtime.launch(
        kern.decode_split_kernel,
        (q.shape[0], cache.num_kv_heads, programs),
        q_ptr=q,
        k_words_ptr=st.k_words,
        k_scales_ptr=st.k_scales,
        v_words_ptr=st.v_words,
        v_scales_ptr=st.v_scales,
        k_sink_ptr=st.k_sink,
        v_sink_ptr=st.v_sink,
        k_tail_ptr=st.k_tail,
        v_tail_ptr=st.v_tail,
        kv_indptr_ptr=batch.kv_indptr,
        kv_indices_ptr=batch.kv_indices,
        num_quantized_ptr=batch.num_quantized,
        seq_lens_ptr=batch.seq_lens,
        slots_ptr=batch.slots,
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        qk_scale=sm_scale * kern.LOG2E,
        magic=MAGIC_BF16X2,
        zero=0.0,
        num_splits=splits,
        stride_q_b=q.stride(0),
        stride_q_h=q.stride(1),
        stride_kw_page=st.k_words.stride(0),
        stride_kw_head=st.k_words.stride(1),
        stride_ks_page=st.k_scales.stride(0),
        stride_ks_head=st.k_scales.stride(1),
        stride_vw_page=st.v_words.stride(0),
        stride_vw_head=st.v_words.stride(1),
        stride_vs_page=st.v_scales.stride(0),
        stride_vs_head=st.v_scales.stride(1),
        stride_sink_slot=st.k_sink.stride(0),
        stride_sink_head=st.k_sink.stride(1),
        stride_tail_slot=st.k_tail.stride(0),
        stride_tail_head=st.k_tail.stride(1),
        **partial_strides(o_part, lse_part),
        H=ratio,
        HS=hs,
        D=d,
        PAGE=cache.page_size,
        BLOCK_N=cfg.block_n,
        K_BITS=fmt.key.bits,
        V_BITS=fmt.value.bits,
        K_CHANNEL=fmt.key.axis.value == "channel",
        V_CHANNEL=fmt.value.axis.value == "channel",
        K_GROUP=fmt.key.group_size,
        V_GROUP=fmt.value.group_size,
        SINK=fmt.sink_tokens,
        TAIL=fmt.tail_capacity,
        HAS_WINDOWS=has_window_program(fmt),
        BLOCK_W=cfg.block_window,
        HPK=hpk,
        HPV=hpv,
        RECONSTRUCT=reconstruct,
        INTERP=triton_runtime.interpreting(),
        TILE_ACC=cfg.tile_acc,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )


def window_partial(q, cache, batch, sm_scale, o_part, lse_part) -> None:
    """Only the BF16 window program, into ``o_part[:, :, 0]`` / ``lse_part[:, :, 0]`` (views of a
    larger workspace: another kernel covers the history splits)."""
    fmt = cache.layer_format(batch.layer)
    cfg = triton_decode_config(fmt, q.shape[2], q.shape[1] // cache.num_kv_heads)
    launch_split(q, cache, batch, sm_scale, o_part, lse_part, 0, 1, cfg, False)


def merge_partials(o_part, lse_part, out, lse=None, *, pdl: bool = False) -> None:
    """LSE merge of the split partials ``o_part: [B, Hq, parts, D]`` into ``out`` (and ``lse``).
    ``pdl``: launch it as a programmatic dependent of the previous kernel (sm_90+; that kernel
    signals ``griddepcontrol.launch_dependents``), so its launch overlaps that kernel's tail."""
    kern = triton_runtime.kernel_module("triton_decode")
    bsz, num_q_heads, parts, d = o_part.shape
    return_lse = lse is not None
    triton_runtime.launch(
        kern.merge_splits_kernel,
        (bsz, num_q_heads),
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        o_ptr=out,
        lse_ptr=lse if return_lse else out,
        num_parts=parts,
        **partial_strides(o_part, lse_part),
        stride_o_b=out.stride(0),
        stride_o_h=out.stride(1),
        stride_l_b=lse.stride(0) if return_lse else 0,
        stride_l_h=lse.stride(1) if return_lse else 0,
        D=d,
        BLOCK_P=max(2, 1 << (parts - 1).bit_length()),
        WRITE_LSE=return_lse,
        INTERP=triton_runtime.interpreting(),
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
