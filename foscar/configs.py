"""Launch configurations of the decode kernels, the measured tables, and the heuristics that pick
them: one place for every knob of foscar.kernels.

Knobs live in frozen dataclasses (:class:`TritonDecodeConfig`, :class:`GluonDecodeConfig`; the
Gluon kernel's compile-time switches are the named flags :class:`GluonFlag`); the functions
below own the heuristics, each beside the measurements it follows. Every number was measured on
the H200 (docs/tuning.md gives each knob's command, the gain, and what was tried and did not
pay).

TUNING of the Triton kernel (the measurements: docs/tuning.md, "Triton kernel"):
    num_stages=3 beats 1 (cp.async prefetch of the next tiles); 8 warps lose.
    64-token tiles capped at 128 registers (4 CTAs/SM, some spills) beat 128-token tiles at 255
        registers (2 CTAs/SM) at every point measured, B=1 included once the split count fills
        the 4 slots.
    the split count that fills the resident slots exactly once wins; one CTA more than the
        slots costs a second wave.
    channel-wise K at 64 tokens capped at 168 registers (3 CTAs/SM, no spills) instead of 128
        (4 CTAs/SM, spills): chosen from the static SASS (register counts), not timed apart.
    block_n=64 uncapped when a product needs more than 16 columns, and for the reconstruct
        baseline, which spills at block_n=128; block_n=32 for token-wise K with 4+ groups per
        row (larger tiles fault on the H200).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

__all__ = [
    "TritonDecodeConfig",
    "triton_decode_config",
    "triton_num_splits",
    "column_widths",
    "GluonFlag",
    "GLUON_DEFAULT_FLAGS",
    "GluonDecodeConfig",
    "gluon_decode_config",
    "gluon_packed_config",
    "gluon_e4m3_config",
    "gluon_num_splits",
    "bf16_packs_heads",
    "GLUON_OVER_TRITON_US",
    "gluon_min_ctas",
    "auto_takes_gluon",
]


@dataclass(frozen=True)
class TritonDecodeConfig:
    block_n: int = 128  # tokens per tile of the quantized history
    num_warps: int = 4  # one warpgroup: tokens are the wgmma M dimension
    num_stages: int = 3  # cp.async stages: the next tiles' words load while this one computes
    # tokens per tile of the BF16 sink/tail: at 64 its pipelined tiles took 96 KB of shared
    # memory (2 CTAs/SM for every format with a tail); 32 takes 46 KB in all
    block_window: int = 32
    maxnreg: int | None = None  # register cap per thread (more CTAs per SM, maybe spills)
    tile_acc: bool = True  # token-wise V: fresh PV accumulator per tile (triton_decode Note)
    min_tiles_per_split: int = 2
    # CTAs of this config resident per SM (ptxas registers: 254 -> 2, ~160 -> 3, capped at
    # 128 -> 4, as ptxas reports them for sm_90a): the split count fills them
    ctas_per_sm: int = 2


def column_widths(fmt, head_dim: int, heads_per_kv: int, block_n: int, reconstruct: bool):
    """``(HS, HPK, HPV)``: padded heads and the column counts of the QK and PV products.

    A product's columns are (block, head) pairs: channel groups for token-wise folds, token
    groups of a tile for channel-wise ones; at least 16 (the smallest wgmma N Triton uses).
    """
    hs = max(8, 1 << (heads_per_kv - 1).bit_length())

    def width(blocks: int) -> int:
        return max(16, blocks * hs)

    if reconstruct:
        return hs, width(1), width(1)

    def blocks(f) -> int:
        if f.axis.value == "token":
            return head_dim // f.group_size
        return max(1, block_n // f.group_size)

    return hs, width(blocks(fmt.key)), width(blocks(fmt.value))


def triton_decode_config(
    fmt, head_dim: int, heads_per_kv: int, reconstruct: bool = False, ctas: int = 1
) -> TritonDecodeConfig:
    """The launch config for a format; ``ctas`` (sequences x KV heads) is kept for callers and
    future tuning: one config measured best from 8 to 512 of them."""
    hs, hpk, hpv = column_widths(fmt, head_dim, heads_per_kv, 128, reconstruct=False)
    if not reconstruct and fmt.key.axis.value == "token" and head_dim // fmt.key.group_size >= 4:
        # 4+ channel groups per K row: at 64 tokens and up the fold spills ~4.5 KB per thread
        # and the kernel faults on the H200 ("out-of-range shared or local address" in the PV
        # product); 32-token tiles (mma.sync) run correctly
        return TritonDecodeConfig(block_n=32)
    token_k_groups = head_dim // fmt.key.group_size if fmt.key.axis.value == "token" else 0
    if not reconstruct and token_k_groups >= 2 and hs > 8:
        # 2 channel groups per K row at 16 query columns (GQA 9-16): 64-token tiles spilled
        # 2.7 KB per thread, 32-token ones 0.4 KB (sm_90a, head_dim 64, K g = 32;
        # benchmarks/tools/sass_count.py --config --group 32 --head-dim 64 --ratio 16)
        return TritonDecodeConfig(block_n=32)
    if not reconstruct and fmt.key.axis.value == "channel":
        # channel-wise K: the Q fold needs ~168 registers at 64 tokens (g >= 64);
        # under the 128 cap it spilled 96-128 B per thread. 168 is the most that keeps 3 CTAs
        # per SM (65536 / (3 * 128) = 170.7, allocated in steps of 8). With g = 32 (two groups
        # per tile) it needs 186-255 registers: 2 CTAs per SM, uncapped.
        if fmt.key.group_size >= 64:
            return TritonDecodeConfig(block_n=64, maxnreg=168, ctas_per_sm=3)
        return TritonDecodeConfig(block_n=64, ctas_per_sm=2)
    if reconstruct:
        # 157-255 registers (sm_90a, D = 128, 4 heads per KV head): 2 CTAs per SM for all but
        # KcVc; the split count assumed 3, which ran the baseline in 1.5 waves
        return TritonDecodeConfig(block_n=64, ctas_per_sm=2)
    if hpk > 16 or hpv > 16:
        # token-wise V with 4+ groups per row (K tok g=128 / V tok g=32: 197-199 registers,
        # K tok g=64 / V tok g=32: 255 and spills) fit 2 CTAs per SM; the others ~140: 3
        ctas = 2 if (fmt.value.axis.value == "token" and hpv > 16) else 3
        return TritonDecodeConfig(block_n=64, ctas_per_sm=ctas)
    return TritonDecodeConfig(block_n=64, maxnreg=128, ctas_per_sm=4)


def triton_num_splits(
    batch: int, num_kv_heads: int, max_tokens: int, cfg: TritonDecodeConfig, num_sms: int
) -> int:
    """The Triton kernel's splits per (sequence, KV head): as many as fill every resident CTA
    slot once.

    Rounded down: a split count whose CTAs exceed the slots by one runs a second wave as long
    as the first (docs/tuning.md, Triton kernel, row "split count rounded down"). At least
    ``cfg.min_tiles_per_split`` tiles per split.
    """
    tiles = math.ceil(max_tokens / cfg.block_n)
    if tiles == 0:
        return 1
    ctas = batch * num_kv_heads
    wanted = (cfg.ctas_per_sm * num_sms) // ctas
    return max(1, min(wanted, tiles // cfg.min_tiles_per_split, tiles))


# ------------------------------------------------------------------------------ Gluon (sm_90)
class GluonFlag(enum.IntFlag):
    """Compile-time switches of the Gluon kernel (foscar.kernels.gluon): a config's ``flags``,
    passed to the kernel as the int of its ``OPT`` constexpr (the values are the kernel's bit
    numbers). Which configs set each; what each gained on the H200 is its row in
    docs/tuning.md, "Gluon kernel":

    ``FAST_MAX``
        The tile's max over its 64 token rows by per-warp shuffles and one exchange of the four
        warp maxima through shared memory (one barrier) instead of ``gl.max``'s reduction.
        Every shipped config.
    ``FAST_RCP``
        Token-wise V's offset ratio z'/s' by ``rcp.approx`` and a multiply instead of a
        division (channel-wise K's z'/s' always divides). Every shipped config.
    ``RECONSTRUCT``
        The reconstruct ablation (backend ``"gluon-reconstruct"``): ``s' y + z'`` on every K and
        V operand value in registers, P unscaled, no folds. Set by the launcher for that
        backend only; it measures what folding gains (docs/tuning.md, "Where the shipped
        kernels stand").
    ``SCALED_INT2``
        The scaled extraction of INT2 operands at head_dim 128: 2 shifts per 8 K pairs instead
        of 7, 1 per 4 V pairs instead of 3, a field landing at mantissa bit 2 (f % 3) so its
        operand is 128 + 4^(f % 3) q; Q, the offsets and the output fold the powers of 4 back,
        exactly (row "scaled extraction"). Every shipped config (INT4 and head_dim 64 ignore it).
    ``E4M3``
        E4M3 operands for FP8 wgmma instead of bf16 mantissa injection (token-wise K and V at
        head_dim 128; Q and P' rounded to per-head scaled E4M3, about 20x bf16's error). Set by
        the launcher for ``operands="e4m3"`` (backend ``"gluon-e4m3"``).
    ``Q_IN_CONSUMERS``
        Each consumer stages Q into its own buffer after the partitions start, instead of the
        prologue, so the producer's first copies do not wait for Q's load (row "Q staged by
        each consumer"). Every shipped config; packed heads require it.
    ``MERGE_PDL``
        The split merge as a programmatic dependent launch that the split CTAs signal after
        storing their partials (row "merge as a programmatic dependent launch, signalled
        after the partials"). Every shipped config; the launcher
        launches without PDL when BF16 windows put the window program in between.
    ``PACKED_HEADS``
        Two-page tiles with both pages' scores in one [64, 8] tile when a KV head serves at most
        4 query heads (the wgmma's N = 8 columns are otherwise half padding): the softmax side
        runs once per 128 tokens. Token-wise K and V at head_dim 128, bf16 or E4M3 operands;
        :func:`gluon_packed_config`, taken from :data:`BF16_PACKED_MIN_TILES` /
        :data:`E4M3_PACKED_MIN_TILES` on.
    """

    FAST_MAX = 1
    FAST_RCP = 4
    RECONSTRUCT = 128
    SCALED_INT2 = 512
    E4M3 = 1024
    Q_IN_CONSUMERS = 2048
    MERGE_PDL = 8192
    PACKED_HEADS = 262144


#: the flags of every shipped config (the launcher and the factories below add E4M3,
#: RECONSTRUCT and PACKED_HEADS where they apply)
GLUON_DEFAULT_FLAGS = (
    GluonFlag.FAST_MAX
    | GluonFlag.FAST_RCP
    | GluonFlag.SCALED_INT2
    | GluonFlag.Q_IN_CONSUMERS
    | GluonFlag.MERGE_PDL
)
_GLUON_ALL_FLAGS = int(sum(GluonFlag))


@dataclass(frozen=True)
class GluonDecodeConfig:
    """Launch knobs of foscar.kernels.gluon (12 warps per CTA: 2 consumer warpgroups and a
    producer warp padded to a warpgroup).

    Default: 2 CTAs per SM (``maxnreg=80`` at launch, consumers raised to 112 registers, the
    producer lowered to 24; no spills) with 4 ring stages per consumer. Measured on the H200
    (docs/tuning.md, Gluon kernel, rows "2 CTAs per SM" and "ring depth"): 2 CTAs/SM beat 1
    (232 registers) at every point; 4 stages per consumer equal 2 except at B=1 L=128K.
    ``flags``: :class:`GluonFlag` (an int is taken as its bits; unknown bits are refused).
    """

    stages_per_consumer: int = 4
    consumer_regs: int = 112
    producer_regs: int = 24
    maxnreg: int | None = 80
    ctas_per_sm: int = 2
    flags: GluonFlag = GLUON_DEFAULT_FLAGS
    tile_pages: int = 1  # pages per tile and stage: 1, or 2 (a channel-wise group; packed heads)

    def __post_init__(self):
        flags = int(self.flags)
        if flags & ~_GLUON_ALL_FLAGS:
            raise ValueError(
                f"flags must be a combination of GluonFlag {[f.name for f in GluonFlag]}; got "
                f"{flags} (unknown bits {flags & ~_GLUON_ALL_FLAGS})"
            )
        object.__setattr__(self, "flags", GluonFlag(flags))


def gluon_decode_config(
    key_axis: str = "token", tile_pages: int | None = None
) -> GluonDecodeConfig:
    """The Gluon kernel's launch config: 2 CTAs per SM (:class:`GluonDecodeConfig`'s default).

    ``tile_pages``: pages per tile and ring stage. 2: one stage wait and release, one cross-warp
    max exchange and one P' barrier per 128 tokens, and a channel-wise group (2 pages) is one
    tile, so channel-wise K folds Q once per group instead of once per page in each consumer;
    2 stages per consumer (8 pages in flight per CTA as with one-page tiles; INT4's 18 KiB
    stages still fit 2 CTAs per SM). Default (``None``): what the H200 measured faster: 2 for
    channel-wise K, 1 for token-wise K (docs/tuning.md, Gluon kernel, rows "two-page tiles").

    Channel-wise K runs at 2 CTAs per SM since two-page tiles release their ring stage after
    the tile's last product (Note [late stage release] in foscar.kernels.gluon.tiles): every
    call is identical (``bash benchmarks/run_device.sh repeat``). One-page tiles keep the early
    release, and their outputs change from call to call there, so channel-wise K with one-page
    tiles at 2 CTAs per SM is warned of (:func:`config_warnings` in foscar.backends.gluon)."""
    if tile_pages is None:
        tile_pages = 2 if key_axis == "channel" else 1
    if tile_pages not in (1, 2):
        raise ValueError(f"tile_pages must be 1 or 2, got {tile_pages!r}")
    cfg = GluonDecodeConfig()
    if tile_pages == 2:
        cfg = dataclasses.replace(cfg, tile_pages=2, stages_per_consumer=2)
    return cfg


#: E4M3 operands (backend "gluon-e4m3") need half the operand registers, so INT2 K and V fit 3
#: CTAs per SM (56 registers at launch, consumers 72, the producer 24; the tile loops keep their
#: instructions without local memory). Measured on the H200, 3 against 2 CTAs per SM: faster
#: from 32K tiles per launch (KV heads x 64-token pages) on, even at 16K, slower below. INT4
#: stays at 2: three rings of 3 stages starve it (docs/tuning.md, Gluon kernel, row "E4M3 at 3
#: CTAs per SM").
E4M3_THREE_CTAS_MIN_TILES = 32768


def gluon_packed_config(k_bits: int, v_bits: int) -> GluonDecodeConfig:
    """Packed heads (:attr:`GluonFlag.PACKED_HEADS`; token-wise K and V, bf16 or, with the E4M3
    flag the launcher adds, E4M3 operands): two-page tiles (2 stages of 2 pages per consumer,
    the bytes in flight of the one-page ring), 2 CTAs per SM (at 72 registers the E4M3
    consumers spill; at 112 none)."""
    cfg = gluon_decode_config("token", tile_pages=2)
    return dataclasses.replace(cfg, flags=cfg.flags | GluonFlag.PACKED_HEADS)


#: From how many tiles (64-token pages x KV heads per launch) the E4M3 path takes packed heads
#: when a KV head serves at most 4 query heads, by the wider of the K and V bit widths. Measured
#: on the H200 beside the one-page configs (8 KV heads; docs/tuning.md, Gluon kernel, row
#: "packed heads, E4M3"): INT2 packed faster from 16K tiles on, equal at 8K, slower below;
#: INT4 faster from 4K tiles on, slower below. Mixed widths take the INT4 threshold (not
#: measured apart).
E4M3_PACKED_MIN_TILES = {2: 8192, 4: 4096}


#: From how many tiles (64-token pages x KV heads per launch) the bf16 operand path takes packed
#: heads, for INT2 K and V at head_dim 128 when a KV head serves at most 4 query heads (H200):
#: faster from 8K tiles on, equal at 4K, slower below; INT4 was slower packed at most points,
#: so it keeps one page per tile (docs/tuning.md, Gluon kernel, row "packed heads, bf16
#: operands").
BF16_PACKED_MIN_TILES = 8192


def bf16_packs_heads(
    key_axis: str, value_axis: str, k_bits: int, v_bits: int, tiles: int, heads_per_kv: int
) -> bool:
    """Whether the bf16 operand path launches :func:`gluon_packed_config`: INT2 token-wise K and
    V from :data:`BF16_PACKED_MIN_TILES` on when ``heads_per_kv`` <= 4 (the caller checks
    head_dim 128 and the folds); else it takes :func:`gluon_decode_config` by the key axis."""
    return (
        key_axis == value_axis == "token"
        and k_bits == v_bits == 2
        and heads_per_kv <= 4
        and tiles >= BF16_PACKED_MIN_TILES
    )


def gluon_e4m3_config(
    k_bits: int, v_bits: int, tiles: int, heads_per_kv: int = 4
) -> GluonDecodeConfig:
    """The E4M3 operand path's launch config (token-wise K and V) for a launch of ``tiles``
    64-token pages over all sequences and KV heads: packed heads (:func:`gluon_packed_config`)
    from :data:`E4M3_PACKED_MIN_TILES` on when ``heads_per_kv`` <= 4, else 3 CTAs per SM for INT2
    K and V from :data:`E4M3_THREE_CTAS_MIN_TILES` on, else ``gluon_decode_config("token")``. The
    launcher adds :attr:`GluonFlag.E4M3`."""
    if heads_per_kv <= 4 and tiles >= E4M3_PACKED_MIN_TILES[max(k_bits, v_bits)]:
        return gluon_packed_config(k_bits, v_bits)
    cfg = gluon_decode_config("token")
    if k_bits == v_bits == 2 and tiles >= E4M3_THREE_CTAS_MIN_TILES:
        return dataclasses.replace(
            cfg, maxnreg=56, consumer_regs=72, producer_regs=24, ctas_per_sm=3
        )
    return cfg


#: tokens per tile page of the Gluon kernel (one TMA ring unit; foscar.backends.gluon.PAGE_SIZE)
GLUON_TILE_PAGE_TOKENS = 64


def gluon_num_splits(
    batch: int, num_kv_heads: int, max_tokens: int, cfg: GluonDecodeConfig, num_sms: int
) -> int:
    """The Gluon kernel's splits per (sequence, KV head): the resident CTA slots
    (``cfg.ctas_per_sm`` per SM) filled once, rounded down, at least a tile for each of the two
    consumers per split. Rounded up, the extra CTAs run a second wave (docs/tuning.md, Gluon
    kernel, row "split count rounded down")."""
    tiles = math.ceil(max_tokens / (GLUON_TILE_PAGE_TOKENS * cfg.tile_pages))
    wanted = (cfg.ctas_per_sm * num_sms) // (batch * num_kv_heads)
    return max(1, min(wanted, max(1, tiles // 2)))


#: Where ``backend="auto"`` takes the Gluon kernel over the Triton one, from the H200 grids
#: (docs/tuning.md; H_Q=32, H_KV=8, microseconds as (Triton, Gluon), each with its default
#: config). :func:`gluon_min_ctas` reads the rule off this table: token-wise K with
#: token- or channel-wise V, head_dim 128 or 64: Gluon won every point measured, so auto always
#: takes it; channel-wise K (two-page tiles): Gluon won every point from 64
#: sequences x KV heads on (B = 8), Triton below. A shape (axis pair, head_dim, bit widths)
#: without rows is not taken by auto.
GLUON_OVER_TRITON_US = {
    # (bits, k_axis, v_axis, head_dim, batch, kv_len): (triton, gluon)
    # token-wise K and V (a subset of the 13 points of the grid)
    (2, "token", "token", 128, 1, 8192): (14.7, 13.6),
    (2, "token", "token", 128, 1, 131072): (73.3, 47.6),
    (2, "token", "token", 128, 8, 131072): (493.7, 304.9),
    (2, "token", "token", 128, 64, 131072): (3804.8, 2246.7),
    (4, "token", "token", 128, 1, 8192): (16.0, 13.9),
    (4, "token", "token", 128, 64, 131072): (4466.9, 2342.6),
    # token-wise K, channel-wise V (the axes grid)
    (2, "token", "channel", 128, 1, 32768): (28.3, 26.5),
    (2, "token", "channel", 128, 1, 131072): (80.2, 55.9),
    (2, "token", "channel", 128, 8, 32768): (148.4, 128.3),
    (2, "token", "channel", 128, 8, 131072): (555.3, 331.0),
    (4, "token", "channel", 128, 1, 32768): (31.5, 27.9),
    (4, "token", "channel", 128, 1, 131072): (90.0, 57.3),
    (4, "token", "channel", 128, 8, 32768): (168.2, 100.0),
    (4, "token", "channel", 128, 8, 131072): (623.2, 332.4),
    # channel-wise K (1 CTA/SM, two-page tiles): Gluon won every B=8 point, Triton most B=1
    # points (three B=1 Gluon points were far above their neighbours). Measured before channel-wise
    # K ran at 2 CTAs per SM; at 2, on an H100 (benchmarks/results/decode_axes_h100.md), Gluon
    # won all 16 channel-wise K points, but the H200 has not measured it, so the rule stays
    (2, "channel", "token", 128, 1, 32768): (32.6, 34.0),
    (2, "channel", "token", 128, 1, 131072): (87.3, 109.4),
    (2, "channel", "token", 128, 8, 32768): (166.0, 163.4),
    (2, "channel", "token", 128, 8, 131072): (624.9, 600.4),
    (4, "channel", "token", 128, 1, 32768): (36.7, 188.9),
    (4, "channel", "token", 128, 1, 131072): (100.5, 101.6),
    (4, "channel", "token", 128, 8, 32768): (191.5, 167.1),
    (4, "channel", "token", 128, 8, 131072): (720.5, 612.8),
    (2, "channel", "channel", 128, 1, 32768): (35.8, 33.1),
    (2, "channel", "channel", 128, 1, 131072): (98.0, 167.2),
    (2, "channel", "channel", 128, 8, 32768): (187.2, 159.5),
    (2, "channel", "channel", 128, 8, 131072): (705.6, 588.1),
    (4, "channel", "channel", 128, 1, 32768): (40.1, 224.8),
    (4, "channel", "channel", 128, 1, 131072): (113.9, 88.0),
    (4, "channel", "channel", 128, 8, 32768): (217.7, 161.3),
    (4, "channel", "channel", 128, 8, 131072): (820.0, 585.5),
    # head_dim 64 (g = 64)
    (2, "token", "token", 64, 1, 8192): (13.3, 12.4),
    (2, "token", "token", 64, 1, 32768): (22.7, 17.5),
    (2, "token", "token", 64, 1, 131072): (60.9, 38.1),
    (2, "token", "token", 64, 1, 524288): (205.1, 119.7),
    (2, "token", "token", 64, 8, 8192): (35.4, 24.2),
    (2, "token", "token", 64, 8, 32768): (110.7, 65.6),
    (2, "token", "token", 64, 8, 131072): (405.1, 232.4),
    (2, "token", "token", 64, 8, 524288): (1580.6, 877.5),
    (2, "token", "token", 64, 64, 8192): (210.9, 121.7),
    (2, "token", "token", 64, 64, 131072): (3162.3, 1674.9),
    (4, "token", "token", 64, 1, 8192): (13.9, 12.4),
    (4, "token", "token", 64, 1, 32768): (24.3, 17.7),
    (4, "token", "token", 64, 1, 131072): (65.4, 37.5),
    (4, "token", "token", 64, 1, 524288): (222.9, 115.7),
    (4, "token", "token", 64, 8, 8192): (37.9, 23.8),
    (4, "token", "token", 64, 8, 32768): (118.9, 63.7),
    (4, "token", "token", 64, 8, 131072): (440.0, 223.5),
    (4, "token", "token", 64, 8, 524288): (1717.8, 833.6),
    (4, "token", "token", 64, 64, 8192): (228.3, 119.6),
    (4, "token", "token", 64, 64, 131072): (3445.5, 1617.9),
}
GLUON_GRID_KV_HEADS = 8  # H_KV of every row above: a row's CTAs are batch x 8

#: Page sizes other than 64 (the rows above are all at 64), token-wise K and V at head_dim 128:
#: (bits, page_size, batch, kv_len): (triton_us, gluon_us), H_Q=32, H_KV=8, each kernel's
#: default config. ``auto`` takes Gluon at such a page size only where every row of it (of the
#: format's bit widths) was measured faster. Two points per page size, bf16 operands, and the
#: packed-heads and split rules measured at page 64: a thin basis, enough to show Gluon ahead
#: of Triton at both (pages of 128 and 256 were timed too, but gluon.supports
#: leaves them to Triton: only 128 at INT2 ran its GPU cases).
GLUON_OVER_TRITON_PAGE_US: dict[tuple[int, int, int, int], tuple[float, float]] = {
    # the quick grid at each page size
    (2, 16, 1, 32768): (27.1, 21.6),
    (2, 16, 64, 16384): (505.1, 321.5),
    (4, 16, 1, 32768): (31.3, 21.4),
    (4, 16, 64, 16384): (601.6, 366.9),
    (2, 32, 1, 32768): (26.9, 20.6),
    (2, 32, 64, 16384): (495.5, 272.3),
    (4, 32, 1, 32768): (31.0, 20.7),
    (4, 32, 64, 16384): (608.1, 318.7),
}


def gluon_min_ctas(
    k_axis: str, v_axis: str, head_dim: int = 128, bits: tuple[int, ...] = (2, 4)
) -> int | None:
    """Sequences x KV heads from which ``auto`` takes Gluon for this axis pair and head_dim, over
    the table's rows of the given bit widths (a format's K and V widths: a mixed INT2/INT4
    format pools both): the smallest measured batch from which Gluon won every such point (0
    when it won them all), ``None`` where it never did or the shape was not measured."""
    rows = [
        (batch, triton_us > gluon_us)
        for (b, k, v, d, batch, _), (triton_us, gluon_us) in GLUON_OVER_TRITON_US.items()
        if (k, v, d) == (k_axis, v_axis, head_dim) and b in bits
    ]
    batches = sorted({b for b, _ in rows})
    for b in batches:
        if all(won for batch, won in rows if batch >= b):
            return 0 if b == batches[0] else b * GLUON_GRID_KV_HEADS
    return None


def auto_takes_gluon(
    k_axis: str,
    v_axis: str,
    head_dim: int,
    bits: tuple[int, ...],
    ctas: int,
    page_size: int = 64,
) -> bool:
    """Whether ``backend="auto"`` takes Gluon for a format it covers at ``ctas`` = sequences x KV
    heads (:func:`gluon_min_ctas`), and at a page size other than 64 only where
    :data:`GLUON_OVER_TRITON_PAGE_US` has rows of it and Gluon won them all."""
    if page_size != 64:
        rows = [
            triton_us > gluon_us
            for (b, ps, _, _), (triton_us, gluon_us) in GLUON_OVER_TRITON_PAGE_US.items()
            if ps == page_size and b in bits
        ]
        if not rows or not all(rows) or (k_axis, v_axis, head_dim) != ("token", "token", 128):
            return False
    min_ctas = gluon_min_ctas(k_axis, v_axis, head_dim, bits)
    return min_ctas is not None and ctas >= min_ctas
