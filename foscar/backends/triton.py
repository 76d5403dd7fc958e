"""Launchers of the Triton kernels: decode attention (foscar.kernels.triton_decode) and a decode
step's cache write (foscar.kernels.cache_write).

Validates what only this backend requires, keeps the split workspace on the DecodeBatch (so a
CUDA-graph replay allocates nothing), computes the grid and calls the kernels with keyword
arguments only.
"""

from __future__ import annotations

import functools
import os

import torch

from ..cache import DecodeBatch, QuantizedKVCache
from ..configs import TritonDecodeConfig, column_widths, num_splits, triton_decode_config
from ..formats import OperandMapping, Role, has_kernel_order
from . import on_device

__all__ = ["available", "supports", "decode", "write_decode_tokens"]

MAGIC_BF16X2 = 0x43004300  # two bf16 128.0: the mantissa-injection base of both halves


@functools.cache
def _triton():
    try:
        import triton  # noqa: F401

        from ..kernels import triton_decode
    except Exception:  # ImportError, or a broken install without a backend
        return None
    if interpreting():
        _patch_interpreter_for_numpy2()
    return triton_decode


def _patch_interpreter_for_numpy2() -> None:
    """Note [interpreter and numpy >= 2.4]: triton 3.6's interpreter turns scalar tensors into
    Python ints with ``int(array)`` on 1-element 1-d arrays (in ``range(t0, t1)`` with tensor
    bounds), which numpy 2.4 rejects. Read the single element instead."""
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_foscar_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        )

    patched._foscar_patched = True
    interp._patch_lang_tensor = patched


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> bool:
    """Triton is importable and can run on ``device`` (CUDA, or the CPU interpreter)."""
    if _triton() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


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


def has_window_program(fmt) -> bool:
    """Whether a format keeps BF16 tokens beside the history (sink, recent window, or the
    incomplete group of a channel-wise axis), read by the split kernel's window program as one
    more partial. Token-wise K and V without windows keep every token in the history."""
    return fmt.sink_tokens > 0 or fmt.tail_capacity > 1


