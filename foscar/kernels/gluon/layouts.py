"""Constants, compile-time switches and layouts of the Gluon decode kernel (foscar.kernels.gluon).

Math: none here; the register and shared-memory layouts that make foscar's packed words land in
the wgmma fragments (``gl.DistributedLinearLayout``s proved trivial by ``convert_layout(...,
assert_trivial=True)`` in the operand programs), and the readers of the ``OPT`` constexpr.

Data contract: a tile unit is :data:`PAGE` = 64 tokens (whatever the cache's page size); a KV
head's query heads are padded to HS = 8 columns (the wgmma N); rows of ``words_per_row(bits,
head_dim)`` int32 words hold a token's codes in foscar.formats' channel order (roles "key" and
"value", ``kernel_bit_location``).

Supported: INT2/INT4 at head_dim 128 and 64; bf16 operands (k_width 2) and E4M3 ones (k_width
4). Not: other bit widths or head_dims, wgmma N other than 8 (``q_fold_layout`` holds 8 heads).
"""

from __future__ import annotations

import dataclasses

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...configs import GluonFlag

MAGIC = 0x43004300  # two bf16 128.0: the mantissa-injection base of both halves

D = 128
PAGE = 64
#: PAGE for the kernels' own code (a tile unit: 64 tokens, whatever the cache's page size)
UNIT = gl.constexpr(PAGE)


# ------------------------------------------------------------------------ compile-time config
@dataclasses.dataclass(frozen=True)
class TileConfig:
    """The kernel's compile-time configuration, one constexpr that every partition and tile
    program takes (``CFG``) and reads by field name."""

    SPC: int  # ring stages per consumer (2 x SPC in all)
    HS: int  # query heads per KV head, padded: the wgmma N
    K_BITS: int  # 2 or 4
    V_BITS: int
    V_CHANNEL: bool  # channel-wise V groups of 128 tokens (else token-wise, g = D)
    OPT: int  # int(GluonDecodeConfig.flags): foscar.configs.GluonFlag
    K_CHANNEL: bool  # channel-wise K groups of 128 tokens (else token-wise, g = D)
    HD: int  # head_dim
    TP: int  # pages per tile and stage: 1 or 2
    H: int  # query heads per KV head
    PS: int  # the cache's page size

    def __repr__(self):
        # the constexpr's part of the mangled names of the functions that take it: letters,
        # digits and underscores only
        return "TileConfig_" + "_".join(
            f"{f.name}{int(getattr(self, f.name))}" for f in dataclasses.fields(self)
        )


@gluon.constexpr_function
def tile_config(SPC, HS, K_BITS, V_BITS, V_CHANNEL, OPT, K_CHANNEL, HD, TP, H, PS):
    """The kernel's constexpr arguments as one :class:`TileConfig` (the values as given)."""
    return TileConfig(SPC, HS, K_BITS, V_BITS, V_CHANNEL, OPT, K_CHANNEL, HD, TP, H, PS)


# ------------------------------------------------------------------------ compile-time switches
# The kernel's OPT constexpr is the int of a config's flags (foscar.configs.GluonFlag, where each
# is documented with the configs that set it); these read it at compile time.
@gluon.constexpr_function
def fast_max(opt):
    """GluonFlag.FAST_MAX: the tile max by per-warp shuffles and one cross-warp exchange."""
    return (opt & GluonFlag.FAST_MAX) != 0


@gluon.constexpr_function
def fast_rcp(opt):
    """GluonFlag.FAST_RCP: token-wise V's z'/s' by rcp.approx and a multiply."""
    return (opt & GluonFlag.FAST_RCP) != 0


@gluon.constexpr_function
def reconstructs(opt):
    """GluonFlag.RECONSTRUCT: the ablation, s' y + z' per operand value instead of the folds."""
    return (opt & GluonFlag.RECONSTRUCT) != 0


@gluon.constexpr_function
def scaled_extraction(opt, bits, head_dim):
    """GluonFlag.SCALED_INT2 for a role of ``bits``: INT2 at head_dim 128, not in the reconstruct
    ablation (which needs y = 128 + q itself)."""
    return (
        (opt & GluonFlag.SCALED_INT2) != 0
        and bits == 2
        and head_dim == 128
        and (opt & GluonFlag.RECONSTRUCT) == 0
    )


@gluon.constexpr_function
def e4m3_operands(opt):
    """GluonFlag.E4M3: E4M3 operands for FP8 wgmma instead of bf16 mantissa injection."""
    return (opt & GluonFlag.E4M3) != 0


@gluon.constexpr_function
def q_in_consumers(opt):
    """GluonFlag.Q_IN_CONSUMERS: each consumer stages Q itself instead of the prologue."""
    return (opt & GluonFlag.Q_IN_CONSUMERS) != 0


