"""Launcher of the warp-specialized Hopper kernel (foscar.kernels.gluon).

The Gluon kernel reads the quantized history (one or two 64-token pages per tile,
``GluonDecodeConfig.tile_pages``; TMA ring, wgmma with register operands built from the packed
words); a format's BF16 sink/recent windows are read by the Triton kernel's window program into
one more partial, and the Triton merge kernel combines the partials (a programmatic dependent
launch of the split kernel when there are no windows); a launch of one split without windows
writes the output itself. A :class:`GluonDecodePlan`, made once per DecodeBatch (one layer's),
owns everything the launches read besides the cache and the batch: the split workspace
(allocated when the plan is made, so a CUDA-graph replay allocates nothing), the TMA
descriptors of the layer's pools and the bound launches (Note [bound launches] in
foscar.triton_runtime).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import torch

from .. import triton_runtime
from ..cache import DecodeBatch, QuantizedKVCache
from ..configs import (
    GLUON_TILE_PAGE_TOKENS,
    GluonDecodeConfig,
    GluonFlag,
    bf16_packs_heads,
    gluon_decode_config,
    gluon_e4m3_config,
    gluon_num_splits,
    gluon_packed_config,
)
from ..formats import GroupAxis, OperandMapping
from . import combine
from .triton import window_partial

__all__ = [
    "GluonDecodePlan",
    "available",
    "kernel_module",
    "supports",
    "supports_e4m3",
    "decode",
    "default_config",
    "OPERANDS",
]

HEAD_DIMS = (128, 64)  # 64: token-wise K and V only
PAGE_SIZE = GLUON_TILE_PAGE_TOKENS
#: cache page sizes the kernel covers: 64, and 16 or 32 (a tile of 64 tokens is 64 / page_size
#: whole pages) for token-wise K and V at head_dim 128, the combinations whose GPU cases passed
#: on the H200. The kernel also reads 64-row parts of larger pages (128, 256): those compile and
#: were timed, but only 128 at INT2 ran its GPU cases, so they and head_dim 64 at other pages
#: are left to the Triton kernel
PAGE_SIZES = (16, 32, 64)
MAX_HEADS_PER_KV = 8  # the wgmma N of the QK and PV products (HS = 8)


#: the triton releases whose Gluon API the kernel is written against (Gluon is experimental:
#: 3.9 removed ``tma.async_copy_global_to_shared``, for one); others fall back to Triton
GLUON_TRITON_VERSIONS = ("3.6.",)


@functools.cache
def kernel_module():
    """foscar.kernels.gluon, or None where this triton has no Gluon of a release in
    :data:`GLUON_TRITON_VERSIONS`."""
    try:
        import triton

        if not triton.__version__.startswith(GLUON_TRITON_VERSIONS):
            return None
        from ..kernels import gluon as gluon_kernel
    except Exception:  # triton without Gluon (or without its Hopper module)
        return None
    return gluon_kernel


def available(device: torch.device) -> bool:
    """Gluon is importable and ``device`` is a Hopper GPU (sm_90: wgmma, TMA, setmaxnreg)."""
    if device.type != "cuda" or kernel_module() is None:
        return False
    if not triton_runtime.available(device, combine.triton_decode):  # the windows and merge
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def supports(cache: QuantizedKVCache, num_q_heads: int) -> str | None:
    """``None`` if the Gluon kernel covers this cache (every layer's format) and head count,
    else the reason."""
    for fmt in dict.fromkeys(cache.formats):
        reason = _supports_format(cache, fmt, num_q_heads)
        if reason is not None:
            return reason
    return combine.layout_reason(cache)  # the window program and the merge read them too


def _supports_format(cache: QuantizedKVCache, fmt, num_q_heads: int) -> str | None:
    if fmt.mapping is not OperandMapping.BF16:
        return f"the Gluon kernel builds bf16 operands; mapping is {fmt.mapping.value!r}"
    k, v = fmt.key, fmt.value
    d = cache.head_dim
    if d not in HEAD_DIMS:
        return f"the Gluon kernel needs head_dim 128 or 64, got {d}"
    for role, q in (("key", k), ("value", v)):
        if q.bits not in (2, 4):
            return f"the Gluon kernel covers INT2/INT4 {role}s; {role} is {q.short()}"
        if q.axis is GroupAxis.CHANNEL:
            if d != 128:
                return (
                    f"the Gluon kernel covers channel-wise groups at head_dim 128 only (got "
                    f"{d}); {role} is {q.short()}"
                )
            if q.group_size != 2 * PAGE_SIZE:
                return (
                    f"the Gluon kernel covers channel-wise {role}s in groups of "
                    f"{2 * PAGE_SIZE} tokens (2 pages); {role} is {q.short()}"
                )
        elif q.group_size != d:
            return (
                f"the Gluon kernel covers token-wise {role}s with g=head_dim={d}; "
                f"{role} is {q.short()}"
            )
    if cache.page_size != PAGE_SIZE and GroupAxis.CHANNEL in (k.axis, v.axis):
        return (
            f"the Gluon kernel covers channel-wise groups at page_size {PAGE_SIZE} (a group is "
            f"two pages), got {cache.page_size}"
        )
    if cache.page_size not in PAGE_SIZES:
        return f"the Gluon kernel covers page sizes {PAGE_SIZES}, got {cache.page_size}"
    if cache.page_size != PAGE_SIZE and d != 128:
        return (
            f"the Gluon kernel covers page_size {cache.page_size} at head_dim 128 (got {d}); "
            f"head_dim {d} takes page_size {PAGE_SIZE}"
        )
    ratio = num_q_heads // cache.num_kv_heads
    if ratio > MAX_HEADS_PER_KV:
        return f"at most {MAX_HEADS_PER_KV} query heads per KV head, got {ratio}"
    return None


#: operand mappings the kernel builds from the same (bf16-layout) cache: "bf16" (mantissa
#: injection, the default) or "e4m3" (FP8 wgmma, GluonFlag.E4M3; token-wise K and V at head_dim
#: 128; Q and P' rounded to per-head scaled E4M3, so about 20x bf16's error)
OPERANDS = ("bf16", "e4m3")


def supports_e4m3(cache: QuantizedKVCache) -> str | None:
    """``None`` if the E4M3 operand path covers this cache's formats, else the reason (on top
    of :func:`supports`; the path reads the bf16-mapping cache with another extraction)."""
    mapping = cache.formats[0].mapping  # shared by the layers
    if mapping is not OperandMapping.BF16:
        return (
            "operands='e4m3' reads caches of mapping 'bf16' (the Gluon kernel's layout); "
            f"mapping is {mapping.value!r}"
        )
    for fmt in dict.fromkeys(cache.formats):
        k, v = fmt.key, fmt.value
        if k.axis is GroupAxis.CHANNEL or v.axis is GroupAxis.CHANNEL:
            return (
                f"operands='e4m3' covers token-wise K and V; the format is key {k.short()}, "
                f"value {v.short()}"
            )
    if cache.head_dim != 128:
        return f"operands='e4m3' covers head_dim 128, got {cache.head_dim}"
    return None


def default_config(
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    operands: str = "bf16",
    heads_per_kv: int = 4,
    reconstruct: bool = False,
):
    """The launch config ``decode`` takes without one: by the bit widths, the launch's tiles and
    the query heads per KV head (configs.gluon_e4m3_config for E4M3 operands,
    configs.bf16_packs_heads for bf16 ones: packed heads for large launches, else by the key
    axis; the reconstruct ablation never packs: packed heads fold)."""
    if batch.fixed_split_history is not None:
        # a captured launch serves later steps of other lengths: the config of the history its
        # splits are planned for, whatever the capturing step held
        tiles = cache.num_kv_heads * batch.batch_size * math.ceil(
            batch.fixed_split_history / PAGE_SIZE
        )
    else:
        tiles = cache.num_kv_heads * sum(
            math.ceil(n / PAGE_SIZE) for n in batch.num_quantized_host
        )
    fmt = cache.layer_format(batch.layer)
    k, v = fmt.key, fmt.value
    if operands == "e4m3":
        return gluon_e4m3_config(k.bits, v.bits, tiles, heads_per_kv)
    if (
        cache.head_dim == 128  # packed heads: head_dim 128, the folds
        and not reconstruct
        and bf16_packs_heads(k.axis.value, v.axis.value, k.bits, v.bits, tiles, heads_per_kv)
    ):
        return gluon_packed_config(k.bits, v.bits)
    return gluon_decode_config(k.axis.value)


def _box_rows(page_size: int) -> int:
    """Rows of one TMA copy of words (twice as many fp32 of scales): a page, or a 64-token part
    of a larger one."""
    return min(page_size, PAGE_SIZE)


def tma_descriptors(cache: QuantizedKVCache, layer: int) -> tuple:
    """TMA descriptors of one layer's pools (k words, k scales, v words, v scales): words
    ``[pages, H, P, W]`` int32 (box ``[1, 1, R, W]``, W = head_dim * bits / 32, P the page
    size, R = min(P, 64): :func:`_box_rows`), scales viewed ``[pages, H, 2P]`` fp32 (box
    ``[1, 1, 2R]``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    st = cache.layers[layer]
    kern = kernel_module()
    fmt = cache.layer_format(layer)
    k_layout, v_layout, scales_layout = kern.descriptor_layouts(
        fmt.key.bits, fmt.value.bits, cache.head_dim
    )
    descs = []
    for words, scales, layout in (
        (st.k_words, st.k_scales, k_layout),
        (st.v_words, st.v_scales, v_layout),
    ):
        sv = scales.view(scales.shape[0], scales.shape[1], -1)
        rows = _box_rows(cache.page_size)
        box = [1, 1, rows, words.shape[-1]]
        descs.append(TensorDescriptor(words, list(words.shape), list(words.stride()), box, layout))
        descs.append(
            TensorDescriptor(sv, list(sv.shape), list(sv.stride()), [1, 1, 2 * rows], scales_layout)
        )
    return tuple(descs)


def config_warnings(fmt, cfg: GluonDecodeConfig) -> list[str]:
    """Why a launch of ``cfg`` over a cache of format ``fmt`` may not be repeatable (``decode``
    warns with each): configs whose outputs changed from call to call on the H200 or the H100."""
    k_channel = fmt.key.axis is GroupAxis.CHANNEL
    out = []
    if k_channel and cfg.ctas_per_sm > 1 and cfg.tile_pages == 1:
        out.append(
            f"channel-wise K with one-page tiles at {cfg.ctas_per_sm} CTAs per SM: its outputs "
            "changed from call to call (docs/tuning.md); configs.gluon_decode_config('channel') "
            "launches two-page tiles, which release their ring stage late"
        )
    if k_channel and fmt.value.axis is GroupAxis.CHANNEL and cfg.tile_pages == 1:
        out.append(
            "channel-wise K and V with one-page tiles: on the H200 its outputs changed from "
            "call to call even at 1 CTA per SM (5e-2 between calls at one split, "
            "docs/tuning.md); configs.gluon_decode_config('channel') launches two-page tiles"
        )
    return out


def _constexprs(
    cfg: GluonDecodeConfig,
    heads_per_kv: int,
    k_bits: int,
    v_bits: int,
    v_channel: bool,
    k_channel: bool,
    head_dim: int,
    page_size: int = PAGE_SIZE,
):
    """The kernel's compile-time arguments (one place for the launcher and compile_sm90)."""
    return dict(
        H=heads_per_kv,
        HS=MAX_HEADS_PER_KV,
        K_BITS=k_bits,
        V_BITS=v_bits,
        V_CHANNEL=v_channel,
        K_CHANNEL=k_channel,
        HD=head_dim,
        SPC=cfg.stages_per_consumer,
        TP=cfg.tile_pages,
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs,
        OPT=int(cfg.flags),
        PS=page_size,
    )


class GluonDecodePlan:
    """The Gluon kernel (+ the Triton window program) + the merge over one DecodeBatch (its
    layer), for queries of ``num_q_heads`` heads at ``sm_scale``.

    ``config`` and ``splits`` fix the launch config and the split count (default: chosen at
    each :meth:`run` from the batch's lengths, :func:`default_config` and
    :func:`foscar.configs.gluon_num_splits`);
    ``reconstruct``: the per-value reconstruction ablation; ``operands``: "bf16" or "e4m3"
    (:data:`OPERANDS`; the latter needs :func:`supports_e4m3` and one-page tiles, or two-page
    ones with packed heads). A config with packed heads (GluonFlag.PACKED_HEADS) is refused,
    before any launch, where it does not apply. The split workspace of the batch's current
    lengths is allocated here; the TMA descriptors at the first launch.
    """

    def __init__(
        self,
        cache: QuantizedKVCache,
        batch: DecodeBatch,
        num_q_heads: int,
        sm_scale: float,
        *,
        config: GluonDecodeConfig | None = None,
        splits: int | None = None,
        reconstruct: bool = False,
        operands: str = "bf16",
    ) -> None:
        if operands not in OPERANDS:
            raise ValueError(f"operands must be one of {OPERANDS}, got {operands!r}")
        self.cache = cache
        self.batch = batch
        self.num_q_heads = num_q_heads
        self.sm_scale = sm_scale
        self.config = config
        self.splits = splits
        self.reconstruct = reconstruct
        self.operands = operands
        self.workspace = combine.SplitWorkspace(cache.device)
        #: the runs' bound launches (Note [bound launches] in foscar.triton_runtime)
        self.bound: dict = {}
        self._descriptors: dict = {}  # the pools' addresses -> their TMA descriptors
        if cache.device.type == "cuda":  # (off CUDA the split count waits for the config)
            self.workspace.partials(self._partials_shape(*self._launch_shape()))

    def _launch_shape(self) -> tuple[GluonDecodeConfig, int | None]:
        """The config and split count of the batch's current lengths (splits: None off CUDA,
        resolved after the config's checks)."""
        cache, batch = self.cache, self.batch
        heads_per_kv = self.num_q_heads // cache.num_kv_heads
        cfg = self.config or default_config(
            cache, batch, self.operands, heads_per_kv, self.reconstruct
        )
        splits = self.splits
        if splits is None and cache.device.type == "cuda":
            sms = combine.num_sms(cache.device.index or 0)
            splits = gluon_num_splits(
                batch.batch_size, cache.num_kv_heads, batch.split_history, cfg, sms
            )
        return cfg, splits

    def _partials_shape(self, cfg, splits: int) -> tuple[int, int, int, int]:
        fmt = self.cache.layer_format(self.batch.layer)
        parts = splits + int(combine.has_window_program(fmt))
        return (self.batch.batch_size, self.num_q_heads, parts, self.cache.head_dim)

    def descriptors(self) -> tuple:
        """The TMA descriptors of the layer's pools (:func:`tma_descriptors`), built once."""
        st = self.cache.layers[self.batch.layer]
        key = tuple(t.data_ptr() for t in (st.k_words, st.k_scales, st.v_words, st.v_scales))
        if key not in self._descriptors:
            self._descriptors[key] = tma_descriptors(self.cache, self.batch.layer)
        return self._descriptors[key]

    def run(
        self,
        q: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Attention of ``q: [B, Hq, D]`` bfloat16 (checked by the caller) over the batch;
        returns ``out`` (and ``lse``).

        The launches are bound once per config and split count (Note [bound launches] in
        foscar.triton_runtime): a later call with the same config and split count, and a query
        and outputs of the same shapes, strides and alignment, skips the validation, the
        argument building and triton's JIT."""
        cfg, splits = self._launch_shape()
        for message in config_warnings(self.cache.layer_format(self.batch.layer), cfg):
            warnings.warn(message, RuntimeWarning, stacklevel=2)  # at every call
        out, lse = combine.outputs(q, out, lse, return_lse)
        key = (cfg, splits, return_lse, *combine.bound_key(self.cache, self.batch))
        with triton_runtime.on_device(q.device):  # a cache on cuda:1 while cuda:0 is current
            triton_runtime.bound_call(
                self.bound,
                key,
                {"q": q, "out": out, "lse": lse},
                lambda: self._launch(q, out, lse, return_lse, cfg, splits),
            )
        return (out, lse) if return_lse else out

    def _resolve(self, cfg: GluonDecodeConfig) -> GluonDecodeConfig:
        """``cfg`` checked against the operands, the format and the query heads, with the flags
        of the plan's operands and reconstruction set; raises ``ValueError`` before any launch."""
        cache, reconstruct = self.cache, self.reconstruct
        heads_per_kv = self.num_q_heads // cache.num_kv_heads
        fmt = cache.layer_format(self.batch.layer)
        d = cache.head_dim
        if self.operands == "e4m3":
            reason = supports_e4m3(cache)
            if reason:
                raise ValueError(reason)
            packed = bool(cfg.flags & GluonFlag.PACKED_HEADS)
            folds = not (reconstruct or cfg.flags & GluonFlag.RECONSTRUCT)
            if not folds or cfg.tile_pages != (2 if packed else 1):
                raise ValueError(
                    "operands='e4m3' runs one-page tiles (two-page ones with packed heads, "
                    "GluonFlag.PACKED_HEADS) and the folds (GluonFlag.RECONSTRUCT clear); got "
                    f"tile_pages={cfg.tile_pages}, reconstruct={reconstruct}, flags={cfg.flags!r}"
                )
            cfg = dataclasses.replace(cfg, flags=cfg.flags | GluonFlag.E4M3)
        if cfg.flags & GluonFlag.PACKED_HEADS:
            if heads_per_kv > MAX_HEADS_PER_KV // 2:
                raise ValueError(
                    f"packed heads (GluonFlag.PACKED_HEADS) hold at most "
                    f"{MAX_HEADS_PER_KV // 2} query heads per KV head; q has {heads_per_kv}"
                )
            if GroupAxis.CHANNEL in (fmt.key.axis, fmt.value.axis) or reconstruct or d != 128:
                raise ValueError(
                    f"packed heads (GluonFlag.PACKED_HEADS) cover token-wise K and V at "
                    f"head_dim 128 with the folds; got {fmt.key.short()} / "
                    f"{fmt.value.short()}, head_dim {d}, reconstruct={reconstruct}"
                )
            if cfg.tile_pages != 2 or not cfg.flags & GluonFlag.Q_IN_CONSUMERS:
                raise ValueError(
                    "packed heads take two-page tiles with Q staged by each consumer "
                    f"(GluonFlag.Q_IN_CONSUMERS); got tile_pages={cfg.tile_pages}, "
                    f"flags={cfg.flags!r}"
                )
        if reconstruct:  # the ablation: per-value s' y + z' instead of the folds
            cfg = dataclasses.replace(cfg, flags=cfg.flags | GluonFlag.RECONSTRUCT)
        return cfg

    def _launch(self, q, out, lse, return_lse, cfg, splits) -> None:
        """The checks and launches of ``cfg`` (the config, resolved), into ``out`` (and
        ``lse``)."""
        kern = kernel_module()
        cache, batch, sm_scale = self.cache, self.batch, self.sm_scale
        bsz, num_q_heads, d = q.shape
        heads_per_kv = num_q_heads // cache.num_kv_heads
        fmt = cache.layer_format(batch.layer)
        cfg = self._resolve(cfg)
        if splits is None:
            sms = combine.num_sms(q.device.index or 0)
            splits = gluon_num_splits(bsz, cache.num_kv_heads, batch.split_history, cfg, sms)
        has_windows = combine.has_window_program(fmt)
        o_part, lse_part = self.workspace.partials(self._partials_shape(cfg, splits))
        parts = o_part.shape[2]
        lse_out = lse if return_lse else lse_part  # (parts == 1: the kernel writes out and lse)
        kw, ks, vw, vs = self.descriptors()
        consts = _constexprs(
            cfg,
            heads_per_kv,
            fmt.key.bits,
            fmt.value.bits,
            fmt.value.axis is GroupAxis.CHANNEL,
            fmt.key.axis is GroupAxis.CHANNEL,
            d,
            cache.page_size,
        )
        triton_runtime.launch(
            kern.gluon_decode_split_kernel,
            (bsz, cache.num_kv_heads, splits),
            q_ptr=q,
            kw_desc=kw,
            ks_desc=ks,
            vw_desc=vw,
            vs_desc=vs,
            kv_indptr_ptr=batch.kv_indptr,
            kv_indices_ptr=batch.kv_indices,
            num_quantized_ptr=batch.num_quantized,
            o_part_ptr=o_part,
            lse_part_ptr=lse_part,
            qk_scale=sm_scale * combine.LOG2E,
            magic=kern.MAGIC,
            num_splits=splits,
            stride_q_b=q.stride(0),
            stride_q_h=q.stride(1),
            **combine.partial_strides(o_part, lse_part),
            out_ptr=out,
            lse_out_ptr=lse_out,
            num_parts=parts,
            write_lse=int(return_lse),
            stride_o_b=out.stride(0),
            stride_o_h=out.stride(1),
            stride_lo_b=lse_out.stride(0),
            stride_lo_h=lse_out.stride(1),
            **consts,
            num_warps=4,
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        )
        if parts > 1:
            if has_windows:
                window_partial(
                    q, cache, batch, sm_scale, o_part[:, :, splits:], lse_part[:, :, splits:]
                )
            # GluonFlag.MERGE_PDL: the merge's launch overlaps the split kernel's tail (a
            # programmatic dependent launch; the split CTAs signal after storing their
            # partials). Not with BF16 windows: the window program runs in between
            combine.merge_partials(
                o_part,
                lse_part,
                out,
                lse if return_lse else None,
                pdl=bool(cfg.flags & GluonFlag.MERGE_PDL) and not has_windows,
            )


def decode(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    config: GluonDecodeConfig | None = None,
    splits: int | None = None,
    reconstruct: bool = False,
    operands: str = "bf16",
):
    """One call of a fresh :class:`GluonDecodePlan` (a plan made for it, used once): returns
    ``out`` (and ``lse``)."""
    plan = GluonDecodePlan(
        cache, batch, q.shape[1], sm_scale, config=config, splits=splits,
        reconstruct=reconstruct, operands=operands,
    )
    return plan.run(q, out=out, lse=lse, return_lse=return_lse)


def compile_sm90(
    cfg: GluonDecodeConfig | None = None,
    heads_per_kv: int = 4,
    k_bits: int = 2,
    v_bits: int = 2,
    v_channel: bool = False,
    k_channel: bool = False,
    head_dim: int = 128,
    page_size: int = PAGE_SIZE,
):
    """Compile the kernel for sm_90a without a GPU (tests, SASS counts): a CompiledKernel whose
    ``asm`` holds ttgir/ptx/cubin. The layout proofs of the operand programs
    (``convert_layout(..., assert_trivial=True)``) run here, so this fails if the bit operations
    stop landing in the wgmma fragments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kern = kernel_module()
    cfg = cfg or gluon_decode_config("channel" if k_channel else "token")
    k_layout, v_layout, scales_layout = kern.descriptor_layouts(k_bits, v_bits, head_dim)

    def desc(dtype, block, layout):
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"

    rows = _box_rows(page_size)
    k_box = [1, 1, rows, kern.words_per_row(k_bits, head_dim)]
    v_box = [1, 1, rows, kern.words_per_row(v_bits, head_dim)]
    scales_box = [1, 1, 2 * rows]
    sig = {
        "q_ptr": "*bf16",
        "kw_desc": desc("i32", k_box, k_layout),
        "ks_desc": desc("fp32", scales_box, scales_layout),
        "vw_desc": desc("i32", v_box, v_layout),
        "vs_desc": desc("fp32", scales_box, scales_layout),
        "kv_indptr_ptr": "*i32",
        "kv_indices_ptr": "*i32",
        "num_quantized_ptr": "*i32",
        "o_part_ptr": "*fp32",
        "lse_part_ptr": "*fp32",
        "qk_scale": "fp32",
        "magic": "i32",
        "out_ptr": "*bf16",
        "lse_out_ptr": "*fp32",
    }
    consts = _constexprs(
        cfg, heads_per_kv, k_bits, v_bits, v_channel, k_channel, head_dim, page_size
    )
    fn = kern.gluon_decode_split_kernel
    full = {n: sig.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    src = GluonASTSource(fn, full, constexprs=consts, attrs={})
    opts = {"num_warps": 4, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
