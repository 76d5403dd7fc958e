"""The Triton backend: decode attention with the split kernel of foscar.kernels.triton_decode
(launched here: history splits, and the window program over the BF16 sink and tail) and the
merge kernel (foscar.backends.combine).

A :class:`TritonDecodePlan` is made once per DecodeBatch (one layer's): it owns the split
workspace, allocated when it is made (a CUDA-graph replay allocates nothing), and its bound
launches (Note [bound launches] in foscar.triton_runtime); each :meth:`~TritonDecodePlan.run`
picks the launch config and split count of the batch's lengths and launches.
"""

from __future__ import annotations

import torch

from .. import triton_runtime
from ..cache import DecodeBatch, QuantizedKVCache
from ..configs import TritonDecodeConfig, column_widths, triton_decode_config, triton_num_splits
from ..formats import OperandMapping
from .combine import (
    LOG2E,
    MAGIC_BF16X2,
    SplitWorkspace,
    bound_key,
    format_constexprs,
    has_window_program,
    layout_reason,
    merge_partials,
    num_sms,
    outputs,
    partial_strides,
    pool_arguments,
)

try:
    from ..kernels import triton_decode
except Exception:  # no Triton, or an install without a backend: available() says so
    triton_decode = None

__all__ = ["TritonDecodePlan", "available", "decode", "launch_split", "supports", "window_partial"]

#: split count's SM stand-in off CUDA (the interpreter): a few splits, so that they are tested
INTERPRETER_SMS = 4


def available(device: torch.device) -> bool:
    """Triton is importable and can run on ``device`` (CUDA, or the CPU interpreter)."""
    return triton_runtime.available(device, triton_decode)


