"""What both kernel backends share: the split workspace a plan owns, the conventions of the
split partials, the LSE merge kernel that combines them, and the coverage both need.

A decode launch writes ``parts`` normalised partial outputs per (sequence, query head) into
``o_part: [B, Hq, parts, D]`` float32 with their ``lse_part: [B, Hq, parts]`` float32: split
``0 .. splits - 1`` over the quantized history (the Triton split kernel of
foscar.backends.triton, or the Gluon kernel of foscar.backends.gluon), then, where the format
keeps BF16 tokens, one more from the Triton split kernel's window program. The merge kernel
(foscar.kernels.triton_decode.merge_splits_kernel, launched here) combines them into
``out: [B, Hq, D]`` (and ``lse: [B, Hq]``). Launches use keyword arguments only.
"""

from __future__ import annotations

import functools

import torch

from .. import triton_runtime
from ..cache import DecodeBatch, QuantizedKVCache
from ..formats import Role, has_kernel_order

try:
    from ..kernels import triton_decode
except Exception:  # no Triton, or an install without a backend: the backends are unavailable
    triton_decode = None

__all__ = [
    "SplitWorkspace",
    "bound_key",
    "format_constexprs",
    "has_window_program",
    "layout_reason",
    "merge_partials",
    "num_sms",
    "outputs",
    "partial_strides",
    "pool_arguments",
]

MAGIC_BF16X2 = 0x43004300  # two bf16 128.0: the mantissa-injection base of both halves
LOG2E = 1.4426950408889634  # the launchers pass qk_scale = sm_scale * log2(e) (log2 softmax)


def has_window_program(fmt) -> bool:
    """Whether a format keeps BF16 tokens beside the history (sink, recent window, or the
    incomplete group of a channel-wise axis), read by the split kernel's window program as one
    more partial. Token-wise K and V without windows keep every token in the history."""
    return fmt.sink_tokens > 0 or fmt.tail_capacity > 1


def pool_arguments(cache: QuantizedKVCache, batch: DecodeBatch) -> dict:
    """The keyword arguments naming ``batch``'s layer pools and page tables, and the pools'
    page and head strides, as the Triton decode and extend kernels take them."""
    st = cache.layers[batch.layer]
    return dict(
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
    )


def format_constexprs(fmt) -> dict:
    """A layer format's compile-time arguments of the Triton decode and extend kernels."""
    return dict(
        K_BITS=fmt.key.bits,
        V_BITS=fmt.value.bits,
        K_CHANNEL=fmt.key.axis.value == "channel",
        V_CHANNEL=fmt.value.axis.value == "channel",
        K_GROUP=fmt.key.group_size,
        V_GROUP=fmt.value.group_size,
        SINK=fmt.sink_tokens,
        TAIL=fmt.tail_capacity,
        HAS_WINDOWS=has_window_program(fmt),
    )


def layout_reason(cache: QuantizedKVCache) -> str | None:
    """``None`` if the packed rows of every layer have the kernels' channel layout and the BF16
    windows are stored as bfloat16 (what the split kernel's programs and the Gluon kernel read),
    else why not."""
    for fmt in dict.fromkeys(cache.formats):
        for role, f in ((Role.KEY, fmt.key), (Role.VALUE, fmt.value)):
            if not has_kernel_order(role, cache.head_dim, f.bits):
                return f"no kernel layout for {role.value} rows of head_dim {cache.head_dim}"
    if cache.window_dtype not in (torch.bfloat16,):
        return f"the BF16 windows must be stored as bfloat16, got {cache.window_dtype}"
    return None


class SplitWorkspace:
    """A plan's split partials ``(o_part [B, Hq, parts, D], lse_part [B, Hq, parts])`` float32,
    one pair per shape, allocated once (a CUDA-graph replay and a bound launch read the same
    tensors at every call)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._partials: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def partials(self, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pair for ``shape = (B, Hq, parts, D)``, allocated at its first request."""
        if shape not in self._partials:
            b, h, parts, d = shape
            self._partials[shape] = (
                torch.empty(b, h, parts, d, dtype=torch.float32, device=self.device),
                torch.empty(b, h, parts, dtype=torch.float32, device=self.device),
            )
        return self._partials[shape]

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every pair allocated so far."""
        return list(self._partials.values())


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
    launches] in foscar.triton_runtime): the addresses of the layer's pools and windows and of
    the plan's tables."""
    st = cache.layers[batch.layer]
    pools = (st.k_words, st.k_scales, st.v_words, st.v_scales, st.k_sink, st.v_sink, st.k_tail,
             st.v_tail)
    tables = (batch.kv_indptr, batch.kv_indices, batch.num_quantized, batch.seq_lens, batch.slots)
    return tuple(t.data_ptr() for t in pools + tables)


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


def merge_partials(o_part, lse_part, out, lse=None, *, pdl: bool = False) -> None:
    """LSE merge of the split partials ``o_part: [B, Hq, parts, D]`` into ``out`` (and ``lse``).
    ``pdl``: launch it as a programmatic dependent of the previous kernel (sm_90+; that kernel
    signals ``griddepcontrol.launch_dependents``), so its launch overlaps that kernel's tail."""
    bsz, num_q_heads, parts, d = o_part.shape
    return_lse = lse is not None
    triton_runtime.launch(
        triton_decode.merge_splits_kernel,
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