def _workspace(batch: DecodeBatch, shape: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials, allocated once per batch plan and shape (graph-safe reuse)."""
    cache = batch.__dict__.setdefault("_workspaces", {})
    key = (shape, device)
    if key not in cache:
        b, h, parts, d = shape
        cache[key] = (
            torch.empty(b, h, parts, d, dtype=torch.float32, device=device),
            torch.empty(b, h, parts, dtype=torch.float32, device=device),
        )
    return cache[key]


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
    """Run the split kernel and the merge kernel; returns ``out`` (and ``lse``)."""
    bsz, num_q_heads, d = q.shape
    ratio = num_q_heads // cache.num_kv_heads
    fmt = cache.layer_format(batch.layer)
    cfg = config or triton_decode_config(fmt, d, ratio, reconstruct, ctas=bsz * cache.num_kv_heads)
    if splits is None:
        sms = _num_sms(q.device.index or 0) if q.is_cuda else 4
        splits = num_splits(bsz, cache.num_kv_heads, max(batch.num_quantized_host), cfg, sms)
    parts = splits + int(has_window_program(fmt))
    o_part, lse_part = _workspace(batch, (bsz, num_q_heads, parts, d), q.device)
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(bsz, num_q_heads, dtype=torch.float32, device=q.device)
    _launch_split(q, cache, batch, sm_scale, o_part, lse_part, splits, parts, cfg, reconstruct)
    merge_partials(o_part, lse_part, out, lse if return_lse else None)
    return (out, lse) if return_lse else out


def _launch_split(q, cache, batch, sm_scale, o_part, lse_part, splits, programs, cfg, reconstruct):
    """The split kernel over ``programs`` split indices: ``0 .. splits - 1`` read the quantized
    history, index ``splits`` (when the format has windows) the BF16 sink and tail."""
    kern = _triton()
    fmt = cache.layer_format(batch.layer)
    st = cache.layers[batch.layer]
    d = q.shape[2]
    ratio = q.shape[1] // cache.num_kv_heads
    hs, hpk, hpv = column_widths(fmt, d, ratio, cfg.block_n, reconstruct)
    has_windows = has_window_program(fmt)
    kern.decode_split_kernel[(q.shape[0], cache.num_kv_heads, programs)](
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
        stride_op_b=o_part.stride(0),
        stride_op_h=o_part.stride(1),
        stride_op_split=o_part.stride(2),
        stride_lp_b=lse_part.stride(0),
        stride_lp_h=lse_part.stride(1),
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
        HAS_WINDOWS=has_windows,
        BLOCK_W=cfg.block_window,
        HPK=hpk,
        HPV=hpv,
        RECONSTRUCT=reconstruct,
        INTERP=interpreting(),
        TILE_ACC=cfg.tile_acc,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )


def window_partial(q, cache, batch, sm_scale, o_part, lse_part) -> None:
    """Only the BF16 window program, into ``o_part[:, :, 0]`` / ``lse_part[:, :, 0]`` (views of a
    larger workspace: another backend covers the history splits)."""
    fmt = cache.layer_format(batch.layer)
    cfg = triton_decode_config(fmt, q.shape[2], q.shape[1] // cache.num_kv_heads)
    _launch_split(q, cache, batch, sm_scale, o_part, lse_part, 0, 1, cfg, False)


def merge_partials(o_part, lse_part, out, lse=None, *, pdl: bool = False) -> None:
    """LSE merge of the split partials ``o_part: [B, Hq, parts, D]`` into ``out`` (and ``lse``).
    ``pdl``: launch it as a programmatic dependent of the previous kernel (sm_90+; that kernel
    signals ``griddepcontrol.launch_dependents``), so its launch overlaps that kernel's tail."""
    kern = _triton()
    bsz, num_q_heads, parts, d = o_part.shape
    return_lse = lse is not None
    kern.merge_splits_kernel[(bsz, num_q_heads)](
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        o_ptr=out,
        lse_ptr=lse if return_lse else out,
        num_parts=parts,
        stride_op_b=o_part.stride(0),
        stride_op_h=o_part.stride(1),
        stride_op_split=o_part.stride(2),
        stride_lp_b=lse_part.stride(0),
        stride_lp_h=lse_part.stride(1),
        stride_o_b=out.stride(0),
        stride_o_h=out.stride(1),
        stride_l_b=lse.stride(0) if return_lse else 0,
        stride_l_h=lse.stride(1) if return_lse else 0,
        D=d,
        BLOCK_P=max(2, 1 << (parts - 1).bit_length()),
        WRITE_LSE=return_lse,
        INTERP=interpreting(),
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )


@functools.cache
def _cache_write():
    _triton()  # the interpreter patch, if interpreting
    from ..kernels import cache_write

    return cache_write


def write_decode_tokens(cache: QuantizedKVCache, layer: int, name: str, src, desc) -> None:
    """One decode step's write of role ``name`` ("k" or "v") into ``layer``, one launch.

    src: ``[batch, H, D]`` the new tokens in the cache's window dtype (last axis contiguous);
    desc: ``[batch, 6]`` int32 on the cache's device (foscar.kernels.cache_write.DESC_FIELDS).
    The caller (:meth:`QuantizedKVCache.append`) has checked everything and chosen this path
    only for a token-wise history format (``QuantizedKVCache.fused_write_reason``); the layer's
    clip ratio and (for K) GPTQ factors come from its transform.
    """
    kern = _cache_write()
    st = cache.layers[layer]
    f = cache._history_format(layer, name)
    d = cache.head_dim
    clip_index = -1 if f.clip is None else min(int(f.clip * d), d - 1)  # as clip_per_token
    gptq = cache.transforms[layer].key_gptq if name == "k" else None
    alpha, beta = cache.layer_format(layer).mapping.alpha_beta(f.bits)
    order, shifts = cache.packing_tables(name, layer)
    scales, tail = getattr(st, f"{name}_scales"), getattr(st, f"{name}_tail")
    sink = getattr(st, f"{name}_sink")
    with on_device(src.device):
        kern.decode_write_kernel[(src.shape[0], cache.num_kv_heads)](
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
            PREFETCH=not interpreting(),
            num_warps=1 if cache.head_dim <= 64 else 2,
            # z' = lo - beta * s' rounds once, as in fold_scale_offset; GPTQ's products and
            # differences round separately, as torch's
            enable_fp_fusion=False,
        )