def supports(cache: QuantizedKVCache, num_q_heads: int) -> str | None:
    """``None`` if the kernels cover this cache (every layer's format) and head count, else the
    reason they do not."""
    mapping = cache.formats[0].mapping  # shared by the layers
    if mapping is not OperandMapping.BF16:
        return f"the Triton kernels build bf16 operands; mapping is {mapping.value!r}"
    if cache.head_dim not in (64, 128):
        return f"head_dim must be 64 or 128 for the Triton kernels, got {cache.head_dim}"
    reason = layout_reason(cache)
    if reason is not None:
        return reason
    ratio = num_q_heads // cache.num_kv_heads
    if ratio > 16:
        return f"at most 16 query heads per KV head, got {ratio}"
    return None


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
    fmt = cache.layer_format(batch.layer)
    d = q.shape[2]
    ratio = q.shape[1] // cache.num_kv_heads
    hs, hpk, hpv = column_widths(fmt, d, ratio, cfg.block_n, reconstruct)
    triton_runtime.launch(
        triton_decode.decode_split_kernel,
        (q.shape[0], cache.num_kv_heads, programs),
        q_ptr=q,
        **pool_arguments(cache, batch),
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        qk_scale=sm_scale * LOG2E,
        magic=MAGIC_BF16X2,
        zero=0.0,
        num_splits=splits,
        stride_q_b=q.stride(0),
        stride_q_h=q.stride(1),
        **partial_strides(o_part, lse_part),
        H=ratio,
        HS=hs,
        D=d,
        PAGE=cache.page_size,
        BLOCK_N=cfg.block_n,
        **format_constexprs(fmt),
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
    """Only the split kernel's window program, into ``o_part[:, :, 0]`` / ``lse_part[:, :, 0]``
    (views of a larger workspace: another kernel covers the history splits)."""
    fmt = cache.layer_format(batch.layer)
    cfg = triton_decode_config(fmt, q.shape[2], q.shape[1] // cache.num_kv_heads)
    launch_split(q, cache, batch, sm_scale, o_part, lse_part, 0, 1, cfg, False)


class TritonDecodePlan:
    """The split kernel and the merge over one DecodeBatch (its layer), for queries of
    ``num_q_heads`` heads at ``sm_scale``.

    ``config`` and ``splits`` fix the launch config and the split count (default: chosen at
    each :meth:`run` from the batch's lengths, ``configs.triton_decode_config`` and
    ``configs.triton_num_splits``); ``reconstruct``: the per-value reconstruction baseline. The
    split workspace of the batch's current lengths is allocated here.
    """

    def __init__(
        self,
        cache: QuantizedKVCache,
        batch: DecodeBatch,
        num_q_heads: int,
        sm_scale: float,
        *,
        reconstruct: bool = False,
        config: TritonDecodeConfig | None = None,
        splits: int | None = None,
    ) -> None:
        self.cache = cache
        self.batch = batch
        self.num_q_heads = num_q_heads
        self.sm_scale = sm_scale
        self.reconstruct = reconstruct
        self.config = config
        self.splits = splits
        self.workspace = SplitWorkspace(cache.device)
        #: the runs' bound launches (Note [bound launches] in foscar.triton_runtime)
        self.bound: dict = {}
        self.workspace.partials(self._partials_shape(*self._launch_shape()))

    def _launch_shape(self) -> tuple[TritonDecodeConfig, int]:
        """The config and split count of the batch's current lengths."""
        cache, batch = self.cache, self.batch
        bsz = batch.batch_size
        ratio = self.num_q_heads // cache.num_kv_heads
        fmt = cache.layer_format(batch.layer)
        cfg = self.config or triton_decode_config(
            fmt, cache.head_dim, ratio, self.reconstruct, ctas=bsz * cache.num_kv_heads
        )
        splits = self.splits
        if splits is None:
            device = cache.device
            sms = num_sms(device.index or 0) if device.type == "cuda" else INTERPRETER_SMS
            splits = triton_num_splits(bsz, cache.num_kv_heads, batch.split_history, cfg, sms)
        return cfg, splits

    def _partials_shape(self, cfg, splits: int) -> tuple[int, int, int, int]:
        fmt = self.cache.layer_format(self.batch.layer)
        parts = splits + int(has_window_program(fmt))
        return (self.batch.batch_size, self.num_q_heads, parts, self.cache.head_dim)

    def run(
        self,
        q: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Attention of ``q: [B, Hq, D]`` bfloat16 (checked by the caller) over the batch;
        returns ``out`` (and ``lse: [B, Hq]`` float32 with ``return_lse``). The launches are
        bound once per config and split count (Note [bound launches])."""
        cfg, splits = self._launch_shape()
        out, lse = outputs(q, out, lse, return_lse)
        key = (cfg, splits, return_lse, *bound_key(self.cache, self.batch))
        with triton_runtime.on_device(q.device):  # a cache on cuda:1 while cuda:0 is current
            triton_runtime.bound_call(
                self.bound,
                key,
                {"q": q, "out": out, "lse": lse},
                lambda: self._launch(q, out, lse if return_lse else None, cfg, splits),
            )
        return (out, lse) if return_lse else out

    def _launch(self, q, out, lse, cfg, splits) -> None:
        """The split kernel of ``cfg`` at ``splits`` splits and the merge, into ``out`` (and
        ``lse``)."""
        o_part, lse_part = self.workspace.partials(self._partials_shape(cfg, splits))
        parts = o_part.shape[2]
        launch_split(
            q, self.cache, self.batch, self.sm_scale, o_part, lse_part, splits, parts, cfg,
            self.reconstruct,
        )
        merge_partials(o_part, lse_part, out, lse)


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
    """One call of a fresh :class:`TritonDecodePlan` (a plan made for it, used once): returns
    ``out`` (and ``lse``)."""
    plan = TritonDecodePlan(
        cache, batch, q.shape[1], sm_scale, reconstruct=reconstruct, config=config, splits=splits
    )
    return plan.run(q, out=out, lse=lse, return_lse=return_lse)