@gluon.constexpr_function
def merge_pdl(opt):
    """GluonFlag.MERGE_PDL: the merge is a programmatic dependent launch of this kernel."""
    return (opt & GluonFlag.MERGE_PDL) != 0


@gluon.constexpr_function
def packed_heads(opt):
    """GluonFlag.PACKED_HEADS: two pages share one [64, HS] score tile (two-page tiles, H <= HS /
    2): page a's heads in columns 0..HS/2-1, page b's in HS/2.. (tiles._tile_pair_packed)."""
    return (opt & GluonFlag.PACKED_HEADS) != 0


# ------------------------------------------------------------------------------------ layouts
@gluon.constexpr_function
def acc_layout(HS, K=16):
    """wgmma accumulator (and, sliced, per-token / per-head vectors): one warpgroup, n = HS; the
    instruction's k (16 for bf16, 32 for E4M3) does not change where the values lie."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HS, K])


@gluon.constexpr_function
def a_operand_layout(HS, k_width=2):
    """wgmma A operand in registers: bf16 (k_width 2: a bf16 pair per 32-bit register) or E4M3
    (k_width 4: four bytes of consecutive k per register; thread (w, l) holds rows l//4 + 8i +
    16w and columns 4 (l%4) + j + 16 i' + 32 kb)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout(HS, 8 * k_width), k_width=k_width)


def words_per_row(bits, head_dim=D):
    """int32 words of one packed row of head_dim codes."""
    return head_dim * bits // 32


@gluon.constexpr_function
def _log2(x):
    return x.bit_length() - 1


@gluon.constexpr_function
def k_words3_layout(BITS=2, HD=D, E4M3=False):
    """[64 tokens, W words, F fields] (W = HD * BITS / 32, F = 16 / BITS, or 8 / BITS extractions
    of four bytes for E4M3): words as the m64n8 accumulator's rows (thread (w, l) owns rows l//4 +
    8i + 16w and words E*(l%4) + e, E = W / 4, foscar.formats.kernel_bit_location role "key"), the
    extraction fields in registers (for E4M3 ordered row, fields, words: the E4M3 A fragment's
    register order once the bytes are split off, see k_operand_from_fields)."""
    E = HD * BITS // 128
    F = (8 if E4M3 else 16) // BITS
    words = [[0, 1 << i, 0] for i in range(_log2(E))]
    fields = [[0, 0, 1 << i] for i in range(_log2(F))]
    return gl.DistributedLinearLayout(
        reg_bases=([[8, 0, 0]] + fields + words) if E4M3 else (words + [[8, 0, 0]] + fields),
        lane_bases=[[0, E, 0], [0, 2 * E, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 4 * E, F],
    )


@gluon.constexpr_function
def v_words4_layout(BITS=2, HD=D):
    """[32 token pairs m, W words, PW pieces X, FV fields]: a row of V is cut into 32 pieces of
    PB = BITS * HD / 32 bits (PW = 32 / PB per word, FV = HD / 32 fields of BITS each;
    foscar.formats.kernel_bit_location role "value"). Pair m = 8kb + 4i' + T with T = lane%4;
    piece g = lane//4 of warp w's 16 channels, so the word is (8w + g) // PW and X = g % PW; the
    fields and (kb, i') in registers."""
    PB = BITS * HD // 32
    pb = _log2(32 // PB)
    return gl.DistributedLinearLayout(
        reg_bases=[[4, 0, 0, 0], [8, 0, 0, 0], [16, 0, 0, 0]]
        + [[0, 0, 0, 1 << i] for i in range(_log2(HD // 32))],
        lane_bases=[[1, 0, 0, 0], [2, 0, 0, 0]]
        + [[0, 0, 1 << i, 0] for i in range(pb)]
        + [[0, 1 << i, 0, 0] for i in range(3 - pb)],
        warp_bases=[[0, 1 << (3 - pb), 0, 0], [0, 1 << (4 - pb), 0, 0]],
        block_bases=[],
        shape=[32, HD * BITS // 32, 32 // PB, HD // 32],
    )


@gluon.constexpr_function
def v_words_load_layout(BITS=2, HD=D):
    """[64 tokens, W words] as the V path reads them from smem: token bit 0 (the pair's parity)
    in a register, the lanes that take different pieces of one word replicated."""
    pb = _log2(32 // (BITS * HD // 32))
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0]] + [[0, 0]] * pb + [[0, 1 << i] for i in range(3 - pb)],
        warp_bases=[[0, 1 << (3 - pb)], [0, 1 << (4 - pb)]],
        block_bases=[],
        shape=[64, HD * BITS // 32],
    )


@gluon.constexpr_function
def v_words_e4m3_load_layout(BITS=2, HD=D):
    """[64 tokens, W words] as the E4M3 V path reads them: thread (w, l) takes the word of its
    piece 8w + l//4 (as v_words_load_layout) for the 16 tokens 4 (l%4) + j + 16 i' + 32 kb of
    its E4M3 A fragment columns, the four tokens j of a register in consecutive registers."""
    pb = _log2(32 // (BITS * HD // 32))
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [16, 0], [32, 0]],
        lane_bases=[[4, 0], [8, 0]] + [[0, 0]] * pb + [[0, 1 << i] for i in range(3 - pb)],
        warp_bases=[[0, 1 << (3 - pb)], [0, 1 << (4 - pb)]],
        block_bases=[],
        shape=[64, HD * BITS // 32],
    )


@gluon.constexpr_function
def v_e4m3_layout(BITS=2, HD=D):
    """[16 token quads, W words, PW pieces X, PBY bytes of a piece, NFB fields of a byte] of the
    E4M3 V path: quad 8 kb + 4 i' + T (T = lane % 4, i' and kb in registers), piece 8w + l//4 as
    in v_words4_layout; the registers ordered field bit 0 (channel bit 3), i', kb, then the
    piece's byte or the field's bit 1 (channel bit 6): the E4M3 A fragment's order once the
    token bytes are split off (see vt_operand_from_fields)."""
    PB = BITS * HD // 32
    pb = _log2(32 // PB)
    PBY = PB // 8
    NFB = 8 // BITS
    last = [[0, 0, 0, 1, 0]] if PBY == 2 else [[0, 0, 0, 0, 2]]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [4, 0, 0, 0, 0], [8, 0, 0, 0, 0]] + last,
        lane_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]]
        + [[0, 0, 1 << i, 0, 0] for i in range(pb)]
        + [[0, 1 << i, 0, 0, 0] for i in range(3 - pb)],
        warp_bases=[[0, 1 << (3 - pb), 0, 0, 0], [0, 1 << (4 - pb), 0, 0, 0]],
        block_bases=[],
        shape=[16, HD * BITS // 32, 32 // PB, PBY, NFB],
    )


@gluon.constexpr_function
def q_fold_layout():
    """[8 heads, 128 channels] for channel-wise K's fold Q * s'_c: channels 0-2 and 6 in
    registers (6 = the group's second scale chunk), 3-5 in lanes 0-2, heads in lanes 3-4 and
    warp 0 (warp 1 holds a copy)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 64]],
        lane_bases=[[0, 8], [0, 16], [0, 32], [1, 0], [2, 0]],
        warp_bases=[[4, 0], [0, 0]],
        block_bases=[],
        shape=[8, 128],
    )


@gluon.constexpr_function
def k_chunk_scale_layout():
    """[64 entries, 2] (s', z') pairs of one channel-wise K scale chunk, as q_fold_layout's
    channels 0-5 need them (the rest broadcast)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [1, 0], [2, 0], [4, 0]],
        lane_bases=[[8, 0], [16, 0], [32, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[64, 2],
    )


@gluon.constexpr_function
def scale_pair_layout():
    """[64 tokens, 2] (s', z') pairs: tokens as the accumulator's rows, the pair in registers."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 2],
    )


@gluon.constexpr_function
def warp_max_layout(HS):
    """[4 warps, HS] per-warp maxima, every thread holding all 4 of its heads' values (so the
    final max over warps is register-only and lands in SliceLayout(0, acc_layout(HS)))."""
    regs = [[0, 1]] + ([[0, 8]] if HS == 16 else []) + [[1, 0], [2, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[4, HS],
    )


@gluon.constexpr_function
def plain_shared_layout(rank):
    return gl.SwizzledSharedLayout(
        vec=1, per_phase=1, max_phase=1, order=list(range(rank - 1, -1, -1))
    )


def descriptor_layouts(k_bits=2, v_bits=2, head_dim=D):
    """Shared layouts of the TMA boxes: K words [1, 1, PAGE, W_K] int32, V words
    [1, 1, PAGE, W_V] int32 (the widest swizzle their rows allow), scales [1, 1, 2 * PAGE] fp32;
    the same layouts serve boxes of fewer rows (pages of 16 or 32 tokens: the swizzle depends on
    the row width only, and each page's rows start on a swizzle atom of the 64-row buffer)."""
    k_words = gl.NVMMASharedLayout.get_default_for(
        [1, 1, PAGE, words_per_row(k_bits, head_dim)], gl.int32
    )
    v_words = gl.NVMMASharedLayout.get_default_for(
        [1, 1, PAGE, words_per_row(v_bits, head_dim)], gl.int32
    )
    scales = gl.NVMMASharedLayout.get_default_for([1, 1, 2 * PAGE], gl.float32)
    return k_words, v_words, scales
