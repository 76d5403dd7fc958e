"""Warp-specialized FOSCAR decode split kernel for Hopper (sm_90a), in Triton's Gluon dialect.

Launched by :mod:`foscar.backends.gluon`; the merge of the splits is the Triton
``merge_splits_kernel``, a programmatic dependent launch that this kernel's CTAs signal after
storing their partials (OPT 8192); a launch of one split without a window partial writes the
output itself. Scope: INT2/INT4 K and V, each token-wise (g = D) or channel-wise
(groups of 128 tokens = 2 pages) at head_dim D = 128, token-wise at D = 64; page size 64, a tile
of TP = 1 or 2 pages (``_tile`` / ``_tile_pair``; 2 makes a channel-wise group one tile), up to 8
query heads per KV head (padded to HS = 8, the wgmma N), the quantized history
only (a format's BF16 sink/recent windows are read by the Triton window program). OPT 1024 builds
E4M3 operands for FP8 wgmma instead of bf16 ones (token-wise K and V at D = 128; the E4M3
section below; backend "gluon-e4m3").

Partitions (``gl.warp_specialize``, triton 3.6.0):
    default  (4 warps): consumer 0, tiles t_begin + 0, 2, 4, ...
    worker 0 (4 warps): consumer 1, tiles t_begin + 1, 3, 5, ...; leaves its softmax state in
                        shared memory, merged by the default warps after the partitions join
    worker 1 (1 warp) : producer, TMA copies of TP pages of packed K/V words and their (s', z')
                        scales per tile into a ring of 2 x SPC stages (SPC per consumer)

Per tile, a consumer (one warpgroup) does
    LDS packed words -> K operand [64 tok, D ch] bf16 in registers (SHF + LOP3)
    S^T = K_op @ Q^T        wgmma m64n8k16 x D/16, A from registers, Q [8, D] K-major in smem
    V^T operand [D ch, 64 tok] (PRMT + SHF + LOP3) while the QK wgmma runs
    acc-fold of K (per token s'_K, z'_K), online softmax over the 64 tokens (cross-warp max)
    (channel-wise K instead: Q' = bf16(Q s'_c) of the tile's group into the consumer's B-operand
    buffer, the K operand the codes q themselves, S = Q' . q + zq with zq from the rounded Q')
    operand-fold of V into P: P' = bf16(P * s'_V); offset term z2 += P' * z'_V / s'_V
    O^T(tile) = V^T_op @ P'   wgmma m64n8k16 x 2 x 4, P'^T [8, 64] K-major through smem,
    added to the running O^T on the CUDA cores (Note [tensor-core accumulation] in
    foscar.kernels.triton_decode)

Data contract (foscar.cache; the same as ``decode_split_kernel``):
    q:        [B, Hq, D] bf16
    k_words:  [pages, Hkv, PAGE, W = D*bits/32] int32 (channel order of role "key")
              -> TMA box [1, 1, 64, W]
    k_scales: [pages, Hkv, PAGE*D/g, 2] fp32 viewed as [pages, Hkv, 2*PAGE]  -> TMA box [1,1,128]
    v_*:      likewise (role "value")
    o_part:   [B, Hq, num_splits, D] fp32, normalised partial outputs
    lse_part: [B, Hq, num_splits] fp32, log2-domain LSE (-inf when empty)

Packed words: foscar's layouts fit the wgmma register fragments unchanged (every
``convert_layout(..., assert_trivial=True)`` below is a compile-time proof that the bit
operations land each bf16 pair in the register the m64nNk16 A fragment wants):
    K: thread (warp w, lane l) owns rows l//4 + 8i + 16w and words E*(l%4) + e, E = D*bits/128,
       of its rows; at INT2 and D = 128: register (i, i', kb) = field 2*(kb%4) + i' of word
       2*(l%4) + kb//4 (2 x LDS.64 per tile).
    V: a row is 32 pieces of bits*D/32 bits; thread (w, l) owns piece 8w + l//4 of 16 tokens
       (at INT2, D = 128: byte (l//4)%4 of word 2w + (l//4)//4; 4 threads read the same word);
       one PRMT per token pair joins the pieces' bytes (a 4-bit piece at INT2, D = 64, takes the
       byte it shares and is shifted into place), SHF/LOP3 pairs make the operands.

B operands are stored K-major: MN-major Q^T / P' with 16-byte rows made the wgmma read shared
memory out of bounds on the H200 (compute-sanitizer memcheck, benchmarks/NOTES.md 12).
The CPU checks of the operand programs and layouts are in tests/test_gluon_kernel.py and
benchmarks/prototypes/gluon/foscar_gluon_proto.py (numpy emulation, SASS counts).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

__all__ = ["gluon_decode_split_kernel", "descriptor_layouts", "words_per_row", "D", "PAGE", "MAGIC"]

MAGIC = 0x43004300  # two bf16 128.0: the mantissa-injection base of both halves

D = 128
PAGE = 64
#: PAGE for the kernels' own code (a tile unit: 64 tokens, whatever the cache's page size)
UNIT = gl.constexpr(PAGE)


# ------------------------------------------------------------------------------------------ layouts
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
    register order once the bytes are split off, see _k_operand_from_fields)."""
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
    token bytes are split off (see _vt_operand_from_fields)."""
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


# ------------------------------------------------------------------------------ bits -> operands
@gluon.jit
def _prmt(a, b, sel):
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _bf16_pair(x):
    """int32 [...] holding two bf16 (low, high) -> bf16 [..., 2] (register views, no SASS)."""
    lo = (x & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (x >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _sub_bf16x2(x, y):
    """Two bf16 lanes of int32 x minus those of y (one HADD2.BF16; exact for the code range)."""
    return gl.inline_asm_elementwise(
        "sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [x, y], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _scaled_exponent_k(c):
    """Scaled extraction (INT2): key channel c is field k = (c // 8) % 8 of its word half
    (foscar.formats.kernel_bit_location); after a shift by 6 (k // 3) it sits at mantissa bits
    2 (k % 3), so its operand is 128 + 4^(k % 3) q. Returns k % 3."""
    return ((c // 8) % 8) % 3


@gluon.jit
def _scaled_exponent_v(c):
    """Scaled extraction (INT2, head_dim 128): value channel c is field f = 2 (c // 64) + (c // 8)
    % 2 of its byte piece; its operand is 128 + 4^(f % 3) q. Returns f % 3."""
    return (2 * (c // 64) + (c // 8) % 2) % 3


@gluon.jit
def _pow4(a, inverse: gl.constexpr):
    """4^a (or 4^-a) in fp32, exactly, from the exponent bits."""
    e = (127 - 2 * a) if inverse else (127 + 2 * a)
    return (e << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _fields(x, f, MASK: gl.constexpr, BITS: gl.constexpr, SCALED: gl.constexpr):
    """Field f of each half of x as a bf16 pair's mantissa bits (before the magic exponent): at
    bits 0-1 (one shift per field), or, scaled (INT2), at bits 2 (f % 3) after one shift per
    three fields, so that a word of 8 INT2 pairs takes 2 shifts instead of 7 (the operand is then
    128 + 4^(f % 3) q; Q and the output fold the 4^(f % 3) back, exactly)."""
    if SCALED:
        gl.static_assert(BITS == 2)
        return (x >> (6 * (f // 3))) & ((f * 0 + MASK) << (2 * (f % 3)))
    else:
        return (x >> (BITS * f)) & MASK


@gluon.jit
def _k_operand(
    words,
    magic,
    HS: gl.constexpr,
    BITS: gl.constexpr,
    HD: gl.constexpr,
    ZERO: gl.constexpr,
    SCALED: gl.constexpr = False,
):
    """K operand [64 tokens, HD channels] bf16 (natural channel order) in the wgmma A layout,
    from words [64, W] in SliceLayout(2, k_words3_layout(BITS, HD)): y = 128 + q, or with ZERO the
    code q itself (one more bf16x2 subtraction per pair: channel-wise K, whose folded Q' would
    otherwise put the cancellation of a +128 offset on the tensor core's accumulation)."""
    L3: gl.constexpr = k_words3_layout(BITS, HD)
    E: gl.constexpr = HD * BITS // 128  # words per thread and row
    F: gl.constexpr = 16 // BITS
    MASK: gl.constexpr = ((1 << BITS) - 1) * 0x00010001
    f = gl.arange(0, F, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    x = _fields(gl.expand_dims(words, 2), f[None, None, :], MASK, BITS, SCALED) | magic
    if ZERO:
        x = _sub_bf16x2(x, magic)
    y = _bf16_pair(x)  # [n, word = E*T + e, k = 2*kbl + i', j]
    y = y.reshape([64, 4, E, F // 2, 2, 2])  # n, T, e, kbl, i', j
    # channel 8 (e F + k) + 2T + j = 8 F e + 16 kbl + 8 i' + 2T + j
    y = gl.permute(y, [0, 2, 3, 4, 1, 5])  # n, e, kbl, i', T, j
    return gl.convert_layout(y.reshape([64, HD]), a_operand_layout(HS), assert_trivial=True)


@gluon.jit
def _vt_operand(
    words,
    magic,
    HS: gl.constexpr,
    BITS: gl.constexpr,
    HD: gl.constexpr,
    SCALED: gl.constexpr = False,
):
    """V^T operand [HD channels, 64 tokens] bf16 in the wgmma A layout, from words [64, W] in
    v_words_load_layout(BITS, HD). One PRMT joins piece X of an even and an odd token (a piece
    of 4 bits, HD = 64 at INT2, shares its byte with piece X ^ 1 and is shifted into place)."""
    L4: gl.constexpr = v_words4_layout(BITS, HD)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    W: gl.constexpr = HD * BITS // 32
    PB: gl.constexpr = BITS * HD // 32  # bits per piece
    PW: gl.constexpr = 32 // PB  # pieces per word
    FV: gl.constexpr = HD // 32  # fields per piece
    PBY: gl.constexpr = (PB + 7) // 8  # bytes per piece (a nibble takes its byte)
    MASK: gl.constexpr = ((1 << BITS) - 1) * 0x00010001
    even, odd = gl.split(gl.permute(words.reshape([32, 2, W]), [0, 2, 1]))  # [m, word] each
    even = gl.convert_layout(even, gl.SliceLayout(2, L3), assert_trivial=True)
    odd = gl.convert_layout(odd, gl.SliceLayout(2, L3), assert_trivial=True)
    X = gl.arange(0, PW, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    # bytes (a[lo], a[lo + PBY - 1], b[lo], b[lo + PBY - 1]), lo = X * PB // 8: piece X of the
    # even token in the low half, of the odd token in the high half
    lo = (X * PB) // 8
    sel = lo | ((lo + PBY - 1) << 4) | ((lo + 4) << 8) | ((lo + PBY + 3) << 12)
    xb = _prmt(gl.expand_dims(even, 2), gl.expand_dims(odd, 2), sel[None, None, :])  # [m, word, X]
    xb = gl.expand_dims(xb, 3)
    if PB % 8 == 0:
        f = gl.arange(0, FV, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
        x = _fields(xb, f[None, None, None, :], MASK, BITS, SCALED) | magic
    else:  # field f of a nibble piece: bit 4 (X % 2) + BITS f of its byte
        gl.static_assert(not SCALED, "scaled extraction: head_dim 128")
        L2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L4))
        X2 = gl.arange(0, PW, layout=gl.SliceLayout(1, L2))
        f = gl.arange(0, FV, layout=gl.SliceLayout(0, L2))
        shift = ((X2 * PB) % 8)[:, None] + (BITS * f)[None, :]
        x = ((xb >> shift[None, None, :, :]) & MASK) | magic
    y = _bf16_pair(x)  # [m, word, X, f, J]
    y = y.reshape([4, 2, 4, 4, W // 4, PW, HD // 64, 2, 2])  # kb, i', T, w, g_hi, X, b, a, J
    # channel 64b + 16w + 8a + g with piece g = PW * g_hi + X; token 2m + J
    y = gl.permute(y, [6, 3, 7, 4, 5, 0, 1, 2, 8])  # b, w, a, g_hi, X | kb, i', T, J
    return gl.convert_layout(y.reshape([HD, 64]), a_operand_layout(HS), assert_trivial=True)


# ----------------------------------------------------------------------- E4M3 operands (OPT 1024)
# The paper's Blackwell mapping on Hopper's FP8 wgmma (m64nNk32, e4m3 x e4m3 -> fp32): a code q in
# the low bits of a byte is the E4M3 value q 2^-9 (subnormal up to 7, exact up to 15), so one
# shift and one mask make four operands. The kernel reads the bf16-layout cache as it is: its
# K words hold a thread's channels in another order than the E4M3 fragment's columns, and the
# reduction over channels does not care, so Q is stored in the operand's column order
# (_e4m3_key_channel); V^T's columns are tokens in natural order, so P' needs no permutation.
# Q and P' are per-head scaled E4M3 copies (Q: a power of two per head, P': 256 P' with P' <= 1).
@gluon.constexpr_function
def e4m3_operands(opt):
    """Whether the kernel builds E4M3 operands (OPT 1024) instead of bf16 mantissa injection."""
    return (opt & 1024) != 0


@gluon.constexpr_function
def _append(shape, n):
    return [int(getattr(d, "value", d)) for d in shape] + [n]


@gluon.jit
def _bytes4(x):
    """int32 [...] -> float8e4nv [..., 4]: its four bytes, lowest first (register views)."""
    b0 = x.to(gl.int8).to(gl.float8e4nv, bitcast=True)
    b1 = (x >> 8).to(gl.int8).to(gl.float8e4nv, bitcast=True)
    b2 = (x >> 16).to(gl.int8).to(gl.float8e4nv, bitcast=True)
    b3 = (x >> 24).to(gl.int8).to(gl.float8e4nv, bitcast=True)
    y = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [..., hi, lo]: byte 2 hi + lo
    return y.reshape(_append(x.shape, 4))


@gluon.jit
def _fields_e4m3(x, f, BITS: gl.constexpr, SCALED: gl.constexpr):
    """Extraction f of four bytes' codes at once, each in the low nibble of its byte (E4M3 q 2^-9
    or, scaled (INT2), 4 q 2^-9 for odd f: a mask in place of every other shift)."""
    if SCALED:
        gl.static_assert(BITS == 2)
        shift = 4 * (f // 2)
        mask = (f * 0 + 0x03030303) << (2 * (f % 2))
    else:
        shift = BITS * f
        mask = f * 0 + ((1 << BITS) - 1) * 0x01010101
    # opaque to LLVM: seen through, its known-bits rewrites split the word into per-byte
    # shifts and PRMTs (INT4: ~50 more instructions per tile) where _bytes4 should be free
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t; shr.u32 t, $1, $2; and.b32 $0, t, $3; }",
        "=r,r,r,r",
        [x, shift, mask],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _e4m3_key_channel(k, BITS: gl.constexpr):
    """The key channel in column k of the E4M3 K operand (and of Q's E4M3 copy): column k = b + 4T
    + 16 (f + NF e) is byte b of extraction f (NF = 8 / BITS per word) of the thread's word e,
    i.e. field NF (b % 2) + f of half b // 2 of word E T + e (foscar.formats role "key")."""
    NF: gl.constexpr = 8 // BITS
    b = k % 4
    idx = k // 16
    return 16 * NF * (idx // NF) + 8 * NF * (b % 2) + 8 * (idx % NF) + 2 * ((k // 4) % 4) + b // 2


@gluon.jit
def _k_fields_e4m3(words, BITS: gl.constexpr, HD: gl.constexpr, SCALED: gl.constexpr):
    """The int32 registers of the E4M3 K operand: [64 tokens, W words, NF extractions] from
    words [64, W] in SliceLayout(2, k_words3_layout(BITS, HD)), NF = 8 / BITS per word (INT2
    scaled: 1 shift and 4 masks per 16 codes). _k_operand_from_fields views them as E4M3; the
    QK wait takes these int32 registers as its deps (triton 3.6's WGMMAWaitGroupOp rejects
    8-bit deps, "Unexpected bitwidth"), which keeps the operand alive until the product is done.
    That holds because the byte views are free, i.e. the wgmma reads these very registers (the
    SASS shows it; were LLVM to rebuild the operand in other registers, the tile loop would grow
    by the PRMTs, which test_e4m3_operands_compile_without_spills bounds)."""
    L3: gl.constexpr = k_words3_layout(BITS, HD, True)
    words = gl.convert_layout(words, gl.SliceLayout(2, L3), assert_trivial=True)
    f = gl.arange(0, 8 // BITS, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    return _fields_e4m3(gl.expand_dims(words, 2), f[None, None, :], BITS, SCALED)


@gluon.jit
def _k_operand_from_fields(x, HS: gl.constexpr, BITS: gl.constexpr, HD: gl.constexpr):
    """K operand [64 tokens, HD columns] E4M3 in the wgmma A layout (k_width 4), columns in
    _e4m3_key_channel's order: the bytes of _k_fields_e4m3's registers (no instructions)."""
    E: gl.constexpr = HD * BITS // 128
    NF: gl.constexpr = 8 // BITS
    y = _bytes4(x).reshape([64, 4, E, NF, 4])  # n, T, e, f, b
    y = gl.permute(y, [0, 2, 3, 1, 4])  # n, e, f, T, b: column b + 4T + 16 (f + NF e)
    return gl.convert_layout(y.reshape([64, HD]), a_operand_layout(HS, 4), assert_trivial=True)


@gluon.jit
def _vt_fields_e4m3(words, BITS: gl.constexpr, HD: gl.constexpr, SCALED: gl.constexpr):
    """The int32 registers of the E4M3 V^T operand: [16 token quads, W, PW, PBY, NFB] (layout
    v_e4m3_layout) from words [64, W] in v_words_e4m3_load_layout. A register holds one channel
    of four consecutive tokens, so three PRMT gather a piece's byte of the four tokens (four PRMT
    both bytes of an INT4 piece), then one shift and one mask per extraction (INT2 scaled: 1
    shift, 4 masks). Built while the QK product runs: the QK wait takes them as deps."""
    L5: gl.constexpr = v_e4m3_layout(BITS, HD)
    W: gl.constexpr = HD * BITS // 32
    PB: gl.constexpr = BITS * HD // 32
    PW: gl.constexpr = 32 // PB
    PBY: gl.constexpr = PB // 8
    NFB: gl.constexpr = 8 // BITS
    L4: gl.constexpr = gl.SliceLayout(4, L5)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    q = gl.permute(words.reshape([16, 4, W]), [0, 2, 1]).reshape([16, W, 2, 2])  # quad, word, j
    even, odd = gl.split(q)  # tokens j = 0, 2 and j = 1, 3 of each quad
    t0, t2 = gl.split(even)
    t1, t3 = gl.split(odd)
    t0 = gl.convert_layout(t0, L2, assert_trivial=True)
    t1 = gl.convert_layout(t1, L2, assert_trivial=True)
    t2 = gl.convert_layout(t2, L2, assert_trivial=True)
    t3 = gl.convert_layout(t3, L2, assert_trivial=True)
    X = gl.arange(0, PW, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    lo = X * PBY  # the piece's first byte in its word
    if PBY == 2:  # both bytes of the piece of two tokens: [a lo, a lo+1, b lo, b lo+1]
        sel = lo | ((lo + 1) << 4) | ((lo + 4) << 8) | ((lo + 5) << 12)
    else:  # [a lo, b lo, -, -]
        sel = lo | ((lo + 4) << 4) | (lo << 8) | ((lo + 4) << 12)
    a = _prmt(gl.expand_dims(t0, 2), gl.expand_dims(t1, 2), sel[None, None, :])
    b = _prmt(gl.expand_dims(t2, 2), gl.expand_dims(t3, 2), sel[None, None, :])
    hb = gl.arange(0, PBY, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    sel2 = hb | ((PBY + hb) << 4) | ((4 + hb) << 8) | ((4 + PBY + hb) << 12)
    g = _prmt(gl.expand_dims(a, 3), gl.expand_dims(b, 3), sel2[None, None, None, :])
    fb = gl.arange(
        0,
        NFB,
        layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L5)))),
    )
    return _fields_e4m3(gl.expand_dims(g, 4), fb[None, None, None, None, :], BITS, SCALED)


@gluon.jit
def _vt_operand_from_fields(x, HS: gl.constexpr, HD: gl.constexpr):
    """V^T operand [HD channels, 64 tokens] E4M3 in the wgmma A layout (k_width 4): the bytes of
    _vt_fields_e4m3's registers (no instructions)."""
    # quad 8 kb + 4 i' + T, piece 8w + g = word PW + X, field 2b + a = hb NFB + fb, token byte j
    y = _bytes4(x).reshape([2, 2, 4, 4, 8, 2, 2, 4])  # kb, i', T, w, g, b, a, j
    y = gl.permute(y, [5, 3, 6, 4, 0, 1, 2, 7])  # b, w, a, g | kb, i', T, j
    return gl.convert_layout(y.reshape([HD, 64]), a_operand_layout(HS, 4), assert_trivial=True)


@gluon.jit
def _scale_pairs(buf, HS: gl.constexpr):
    """(s', z') of the 64 tokens of a tile, each [64] in the accumulator's row layout."""
    sz = buf.reshape([64, 2]).load(scale_pair_layout())
    s, z = gl.split(sz)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout(HS))
    return (
        gl.convert_layout(s, row_l, assert_trivial=True),
        gl.convert_layout(z, row_l, assert_trivial=True),
    )


@gluon.jit
def _group_channels(a0, a1, layout: gl.constexpr):
    """The [64] halves of a channel-wise group's 128 values (channels 0-63 from its first page's
    chunk, 64-127 from its second) -> [128] in ``layout``, a register relabeling."""
    a = gl.permute(gl.join(a0, a1), [1, 0]).reshape([128])
    return gl.convert_layout(a, layout, assert_trivial=True)


@gluon.jit
def _channel_scale_pairs(buf0, buf1, HS: gl.constexpr):
    """(s', z') of the 128 channels of a channel-wise group (channels 0-63 in the chunk of its
    first page, 64-127 in its second), each [128] in the rows of the [128, HS] accumulator (V's
    fold; channel-wise K's reconstruct ablation converts them to K's columns)."""
    s0, z0 = _scale_pairs(buf0, HS)
    s1, z1 = _scale_pairs(buf1, HS)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout(HS))
    return _group_channels(s0, s1, row_l), _group_channels(z0, z1, row_l)


@gluon.jit
def _channel_key_fold(
    buf0,
    buf1,
    qt_smem,
    q_smem,
    zq_smem,
    HS: gl.constexpr,
    ZQ_REG: gl.constexpr,
    SCALED: gl.constexpr = False,
):
    """Channel-wise K (a group of 128 tokens, channels 0-63 in the scale chunk of its first page,
    64-127 in its second): Q' = bf16(Q s'_c) into q_smem, the B operand of the tile's QK product
    over the zero-offset codes q, and the offset zq[h] = sum_c Q'_c (128 + z'_c / s'_c) into
    zq_smem, so that S = Q' . q + zq = sum_c (Q'_c / s'_c) x_c (x = s' (q + 128) + z'): the logit
    of a Q rounded to bf16, whose error scales with x. An offset from the unrounded Q (sum_c Q_c
    (z'_c + 128 s'_c)) leaves the error of Q' times s' q, up to the group's range: 2.5x larger,
    over the 5e-3 bar at 32K on the H200 (benchmarks/NOTES.md 15). The +128 stays out of the
    product and cancels in fp32 here. Q is read from qt_smem per tile (held in registers across
    the loop it made the KcVc consumer spill 232 bytes)."""
    gl.static_assert(HS == 8, "q_fold_layout holds 8 heads")
    LS: gl.constexpr = k_chunk_scale_layout()
    s0, z0 = gl.split(buf0.reshape([64, 2]).load(LS))
    s1, z1 = gl.split(buf1.reshape([64, 2]).load(LS))
    col_l: gl.constexpr = gl.SliceLayout(0, q_fold_layout())
    s = _group_channels(s0, s1, col_l)
    z = _group_channels(z0, z1, col_l)
    qf = qt_smem.load(q_fold_layout()).to(gl.float32)
    qb = (qf * s[None, :]).to(gl.bfloat16)
    if SCALED:  # the operand holds 4^a q (scaled extraction): Q' 4^-a, exact in bf16
        inv = _pow4(_scaled_exponent_k(gl.arange(0, 128, layout=col_l)), True)
        q_smem.store((qb.to(gl.float32) * inv[None, :]).to(gl.bfloat16))
    else:
        q_smem.store(qb)
    zq = gl.sum(qb.to(gl.float32) * (128.0 + gl.fdiv(z, s))[None, :], axis=1)  # [8]
    if ZQ_REG:  # to the accumulator's columns by the compiler's conversion
        fence_async_shared()
        return gl.convert_layout(zq, gl.SliceLayout(0, acc_layout(HS)))
    else:
        zq_smem.store(zq)
        fence_async_shared()
        return zq_smem.load(gl.SliceLayout(0, acc_layout(HS)))


@gluon.jit
def _channel_key_operand(ks_bufs, s, qt_smem, kfold, CFG: gl.constexpr):
    """Channel-wise K at ring stage s (its group's two scale chunks at 2s, 2s + 1): the fold of
    _channel_key_fold into this consumer's buffers kfold = (Q', zq); returns (zq, the QK
    product's B operand Q'^T)."""
    q_smem, zq_smem = kfold
    zq = _channel_key_fold(
        ks_bufs.index(2 * s),
        ks_bufs.index(2 * s + 1),
        qt_smem,
        q_smem,
        zq_smem,
        CFG[1],
        (CFG[5] & 256) != 0,
        scaled_extraction(CFG[5], CFG[2], CFG[7]),
    )
    return zq, q_smem.permute((1, 0))


@gluon.jit
def _rows_to_128(x, HS: gl.constexpr):
    """[64, HS] accumulator whose rows are equal -> [128, HS] accumulator (both m-tiles), a
    register relabeling."""
    y = gl.permute(gl.join(x, x), [2, 0, 1]).reshape([128, HS])
    return gl.convert_layout(y, acc_layout(HS), assert_trivial=True)


@gluon.jit
def _rcp(x):
    return gl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def _lg2(x):
    """log2 by MUFU.LG2 (gl.log2 is a ~20-instruction accurate polynomial)."""
    return gl.inline_asm_elementwise(
        "lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def _col_max(sc, HS: gl.constexpr, FAST_MAX: gl.constexpr):
    """max over the 64 token rows of sc [64, HS] (acc layout) -> [HS] in SliceLayout(0, acc)."""
    if FAST_MAX:
        # per-warp max (shuffles only), then one exchange of the 4 warp maxima through smem
        wmax = gl.max(sc.reshape([4, 16, HS]), axis=1)  # [4 warps, HS]
        wmax = gl.convert_layout(wmax, warp_max_layout(HS))
        return gl.convert_layout(
            gl.max(wmax, axis=0), gl.SliceLayout(0, acc_layout(HS)), assert_trivial=True
        )
    else:
        return gl.max(sc, axis=0)


# ---------------------------------------------------------------------------------------- split
@gluon.jit
def _split_span(seq_ptrs, num_splits, TP: gl.constexpr, OPT: gl.constexpr):
    """This CTA's tiles (TP pages each), as decode_split_kernel computes them for pages: (t_begin,
    t_full, t_end, n_q, page_base). Every partition computes it from the kernel's arguments: values
    computed before ``warp_specialize`` reach the workers through a shared-memory capture buffer
    that triton 3.6 lets the default partition's layout-conversion scratch overlap, so consumer 0
    could overwrite a worker's span before the worker read it (compute-sanitizer racecheck,
    wrong outputs on the H200 that changed from call to call: benchmarks/NOTES.md 15)."""
    kv_indptr_ptr, num_quantized_ptr = seq_ptrs
    b = gl.program_id(0)
    split = gl.program_id(2)
    n_q = gl.load(num_quantized_ptr + b)
    page_base = gl.load(kv_indptr_ptr + b)
    n_tiles = gl.cdiv(n_q, 64 * TP)
    per_split = gl.cdiv(n_tiles, num_splits)
    t_begin = gl.minimum(split * per_split, n_tiles)
    t_end = gl.minimum(t_begin + per_split, n_tiles)
    if (OPT & 16384) != 0:  # timing ablation: the launch, span, Q, epilogue and merge only
        t_end = t_begin
    t_full = gl.maximum(gl.minimum(t_end, n_q // (64 * TP)), t_begin)
    return t_begin, t_full, t_end, n_q, page_base


# ------------------------------------------------------------------------------------- consumer
# OPT bits (constexpr): 1 = one-barrier cross-warp max; 2 = deferred PV wait (the PV wgmma of tile i
# in flight across the loop back-edge: ptxas C7512 serializes every wgmma, do not use; one-page
# tiles only); 4 = rcp.approx for token-wise V's z'/s' (channel-wise K's z'/s' always divides); 8 =
# arrive on `empty` after the QK wgmma issue (same barrier count); 32 = memory-only timing ablation
# (consumers only wait/arrive); 64 = compute-only timing ablation (after the first 2*SPC tiles the
# producer arrives without loading); 128 = per-value reconstruction (the ablation of Fig. 10a: s' y
# + z' on every K and V operand value in registers, P unscaled, no folds); 256 = channel-wise K's
# offsets zq to the accumulator's columns by the compiler's layout conversion instead of an explicit
# shared buffer; 512 = scaled extraction of INT2 operands at head_dim 128 (_fields: 2 shifts per 8 K
# pairs instead of 7, 1 per 4 V pairs instead of 3; Q, the offsets and the output fold the powers of
# 4 back, exactly); 1024 = E4M3 operands for FP8 wgmma (token-wise K and V at head_dim 128, one-page
# tiles or packed heads; see the E4M3 section); 2048 = Q staged by each consumer (its own Q^T
# buffer, after the partitions start) instead of by the prologue, so the producer's first TMA copies
# do not wait for Q's load; 8192 = the merge launched as a programmatic dependent launch, signalled
# after this CTA's partial is stored (see the launcher); 16384 = no-tiles timing ablation (every
# split empty: the launch, span, Q staging, epilogue and merge only); 32768, 65536, 131072 =
# ablations for the one-page KcVc race (NOTES 19): channel-wise V's sum of P' in registers instead
# of the ones @ P' product, the stage released at the tile's end, a fence and a barrier at the
# tile's end; 262144 = packed heads (two-page tiles, H <= HS / 2, token-wise K and V at head_dim
# 128: both pages' scores in one [64, HS] tile; _tile_pair_packed for E4M3 operands,
# _tile_pair_packed_bf16 for bf16 ones). Default 5 (the config's default: 10757 = 5 | 512 | 2048 |
# 8192, configs.GluonDecodeConfig). (Whatever the bits, a launch of one split without a window
# partial, num_parts == 1, writes the output itself: no merge launch.)
@gluon.constexpr_function
def scaled_extraction(opt, bits, head_dim):
    """Whether a role of ``bits`` takes the scaled extraction (OPT 512): INT2 at head_dim 128,
    not in the reconstruct ablation (which needs y = 128 + q itself)."""
    return (opt & 512) != 0 and bits == 2 and head_dim == 128 and (opt & 128) == 0


@gluon.jit
def _load_k_words(buf, BITS: gl.constexpr, HD: gl.constexpr):
    """One page's packed K words [64, W] as _k_operand takes them."""
    return buf.reshape([64, HD * BITS // 32]).load(gl.SliceLayout(2, k_words3_layout(BITS, HD)))


@gluon.jit
def _load_v_words(buf, BITS: gl.constexpr, HD: gl.constexpr, E4M3: gl.constexpr = False):
    """One page's packed V words [64, W] as _vt_operand (or _vt_fields_e4m3) takes them."""
    if E4M3:
        layout: gl.constexpr = v_words_e4m3_load_layout(BITS, HD)
    else:
        layout: gl.constexpr = v_words_load_layout(BITS, HD)
    return buf.reshape([64, HD * BITS // 32]).load(layout)


@gluon.jit
def _reconstruct(op, s, z, PER_ROW: gl.constexpr, HS: gl.constexpr):
    """The ablation's per-value s' y + z' on an A operand in registers: s, z per row ([M]) or
    per column ([K]; another thread distribution than the rows)."""
    a_l: gl.constexpr = a_operand_layout(HS)
    if PER_ROW:
        s_a = gl.convert_layout(s, gl.SliceLayout(1, a_l))
        z_a = gl.convert_layout(z, gl.SliceLayout(1, a_l))
        return (op.to(gl.float32) * s_a[:, None] + z_a[:, None]).to(gl.bfloat16)
    else:
        s_a = gl.convert_layout(s, gl.SliceLayout(0, a_l))
        z_a = gl.convert_layout(z, gl.SliceLayout(0, a_l))
        return (op.to(gl.float32) * s_a[None, :] + z_a[None, :]).to(gl.bfloat16)


@gluon.jit
def _page_k_operand(words, ks, kz, magic, HS: gl.constexpr, CFG: gl.constexpr):
    """K operand [64 tokens, HD] of one page's words (reconstructed in the ablation)."""
    K_BITS: gl.constexpr = CFG[2]
    K_CHANNEL: gl.constexpr = CFG[6]
    HD: gl.constexpr = CFG[7]
    RECONSTRUCT: gl.constexpr = (CFG[5] & 128) != 0
    SCALED: gl.constexpr = scaled_extraction(CFG[5], K_BITS, HD)
    k_op = _k_operand(words, magic, HS, K_BITS, HD, K_CHANNEL and not RECONSTRUCT, SCALED)
    if RECONSTRUCT:  # token-wise: the rows of K; channel-wise: its columns
        k_op = _reconstruct(k_op, ks, kz, not K_CHANNEL, HS)
    return k_op


@gluon.jit
def _page_vt_operand(words, vs, vz, magic, HS: gl.constexpr, CFG: gl.constexpr):
    """V^T operand [HD, 64 tokens] of one page's words (reconstructed in the ablation)."""
    V_BITS: gl.constexpr = CFG[3]
    V_CHANNEL: gl.constexpr = CFG[4]
    HD: gl.constexpr = CFG[7]
    vt_op = _vt_operand(words, magic, HS, V_BITS, HD, scaled_extraction(CFG[5], V_BITS, HD))
    if (CFG[5] & 128) != 0:  # channel-wise: the rows of V^T; token-wise: its columns
        vt_op = _reconstruct(vt_op, vs, vz, V_CHANNEL, HS)
    return vt_op


@gluon.jit
def _value_ratio(vs, vz, V_CHANNEL: gl.constexpr, FAST_RCP: gl.constexpr):
    """Token-wise V's offset ratio z'/s' per token (channel-wise V folds after the product)."""
    if V_CHANNEL:
        return vz  # unused
    elif FAST_RCP:
        return vz * _rcp(vs)
    else:
        return gl.fdiv(vz, vs)


@gluon.jit
def _tile_factor(x):
    """A per-token factor for a [64, HS] tile: [64] as a column, [64, HS] (a packed tile's, page
    a's in the first half of the columns) as it is."""
    if len(x.shape) == 1:
        return x[:, None]
    else:
        return x


@gluon.jit
def _key_logits(s_acc, ks, kz, zq, qsums, qk_scale, CFG: gl.constexpr):
    """Logits (log2 domain) of a [64, HS] QK product, with the per-token factors ks, kz as [64]
    or, for a packed tile, [64, HS] (_tile_factor): the acc-fold of token-wise K, S = c (s'_K
    (Q . y_K) + z'_K sum(Q)) (c folded into ks and qsum), or of channel-wise K, S = c (Q' . q +
    zq), Q' and zq built for the group; the reconstruct ablation's product is the logit.
    qsums = (c sum(Q), dq): with the scaled extraction the product is Q~ . y~ (Q~_c = Q_c 4^-a,
    y~ = 128 + 4^a q), which is Q . y - dq, dq = 128 (sum(Q) - sum(Q~)). E4M3 operands: qsums =
    (c sum(Q^), hf) with Q^ the per-head scaled E4M3 Q as the product saw it, hf = 2^(9 - sigma)
    its scale back, and the product Q^ . q 2^(sigma - 9): S = c (s'_K hf acc + (z'_K + 128
    s'_K) sum(Q^)) (the cache's bf16 constants, x = s' (q + 128) + z')."""
    qsum, dq = qsums
    if (CFG[5] & 128) != 0:
        return s_acc * qk_scale
    elif e4m3_operands(CFG[5]):
        ks, kz = _tile_factor(ks), _tile_factor(kz)
        return (s_acc * dq[None, :]) * (ks * qk_scale) + (kz + 128.0 * ks) * qsum[None, :]
    elif CFG[6]:
        return (s_acc + zq[None, :]) * qk_scale
    elif scaled_extraction(CFG[5], CFG[2], CFG[7]):
        ks, kz = _tile_factor(ks), _tile_factor(kz)
        return (s_acc + dq[None, :]) * (ks * qk_scale) + kz * qsum[None, :]
    else:
        ks, kz = _tile_factor(ks), _tile_factor(kz)
        return s_acc * (ks * qk_scale) + kz * qsum[None, :]


@gluon.jit
def _mask_rows(sc, vs, ratio, row0, n_q, HS: gl.constexpr, V_CHANNEL: gl.constexpr):
    """Rows of the tile past the history (token row0 + r >= n_q) out of the softmax and, for
    token-wise V, with harmless fold factors (their stale words may hold anything)."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout(HS)))
    valid = row0 + rows < n_q
    sc = gl.where(valid[:, None], sc, -float("inf"))
    if not V_CHANNEL:
        vs = gl.where(valid, vs, 1.0)
        ratio = gl.where(valid, ratio, 0.0)
    return sc, vs, ratio


@gluon.jit
def _channel_value_fold(
    acc,
    alpha,
    o_t,
    p_sum,
    vs,
    vz,
    HS: gl.constexpr,
    SCALED: gl.constexpr,
    P_COLS: gl.constexpr = False,
):
    """acc-fold of channel-wise V: O = alpha O + s'_c (V_y^T P')[c, h] + z'_c sum_n P'[n, h].
    Scaled extraction: the product holds y~ = 128 + 4^a q, i.e. 4^a V_y^T P' - 128 (4^a - 1)
    sum P', so s'_c becomes s'_c 4^-a and z'_c becomes z'_c + 128 s'_c (1 - 4^-a). p_sum: the
    ones @ P' product [64, HS] (every row the sum), or with P_COLS the sums [HS] themselves."""
    if SCALED:
        c = gl.arange(0, 128, layout=gl.SliceLayout(1, acc_layout(HS)))
        inv = _pow4(_scaled_exponent_v(c), True)
        vz = vz + 128.0 * vs * (1.0 - inv)
        vs = vs * inv
    if P_COLS:
        offset = vz[:, None] * p_sum[None, :]
    else:
        offset = vz[:, None] * _rows_to_128(p_sum, HS)
    return acc * alpha[None, :] + vs[:, None] * o_t + offset


@gluon.jit
def _tile(i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr):
    """One page (64 tokens) of consumer C: tile t, its i-th (ops: see _step)."""
    SPC: gl.constexpr = CFG[0]
    HS: gl.constexpr = CFG[1]
    V_BITS: gl.constexpr = CFG[3]
    V_CHANNEL: gl.constexpr = CFG[4]
    OPT: gl.constexpr = CFG[5]
    K_CHANNEL: gl.constexpr = CFG[6]
    HD: gl.constexpr = CFG[7]
    FAST_MAX: gl.constexpr = (OPT & 1) != 0
    PIPE: gl.constexpr = (OPT & 2) != 0
    FAST_RCP: gl.constexpr = (OPT & 4) != 0
    RECONSTRUCT: gl.constexpr = (OPT & 128) != 0
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    E4M3: gl.constexpr = e4m3_operands(OPT)
    gl.static_assert(
        not (E4M3 and (V_CHANNEL or K_CHANNEL or RECONSTRUCT or PIPE or HD != 128)),
        "E4M3 operands: token-wise K and V at head_dim 128",
    )
    acc_l: gl.constexpr = acc_layout(HS)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, _ = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i = st
    p_smem = p_bufs.index(C)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    MEMORY_ONLY: gl.constexpr = (OPT & 32) != 0
    if MEMORY_ONLY:  # timing ablation: stream the ring, no math (the output is garbage)
        mbarrier.arrive(empty.index(s))
        return m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i
    kw = _load_k_words(kw_bufs.index(s), CFG[2], HD)
    vw = _load_v_words(vw_bufs.index(s), V_BITS, HD, E4M3)
    ks, kz, zq = 0, 0, 0
    if K_CHANNEL and RECONSTRUCT:  # per channel, read before the stage is released
        ks, kz = _channel_scale_pairs(ks_bufs.index(2 * s), ks_bufs.index(2 * s + 1), HS)
        b_qk = qt_smem.permute((1, 0))
    elif K_CHANNEL:
        zq, b_qk = _channel_key_operand(ks_bufs, s, qt_smem, kfold, CFG)
    else:
        ks, kz = _scale_pairs(ks_bufs.index(s), HS)
        b_qk = qt_smem.permute((1, 0))
    if V_CHANNEL:
        # per channel of the tile's group: [128] in the rows of the PV accumulator
        vs, vz = _channel_scale_pairs(vs_bufs.index(2 * s), vs_bufs.index(2 * s + 1), HS)
    else:
        vs, vz = _scale_pairs(vs_bufs.index(s), HS)
    LATE_ARRIVE: gl.constexpr = (OPT & 8) != 0
    LAST_ARRIVE: gl.constexpr = (OPT & 65536) != 0  # race ablation: release at the tile's end
    if not (LATE_ARRIVE or LAST_ARRIVE):
        mbarrier.arrive(
            empty.index(s)
        )  # stage s may be refilled (Gluon puts a partition bar.sync first)
    if E4M3:  # the int32 fields stay the wait's deps; the E4M3 operand is their bytes
        kx = _k_fields_e4m3(kw, CFG[2], HD, scaled_extraction(OPT, CFG[2], HD))
        k_op = _k_operand_from_fields(kx, HS, CFG[2], HD)
    else:
        k_op = _page_k_operand(kw, ks, kz, magic, HS, CFG)

    mma_l: gl.constexpr = acc_layout(HS, 32 if E4M3 else 16)  # acc_l, for the instruction's k
    s_tok = warpgroup_mma(
        k_op,
        b_qk,
        gl.zeros([64, HS], gl.float32, mma_l),
        use_acc=False,
        is_async=True,
    )
    if LATE_ARRIVE:
        mbarrier.arrive(empty.index(s))  # after the QK wgmma is issued
    if E4M3:  # V's fields as the QK wait's deps: built while the QK product runs
        vx = _vt_fields_e4m3(vw, V_BITS, HD, SCALED_V)
    else:
        vt_op = _page_vt_operand(vw, vs, vz, magic, HS, CFG)  # meant to overlap the QK wgmma
    ratio = _value_ratio(vs, vz, V_CHANNEL, FAST_RCP)
    gl.static_assert(not (PIPE and (V_CHANNEL or RECONSTRUCT)))
    if PIPE:
        # waits for QK(i) and for PV(i-1), issued at the end of the previous tile
        s_acc, k_op, o_prev, vt_prev = warpgroup_mma_wait(0, deps=[s_tok, k_op, o_tok, vt_prev])
        acc = acc * alpha_prev[None, :] + o_prev
    elif E4M3:  # int32 deps: triton 3.6 rejects 8-bit ones (see _k_fields_e4m3)
        s_acc, kx, vx = warpgroup_mma_wait(0, deps=[s_tok, kx, vx])
        s_acc = gl.convert_layout(s_acc, acc_l, assert_trivial=True)
        vt_op = _vt_operand_from_fields(vx, HS, HD)
    else:
        s_acc, k_op = warpgroup_mma_wait(0, deps=[s_tok, k_op])

    sc = _key_logits(s_acc, ks, kz, zq, qsums, qk_scale, CFG)
    if MASKED:
        sc, vs, ratio = _mask_rows(sc, vs, ratio, t * 64, n_q, HS, V_CHANNEL)
    if E4M3:
        # the running max of S + log2 s'_V instead of S (any max keeps the softmax exact): then
        # P' = P s'_V <= 1 and 256 P' is in E4M3's range with its 3 bits where they count; P
        # itself may exceed 1 (by 1 / s'_V at most, capped at 2^64), harmless in fp32
        lg = gl.maximum(_lg2(vs), -64.0)
        m_new = gl.maximum(m_i, _col_max(sc + lg[:, None], HS, FAST_MAX))
    else:
        m_new = gl.maximum(m_i, _col_max(sc, HS, FAST_MAX))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[None, :])
    l_i = l_i * alpha[None, :] + p  # row sums reduced once after the loop
    if E4M3:
        # P'^ = e4m3(256 P s'_V); the product takes it against y = q 2^-9, i.e. sum P'^ q / 2.
        # With x = s (q - c) + (z + s c), c = (2^bits - 1) / 2 the middle code, the output is
        # sum P'^ q - c sum P'^ + sum P' (z/s + c): the offset term takes the unrounded fp32 P'
        # (E4M3 has no +128 in the product to cancel, design.md Note [offset cancellation]),
        # and P's rounding meets the centred codes q - c only, whatever the row's offset. With
        # the rounded P'^ in the offset term, a row with a large offset and a small range lost
        # its whole P z (review of session 7: 0.35 against bf16's 2.3e-3); with the fp32 P'
        # alone (no -c sum P'^), the uncentred q doubled the error on zero-mean rows.
        # z/s = 128 + z'/s' (the cache's bf16 constants, x = s' (q + 128) + z').
        C_MID: gl.constexpr = ((1 << V_BITS) - 1) / 2
        pv32 = p * (vs * 256.0)[:, None]
        pv = pv32.to(gl.float8e4nv)
        z_i = z_i * alpha[None, :] + pv32 * (0.5 + (ratio + C_MID) * 0.00390625)[:, None]
        zp_i = zp_i * alpha[None, :] + pv.to(gl.float32)  # 256 sum P'^, for the -c sum P'^
    elif V_CHANNEL or RECONSTRUCT:
        pv = p.to(gl.bfloat16)  # channel-wise V folds into the accumulator, after the product
    else:
        # operand-fold of token-wise V into P, offset term from the rounded P'
        pv = (p * vs[:, None]).to(gl.bfloat16)
        z_i = z_i * alpha[None, :] + pv.to(gl.float32) * ratio[:, None]
        if SCALED_V:  # sum of P' for the output's 128 (1 - 4^-a) sum(P') (see _consume)
            zp_i = zp_i * alpha[None, :] + pv.to(gl.float32)
    p_smem.store(gl.permute(pv, [1, 0]))  # P'^T [HS, 64]: K-major B operand
    fence_async_shared()
    if E4M3:  # its own wait below (the accumulator's layout names k = 32)
        pv_tok = warpgroup_mma(
            vt_op,
            p_smem.permute((1, 0)),
            gl.zeros([HD, HS], gl.float32, mma_l),
            use_acc=False,
            is_async=True,
        )
    else:
        o_tok = warpgroup_mma(
            vt_op,
            p_smem.permute((1, 0)),
            gl.zeros([HD, HS], gl.float32, acc_l),
            use_acc=False,
            is_async=True,
        )
    if V_CHANNEL and not RECONSTRUCT and (OPT & 32768) != 0:
        # race ablation: sum_n P'[n, h] in registers instead of the ones @ P' product
        o_t, vt_op = warpgroup_mma_wait(0, deps=[o_tok, vt_op])
        p_cols = gl.sum(pv.to(gl.float32), axis=0)
        acc = _channel_value_fold(acc, alpha, o_t, p_cols, vs, vz, HS, SCALED_V, True)
    elif V_CHANNEL and not RECONSTRUCT:
        # sum_n P'[n, h] from the same rounded P' (Note [offset cancellation]), by the tensor
        # core: ones [64, 64] @ P' gives it in every row, in the accumulator's columns
        ones = gl.full([64, 64], 1.0, gl.bfloat16, a_operand_layout(HS))
        sum_tok = warpgroup_mma(
            ones,
            p_smem.permute((1, 0)),
            gl.zeros([64, HS], gl.float32, acc_l),
            use_acc=False,
            is_async=True,
        )
        o_t, vt_op, p_sum, ones = warpgroup_mma_wait(0, deps=[o_tok, vt_op, sum_tok, ones])
        acc = _channel_value_fold(acc, alpha, o_t, p_sum, vs, vz, HS, SCALED_V, False)
    elif PIPE:
        alpha_prev = alpha
        vt_prev = vt_op
    else:
        if E4M3:
            o_t, vx = warpgroup_mma_wait(0, deps=[pv_tok, vx])
            o_t = gl.convert_layout(o_t, acc_l, assert_trivial=True)
        else:
            o_t, vt_op = warpgroup_mma_wait(0, deps=[o_tok, vt_op])
        acc = acc * alpha[None, :] + o_t  # fresh accumulator per tile, added in fp32
    if (OPT & 131072) != 0:  # race ablation: every shared access of the tile ordered here
        fence_async_shared()
        gl.thread_barrier()
    if LAST_ARRIVE:
        mbarrier.arrive(empty.index(s))
    return m_new, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i


@gluon.jit
def _tile_pair(i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr):
    """Two pages (128 tokens) of consumer C: tile t, its i-th, pages a and b of one ring stage.
    Per 128 tokens one stage wait and release, one cross-warp max exchange and one P' barrier
    (a page per tile passes each once per 64 tokens), and a channel-wise group is one tile, so
    K's fold runs once per group: 24-27% faster for channel-wise K, no faster for token-wise K
    (whose consumers are bound by ALU work and wgmma latency, not by the barriers;
    benchmarks/NOTES.md 16). The two QK products go to two [64, HS] accumulators; the two PV
    products of the tile chain on the tensor core (128 tokens, within Note [tensor-core
    accumulation]'s fresh-per-tile rule), added to the running O in fp32. Page b's operands
    are built after page a's products complete (consumer 0 has 104 registers)."""
    SPC: gl.constexpr = CFG[0]
    HS: gl.constexpr = CFG[1]
    V_BITS: gl.constexpr = CFG[3]
    V_CHANNEL: gl.constexpr = CFG[4]
    OPT: gl.constexpr = CFG[5]
    K_CHANNEL: gl.constexpr = CFG[6]
    HD: gl.constexpr = CFG[7]
    FAST_MAX: gl.constexpr = (OPT & 1) != 0
    FAST_RCP: gl.constexpr = (OPT & 4) != 0
    RECONSTRUCT: gl.constexpr = (OPT & 128) != 0
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    gl.static_assert((OPT & (2 | 8)) == 0, "deferred PV wait and late arrive: one-page tiles")
    gl.static_assert(not e4m3_operands(OPT), "E4M3 operands: one-page tiles")
    acc_l: gl.constexpr = acc_layout(HS)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, _ = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i = st
    pa_smem = p_bufs.index(2 * C)
    pb_smem = p_bufs.index(2 * C + 1)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    if (OPT & 32) != 0:  # memory-only timing ablation
        mbarrier.arrive(empty.index(s))
        return m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i
    # scales: page a's chunk at 2s, page b's at 2s + 1 (a channel-wise group's two chunks),
    # read after the QK products where the folds allow (registers: 104-112 per consumer thread)
    ks_a, kz_a, ks_b, kz_b, zq = 0, 0, 0, 0, 0
    if K_CHANNEL and RECONSTRUCT:
        ks_a, kz_a = _channel_scale_pairs(ks_bufs.index(2 * s), ks_bufs.index(2 * s + 1), HS)
        ks_b = ks_a
        kz_b = kz_a
        b_qk = qt_smem.permute((1, 0))
    elif K_CHANNEL:
        zq, b_qk = _channel_key_operand(ks_bufs, s, qt_smem, kfold, CFG)
    else:
        if RECONSTRUCT:
            ks_a, kz_a = _scale_pairs(ks_bufs.index(2 * s), HS)
            ks_b, kz_b = _scale_pairs(ks_bufs.index(2 * s + 1), HS)
        b_qk = qt_smem.permute((1, 0))
    zero = gl.zeros([64, HS], gl.float32, acc_l)
    K_BITS: gl.constexpr = CFG[2]
    kw_a = _load_k_words(kw_bufs.index(2 * s), K_BITS, HD)
    k_a = _page_k_operand(kw_a, ks_a, kz_a, magic, HS, CFG)
    sa_tok = warpgroup_mma(k_a, b_qk, zero, use_acc=False, is_async=True)
    sa_tok, k_a = warpgroup_mma_wait(0, deps=[sa_tok, k_a])
    kw_b = _load_k_words(kw_bufs.index(2 * s + 1), K_BITS, HD)
    k_b = _page_k_operand(kw_b, ks_b, kz_b, magic, HS, CFG)
    sb_tok = warpgroup_mma(k_b, b_qk, zero, use_acc=False, is_async=True)
    sa_acc, sb_acc, k_a, k_b = warpgroup_mma_wait(0, deps=[sa_tok, sb_tok, k_a, k_b])
    if not K_CHANNEL and not RECONSTRUCT:
        ks_a, kz_a = _scale_pairs(ks_bufs.index(2 * s), HS)
        ks_b, kz_b = _scale_pairs(ks_bufs.index(2 * s + 1), HS)
    if V_CHANNEL:
        vs_a, vz_a = _channel_scale_pairs(vs_bufs.index(2 * s), vs_bufs.index(2 * s + 1), HS)
        vs_b = vs_a
        vz_b = vz_a
    else:
        vs_a, vz_a = _scale_pairs(vs_bufs.index(2 * s), HS)
        vs_b, vz_b = _scale_pairs(vs_bufs.index(2 * s + 1), HS)
    ratio_a = _value_ratio(vs_a, vz_a, V_CHANNEL, FAST_RCP)
    ratio_b = _value_ratio(vs_b, vz_b, V_CHANNEL, FAST_RCP)

    sc_a = _key_logits(sa_acc, ks_a, kz_a, zq, qsums, qk_scale, CFG)
    sc_b = _key_logits(sb_acc, ks_b, kz_b, zq, qsums, qk_scale, CFG)
    if MASKED:
        sc_a, vs_a, ratio_a = _mask_rows(sc_a, vs_a, ratio_a, t * 128, n_q, HS, V_CHANNEL)
        sc_b, vs_b, ratio_b = _mask_rows(sc_b, vs_b, ratio_b, t * 128 + 64, n_q, HS, V_CHANNEL)
    m_new = gl.maximum(m_i, _col_max(gl.maximum(sc_a, sc_b), HS, FAST_MAX))
    alpha = gl.exp2(m_i - m_new)
    p_a = gl.exp2(sc_a - m_new[None, :])
    p_b = gl.exp2(sc_b - m_new[None, :])
    l_i = l_i * alpha[None, :] + (p_a + p_b)  # row sums reduced once after the loop
    if V_CHANNEL or RECONSTRUCT:
        pv_a = p_a.to(gl.bfloat16)
        pv_b = p_b.to(gl.bfloat16)
    else:  # operand-fold of token-wise V into P, offset term from the rounded P'
        pv_a = (p_a * vs_a[:, None]).to(gl.bfloat16)
        pv_b = (p_b * vs_b[:, None]).to(gl.bfloat16)
        z_i = z_i * alpha[None, :] + (
            pv_a.to(gl.float32) * ratio_a[:, None] + pv_b.to(gl.float32) * ratio_b[:, None]
        )
        if SCALED_V:
            zp_i = zp_i * alpha[None, :] + (pv_a.to(gl.float32) + pv_b.to(gl.float32))
    pa_smem.store(gl.permute(pv_a, [1, 0]))  # P'^T [HS, 64] per page: K-major B operands
    pb_smem.store(gl.permute(pv_b, [1, 0]))
    fence_async_shared()
    zero_o = gl.zeros([HD, HS], gl.float32, acc_l)
    vt_a = _page_vt_operand(
        _load_v_words(vw_bufs.index(2 * s), V_BITS, HD), vs_a, vz_a, magic, HS, CFG
    )
    o_tok = warpgroup_mma(vt_a, pa_smem.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    if not V_CHANNEL:  # page a's product done before page b's operand (104 registers)
        o_tok, vt_a = warpgroup_mma_wait(0, deps=[o_tok, vt_a])
    vw_b = _load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD)
    mbarrier.arrive(empty.index(s))  # every read of stage s is done (a partition bar.sync first)
    vt_b = _page_vt_operand(vw_b, vs_b, vz_b, magic, HS, CFG)
    o_tok = warpgroup_mma(vt_b, pb_smem.permute((1, 0)), o_tok, use_acc=True, is_async=True)
    if V_CHANNEL and not RECONSTRUCT:
        # sum_n P'[n, h] over both pages by the tensor core (see _tile)
        ones = gl.full([64, 64], 1.0, gl.bfloat16, a_operand_layout(HS))
        sum_tok = warpgroup_mma(ones, pa_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        sum_tok = warpgroup_mma(ones, pb_smem.permute((1, 0)), sum_tok, use_acc=True, is_async=True)
        o_t, vt_a, vt_b, p_sum, ones = warpgroup_mma_wait(
            0, deps=[o_tok, vt_a, vt_b, sum_tok, ones]
        )
        acc = _channel_value_fold(acc, alpha, o_t, p_sum, vs_a, vz_a, HS, SCALED_V)
    else:
        o_t, vt_a, vt_b = warpgroup_mma_wait(0, deps=[o_tok, vt_a, vt_b])
        acc = acc * alpha[None, :] + o_t  # fresh accumulator per tile, added in fp32
    return m_new, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i


@gluon.constexpr_function
def packed_heads(opt):
    """Whether two pages share one [64, HS] score tile (OPT 262144, two-page tiles, H <= HS / 2):
    page a's heads in columns 0..HS/2-1, page b's in HS/2.. (see _tile_pair_packed)."""
    return (opt & 262144) != 0


@gluon.jit
def _halves(a, b, HS: gl.constexpr):
    """[64] per-token values of pages a and b -> [64, HS] in the accumulator layout: page a's in
    the first HS / 2 columns, page b's in the rest (the packed score tile's columns)."""
    col = gl.arange(0, HS, layout=gl.SliceLayout(0, acc_layout(HS)))
    return gl.where((col < HS // 2)[None, :], a[:, None], b[:, None])


@gluon.jit
def _swap_halves(x):
    """x's column c <-> c ^ HS/2 for an accumulator-layout tensor with HS = 8: column bit 2 is
    lane bit 1 there, so one butterfly shuffle per register."""
    return gl.inline_asm_elementwise(
        "shfl.sync.bfly.b32 $0, $1, 2, 0x1f, -1;",
        "=f,f",
        [x],
        dtype=gl.float32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _pair_scales(ks_bufs, vs_bufs, s, HS: gl.constexpr):
    """The per-token (s', z') of K and V of stage s's pages a and b: ((ks, kz, vs, vz) of page a,
    the same of page b), each [64] in the accumulator's row layout (_pair_halves packs them)."""
    ks_a, kz_a = _scale_pairs(ks_bufs.index(2 * s), HS)
    ks_b, kz_b = _scale_pairs(ks_bufs.index(2 * s + 1), HS)
    vs_a, vz_a = _scale_pairs(vs_bufs.index(2 * s), HS)
    vs_b, vz_b = _scale_pairs(vs_bufs.index(2 * s + 1), HS)
    return (ks_a, kz_a, vs_a, vz_a), (ks_b, kz_b, vs_b, vz_b)


@gluon.jit
def _pair_halves(rows, HS: gl.constexpr):
    """_pair_scales' rows -> (ks, kz, vs, vz), each [64, HS] in the packed tile's columns (page
    a's in the first half)."""
    a, b = rows
    return (
        _halves(a[0], b[0], HS),
        _halves(a[1], b[1], HS),
        _halves(a[2], b[2], HS),
        _halves(a[3], b[3], HS),
    )


@gluon.jit
def _mask_pair_rows(sc, vs, vz, t, n_q, HS: gl.constexpr):
    """_mask_rows for a packed tile t (128 tokens): page a's rows in the first half of the
    columns, page b's (tokens 64 on) in the rest; (sc, vs, vz) with harmless V factors there."""
    acc_l: gl.constexpr = acc_layout(HS)
    col = gl.arange(0, HS, layout=gl.SliceLayout(0, acc_l))
    row = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    tok = t * 128 + row[:, None] + gl.where(col < HS // 2, 0, 64)[None, :]
    valid = tok < n_q
    return gl.where(valid, sc, -float("inf")), gl.where(valid, vs, 1.0), gl.where(valid, vz, 0.0)


@gluon.jit
def _store_pair_p(pa_smem, pb_smem, pv32, dtype: gl.constexpr, HS: gl.constexpr):
    """P'^T of a packed tile into page a's B operand (its columns, the rest zero) and page b's."""
    first = (gl.arange(0, HS, layout=gl.SliceLayout(0, acc_layout(HS))) < HS // 2)[None, :]
    pa_smem.store(gl.permute(gl.where(first, pv32, 0.0).to(dtype), [1, 0]))
    pb_smem.store(gl.permute(gl.where(first, 0.0, pv32).to(dtype), [1, 0]))


@gluon.jit
def _tile_pair_packed(i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr):
    """Two pages (128 tokens, one ring stage) of consumer C with E4M3 operands and their scores in
    ONE [64, HS] tile: page a's QK product against Q^ in columns 0..H-1 (qa), page b's chained
    into the same accumulator against Q^ in columns HS/2..HS/2+H-1 (qb). With H <= HS / 2 the
    wgmma's N = 8 columns are otherwise half padding, so the softmax side (logit folds, max,
    exp2, P', the running sums; about half of the one-page loop) runs once per 128 tokens
    instead of twice. Column c holds head c % (HS/2) of page c // (HS/2); the running max of a
    head is kept equal in its two columns (pair max by one shuffle), and _consume adds the
    two columns of each head once per split. P' goes to two buffers, page a's columns in pa
    (the rest zero) and page b's in pb, so that the two PV products chained into one
    accumulator leave page a's output in columns < HS/2 and page b's in the rest."""
    SPC: gl.constexpr = CFG[0]
    HS: gl.constexpr = CFG[1]
    K_BITS: gl.constexpr = CFG[2]
    V_BITS: gl.constexpr = CFG[3]
    OPT: gl.constexpr = CFG[5]
    HD: gl.constexpr = CFG[7]
    FAST_MAX: gl.constexpr = (OPT & 1) != 0
    FAST_RCP: gl.constexpr = (OPT & 4) != 0
    gl.static_assert(e4m3_operands(OPT) and HS == 8 and CFG[9] <= HS // 2)
    gl.static_assert(not (CFG[4] or CFG[6]), "packed heads: token-wise K and V")
    SCALED_K: gl.constexpr = scaled_extraction(OPT, K_BITS, HD)
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    acc_l: gl.constexpr = acc_layout(HS)
    mma_l: gl.constexpr = acc_layout(HS, 32)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i = st
    pa_smem = p_bufs.index(2 * C)
    pb_smem = p_bufs.index(2 * C + 1)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    if (OPT & 32) != 0:  # memory-only timing ablation
        mbarrier.arrive(empty.index(s))
        return m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i
    kx_a = _k_fields_e4m3(_load_k_words(kw_bufs.index(2 * s), K_BITS, HD), K_BITS, HD, SCALED_K)
    s_tok = warpgroup_mma(
        _k_operand_from_fields(kx_a, HS, K_BITS, HD),
        qt_smem.permute((1, 0)),
        gl.zeros([64, HS], gl.float32, mma_l),
        use_acc=False,
        is_async=True,
    )
    SERIAL: gl.constexpr = V_BITS == 4  # INT4's registers: one K operand, V words read late
    if SERIAL:  # page a's K operand released before page b's is built
        s_tok, kx_a = warpgroup_mma_wait(0, deps=[s_tok, kx_a])
    kx_b = _k_fields_e4m3(_load_k_words(kw_bufs.index(2 * s + 1), K_BITS, HD), K_BITS, HD, SCALED_K)
    s_tok = warpgroup_mma(
        _k_operand_from_fields(kx_b, HS, K_BITS, HD),
        qb_smem.permute((1, 0)),
        s_tok,
        use_acc=True,
        is_async=True,
    )
    # INT2 V words (8 registers for both pages) are read before the release; INT4's (16) after
    # the softmax, the stage held that much longer (at 112 registers INT4 spilled 22 bytes)
    EARLY_V: gl.constexpr = not SERIAL
    if EARLY_V:
        vw_a = _load_v_words(vw_bufs.index(2 * s), V_BITS, HD, True)
        vw_b = _load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD, True)
    rows = _pair_scales(ks_bufs, vs_bufs, s, HS)
    if EARLY_V:
        mbarrier.arrive(empty.index(s))  # every read of stage s is done (a bar.sync first)
    s_acc, kx_a, kx_b = warpgroup_mma_wait(0, deps=[s_tok, kx_a, kx_b])
    s_acc = gl.convert_layout(s_acc, acc_l, assert_trivial=True)
    ks, kz, vs, vz = _pair_halves(rows, HS)  # the per-token factors, page a's columns first
    sc = _key_logits(s_acc, ks, kz, 0, qsums, qk_scale, CFG)
    if MASKED:
        sc, vs, vz = _mask_pair_rows(sc, vs, vz, t, n_q, HS)
    ratio = _value_ratio(vs, vz, False, FAST_RCP)
    # the running max of S + log2 s'_V (see _tile), over both pages: the columns' maxima, then
    # each head's two columns (pages a and b) by one shuffle
    cmax = _col_max(sc + gl.maximum(_lg2(vs), -64.0), HS, FAST_MAX)
    m_new = gl.maximum(m_i, gl.maximum(cmax, _swap_halves(cmax)))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[None, :])
    l_i = l_i * alpha[None, :] + p
    C_MID: gl.constexpr = ((1 << V_BITS) - 1) / 2
    pv32 = p * (vs * 256.0)
    pv = pv32.to(gl.float8e4nv)
    z_i = z_i * alpha[None, :] + pv32 * (0.5 + (ratio + C_MID) * 0.00390625)
    zp_i = zp_i * alpha[None, :] + pv.to(gl.float32)
    _store_pair_p(pa_smem, pb_smem, pv32, gl.float8e4nv, HS)
    fence_async_shared()
    if not EARLY_V:
        vw_a = _load_v_words(vw_bufs.index(2 * s), V_BITS, HD, True)
        vw_b = _load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD, True)
        mbarrier.arrive(empty.index(s))
    vx_a = _vt_fields_e4m3(vw_a, V_BITS, HD, SCALED_V)
    pv_tok = warpgroup_mma(
        _vt_operand_from_fields(vx_a, HS, HD),
        pa_smem.permute((1, 0)),
        gl.zeros([HD, HS], gl.float32, mma_l),
        use_acc=False,
        is_async=True,
    )
    vx_b = _vt_fields_e4m3(vw_b, V_BITS, HD, SCALED_V)
    pv_tok = warpgroup_mma(
        _vt_operand_from_fields(vx_b, HS, HD),
        pb_smem.permute((1, 0)),
        pv_tok,
        use_acc=True,
        is_async=True,
    )
    o_t, vx_a, vx_b = warpgroup_mma_wait(0, deps=[pv_tok, vx_a, vx_b])
    acc = acc * alpha[None, :] + gl.convert_layout(o_t, acc_l, assert_trivial=True)
    return m_new, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i


@gluon.jit
def _tile_pair_packed_bf16(
    i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr
):
    """_tile_pair_packed with bf16 operands (mantissa injection, token-wise K and V): two pages'
    scores in one [64, HS] tile. Each page's K (and V) operand takes 32 registers, so page a's
    product completes before page b's operand is built (112 registers per consumer thread)."""
    SPC: gl.constexpr = CFG[0]
    HS: gl.constexpr = CFG[1]
    K_BITS: gl.constexpr = CFG[2]
    V_BITS: gl.constexpr = CFG[3]
    OPT: gl.constexpr = CFG[5]
    HD: gl.constexpr = CFG[7]
    FAST_MAX: gl.constexpr = (OPT & 1) != 0
    FAST_RCP: gl.constexpr = (OPT & 4) != 0
    gl.static_assert(not e4m3_operands(OPT) and HS == 8 and CFG[9] <= HS // 2)
    gl.static_assert(not (CFG[4] or CFG[6] or (OPT & 128) != 0), "packed heads: token-wise, folds")
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    acc_l: gl.constexpr = acc_layout(HS)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i = st
    pa_smem = p_bufs.index(2 * C)
    pb_smem = p_bufs.index(2 * C + 1)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    if (OPT & 32) != 0:  # memory-only timing ablation
        mbarrier.arrive(empty.index(s))
        return m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i
    zero = gl.zeros([64, HS], gl.float32, acc_l)
    k_a = _page_k_operand(_load_k_words(kw_bufs.index(2 * s), K_BITS, HD), 0, 0, magic, HS, CFG)
    s_tok = warpgroup_mma(k_a, qt_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    s_tok, k_a = warpgroup_mma_wait(0, deps=[s_tok, k_a])
    k_b = _page_k_operand(_load_k_words(kw_bufs.index(2 * s + 1), K_BITS, HD), 0, 0, magic, HS, CFG)
    s_tok = warpgroup_mma(k_b, qb_smem.permute((1, 0)), s_tok, use_acc=True, is_async=True)
    rows = _pair_scales(ks_bufs, vs_bufs, s, HS)
    s_acc, k_b = warpgroup_mma_wait(0, deps=[s_tok, k_b])
    ks, kz, vs, vz = _pair_halves(rows, HS)  # the per-token factors, page a's columns first
    sc = _key_logits(s_acc, ks, kz, 0, qsums, qk_scale, CFG)
    if MASKED:
        sc, vs, vz = _mask_pair_rows(sc, vs, vz, t, n_q, HS)
    ratio = _value_ratio(vs, vz, False, FAST_RCP)
    cmax = _col_max(sc, HS, FAST_MAX)
    m_new = gl.maximum(m_i, gl.maximum(cmax, _swap_halves(cmax)))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[None, :])
    l_i = l_i * alpha[None, :] + p
    pv = (p * vs).to(gl.bfloat16)  # operand-fold of token-wise V into P
    pv32 = pv.to(gl.float32)
    z_i = z_i * alpha[None, :] + pv32 * ratio
    if SCALED_V:
        zp_i = zp_i * alpha[None, :] + pv32
    _store_pair_p(pa_smem, pb_smem, pv32, gl.bfloat16, HS)
    fence_async_shared()
    zero_o = gl.zeros([HD, HS], gl.float32, acc_l)
    vt_a = _page_vt_operand(_load_v_words(vw_bufs.index(2 * s), V_BITS, HD), 0, 0, magic, HS, CFG)
    pv_tok = warpgroup_mma(vt_a, pa_smem.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    pv_tok, vt_a = warpgroup_mma_wait(0, deps=[pv_tok, vt_a])
    vw_b = _load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD)
    mbarrier.arrive(empty.index(s))  # every read of stage s is done (a partition bar.sync first)
    vt_b = _page_vt_operand(vw_b, 0, 0, magic, HS, CFG)  # (the folds: no per-value factors)
    pv_tok = warpgroup_mma(vt_b, pb_smem.permute((1, 0)), pv_tok, use_acc=True, is_async=True)
    o_t, vt_b = warpgroup_mma_wait(0, deps=[pv_tok, vt_b])
    acc = acc * alpha[None, :] + o_t
    return m_new, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i


@gluon.jit
def _step(i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr):
    """Tile t, consumer C's i-th, of one page or two (CFG's TP), packed heads or not; ops = (ring,
    qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem)."""
    if packed_heads(CFG[5]) and e4m3_operands(CFG[5]):
        st = _tile_pair_packed(i, t, n_q, st, ops, C, CFG, MASKED)
    elif packed_heads(CFG[5]):
        st = _tile_pair_packed_bf16(i, t, n_q, st, ops, C, CFG, MASKED)
    elif CFG[8] == 2:
        st = _tile_pair(i, t, n_q, st, ops, C, CFG, MASKED)
    else:
        st = _tile(i, t, n_q, st, ops, C, CFG, MASKED)
    return st


@gluon.jit
def _consume(C: gl.constexpr, ring, q_args, op_bufs, split, qk_scale, magic, CFG: gl.constexpr):
    """Consumer C's loop over tiles t_begin + C + 2i; returns (m, l, unnormalised O^T [D, HS]).
    q_args: (q_ptr, stride_q_b, stride_q_h) for _stage_q (OPT 2048); split: (seq_ptrs,
    num_splits) for _split_span; op_bufs: (P'^T per page, channel-wise K's Q' and zq, Q^T and
    its per-head factor) buffers of both consumers; CFG: (SPC, HS, K_BITS, V_BITS, V_CHANNEL,
    OPT, K_CHANNEL, HD, TP, H)."""
    TP: gl.constexpr = CFG[8]
    HS: gl.constexpr = CFG[1]
    OPT: gl.constexpr = CFG[5]
    K_CHANNEL: gl.constexpr = CFG[6]
    HD: gl.constexpr = CFG[7]
    PIPE: gl.constexpr = (OPT & 2) != 0
    acc_l: gl.constexpr = acc_layout(HS)
    p_bufs, kq_bufs, zq_bufs, qt_bufs, hf_bufs = op_bufs
    QC: gl.constexpr = q_in_consumers(OPT)
    QI: gl.constexpr = C if QC else 0  # this consumer's Q^T buffer (the prologue fills 0)
    qt_smem = qt_bufs.index(QI)
    hf_smem = hf_bufs.slice(QI * HS, HS)
    PACKED: gl.constexpr = packed_heads(OPT)
    gl.static_assert(not PACKED or QC, "packed heads: each consumer stages its Q")
    qb_smem = qt_bufs.index(2 + QI) if PACKED else qt_smem  # Q^ in columns HS/2.. (packed)
    if QC:  # Q's load overlaps the producer's first copies; the 4 warps then see all of Q^T
        _stage_q(*q_args, qt_smem, hf_smem, CFG, qb_smem)
        fence_async_shared()
        gl.thread_barrier()
    t_begin, t_full, t_end, n_q, _ = _split_span(*split, TP, OPT)
    E4M3: gl.constexpr = e4m3_operands(OPT)
    SCALED_K: gl.constexpr = scaled_extraction(OPT, CFG[2], HD) and not K_CHANNEL
    SCALED_V: gl.constexpr = scaled_extraction(OPT, CFG[3], HD) and not CFG[4]
    ql: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    qf = qt_smem.load(ql).to(gl.float32)  # Q, or Q~ = Q 4^-a with the scaled extraction
    if PACKED:  # column c of the score tile: head c % (HS / 2), from qa or qb
        qf = qf + qb_smem.load(ql).to(gl.float32)
    if E4M3:  # qf = Q^ 2^sigma 4^-a per column (see the kernel): sum(Q^) and hf = 2^(9 - sigma)
        k = gl.arange(0, HD, layout=gl.SliceLayout(0, ql))
        if SCALED_K:
            qf = qf * _pow4((k // 16) % 2, False)[None, :]
        hf = hf_smem.load(gl.SliceLayout(0, acc_l))
        q_sum = gl.convert_layout(gl.sum(qf, axis=1), gl.SliceLayout(0, acc_l)) * hf * (1 / 512)
        dq = hf
    elif SCALED_K:
        c = gl.arange(0, HD, layout=gl.SliceLayout(0, ql))
        q_sum = gl.sum(qf * _pow4(_scaled_exponent_k(c), False)[None, :], axis=1)
        dq = gl.convert_layout(128.0 * (q_sum - gl.sum(qf, axis=1)), gl.SliceLayout(0, acc_l))
    else:
        q_sum = gl.sum(qf, axis=1)
        dq = 0
    qsums = (
        gl.convert_layout(q_sum, gl.SliceLayout(0, acc_l)) * qk_scale,
        dq,
    )  # (E4M3: see _key_logits)
    if K_CHANNEL:  # this consumer's Q' and zq buffers
        kfold = (kq_bufs.index(C), zq_bufs.slice(C * HS, HS))
    else:
        kfold = (0, 0)
    acc = gl.zeros([HD, HS], gl.float32, acc_l)
    st = (
        gl.full([HS], -float("inf"), gl.float32, gl.SliceLayout(0, acc_l)),
        gl.zeros([64, HS], gl.float32, acc_l),
        gl.zeros([64, HS], gl.float32, acc_l),
        acc,
        warpgroup_mma_init(acc),
        gl.full([HS], 1.0, gl.float32, gl.SliceLayout(0, acc_l)),
        gl.zeros([HD, 64], gl.bfloat16, a_operand_layout(HS)),
        gl.zeros([64, HS], gl.float32, acc_l),  # sum of P' (scaled token-wise V only)
    )
    n_all = gl.maximum(t_end - t_begin - C + 1, 0) // 2
    n_full = gl.maximum(t_full - t_begin - C + 1, 0) // 2
    ops = (ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem)
    for i in range(n_full):
        st = _step(i, t_begin + C + 2 * i, n_q, st, ops, C, CFG, False)
    if n_full < n_all:  # the last tile, partly past the history
        st = _step(n_full, t_begin + C + 2 * n_full, n_q, st, ops, C, CFG, True)
    m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev, zp_i = st
    if PIPE:
        o_prev, vt_prev = warpgroup_mma_wait(0, deps=[o_tok, vt_prev])
        acc = acc * alpha_prev[None, :] + o_prev
    l_tot = gl.sum(l_i, axis=0)
    num = acc + gl.sum(z_i, axis=0)[None, :]  # V offset term: one scalar per head for g = D
    if E4M3:  # acc = sum P'^ q 4^a / 2 (E4M3 y = q 4^a 2^-9 against 256 P'^); see _tile
        c = gl.arange(0, HD, layout=gl.SliceLayout(1, acc_l))
        if SCALED_V:
            vfac = 2.0 * _pow4((c // 8) % 2, True)
        else:
            vfac = gl.full([HD], 2.0, gl.float32, gl.SliceLayout(1, acc_l))
        C_MID: gl.constexpr = ((1 << CFG[3]) - 1) / 2
        offset = gl.sum(z_i, axis=0) - (C_MID / 256) * gl.sum(zp_i, axis=0)
        num = acc * vfac[:, None] + offset[None, :]
    elif SCALED_V:  # acc holds sum_n P' y~, y~ = 128 + 4^a q: O = acc 4^-a + 128 (1 - 4^-a) sum P'
        c = gl.arange(0, HD, layout=gl.SliceLayout(1, acc_l))
        inv = _pow4(_scaled_exponent_v(c), True)
        p_tot = gl.sum(zp_i, axis=0)
        num = acc * inv[:, None] + (128.0 * (1.0 - inv))[:, None] * p_tot[None, :]
        num = num + gl.sum(z_i, axis=0)[None, :]
    if PACKED:  # each head's two columns (pages a and b, one running max) added
        num = num + _swap_halves(num)
        l_tot = l_tot + _swap_halves(l_tot)
    return m_i, l_tot, num


@gluon.jit
def _consumer1(ring, q_args, op_bufs, merge_bufs, split, qk_scale, magic, CFG: gl.constexpr):
    """Consumer 1 leaves its state in shared memory; the kernel merges it after the partitions
    join (the join is a CTA barrier, so no mbarrier hand-off is needed)."""
    m_smem, l_smem, o_smem = merge_bufs
    m1, l1, num1 = _consume(1, ring, q_args, op_bufs, split, qk_scale, magic, CFG)
    m_smem.store(m1)
    l_smem.store(l1)
    o_smem.store(num1)


@gluon.jit
def _consumer0(ring, q_args, op_bufs, split, qk_scale, magic, CFG: gl.constexpr):
    return _consume(0, ring, q_args, op_bufs, split, qk_scale, magic, CFG)


@gluon.constexpr_function
def q_in_consumers(opt):
    """Whether each consumer stages Q itself (OPT 2048) instead of the prologue."""
    return (opt & 2048) != 0


@gluon.constexpr_function
def merge_pdl(opt):
    """Whether the merge is a programmatic dependent launch of this kernel (OPT 8192)."""
    return (opt & 8192) != 0


@gluon.jit
def _stage_q(q_ptr, stride_q_b, stride_q_h, qt_smem, hf_smem, CFG: gl.constexpr, qb_smem=0):
    """Q [HS, D] of this CTA's KV head into ``qt_smem`` as the QK product's operand, K-major (its
    transposed view is the B operand; heads past H are zero), and the per-head factor into
    ``hf_smem`` (E4M3: 2^(9 - sigma); bf16: 1). The caller fences and synchronizes.
    B operands are stored K-major (MN-major B with 16-byte rows read out of bounds on the H200:
    compute-sanitizer, session 3). Packed heads (OPT 262144): row c holds head c % (HS / 2), in
    ``qt_smem`` for the first HS / 2 rows (page a's columns) and in ``qb_smem`` for the rest,
    the other rows zero; ``hf_smem`` per row."""
    HS: gl.constexpr = CFG[1]
    K_BITS: gl.constexpr = CFG[2]
    OPT: gl.constexpr = CFG[5]
    K_CHANNEL: gl.constexpr = CFG[6]
    HD: gl.constexpr = CFG[7]
    H: gl.constexpr = CFG[9]
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    h_row = gl.arange(0, HS, layout=gl.SliceLayout(1, ql))
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, ql))
    E4M3: gl.constexpr = e4m3_operands(OPT)
    PACKED: gl.constexpr = packed_heads(OPT)
    h = h_row % (HS // 2) if PACKED else h_row
    # E4M3: column d holds channel _e4m3_key_channel(d) (the K operand's column order)
    q_cols = _e4m3_key_channel(d, K_BITS) if E4M3 else d
    # E4M3: rows past H load row h % H and are zeroed by a product below, not by a masked
    # load: with the load's constant zeros, all of a padding row's E4M3 pairs are one value,
    # and ptxas (triton 3.6.0's) packs such a pair with the upper half taken from a register
    # never written (F2FP.E4M3 ..._MERGE_C Rd, Ra, Ra, R3), so the stored row held junk
    # (session 10's nonzero rows; racecheck's write-write hazard between the lanes that store it)
    qt = gl.load(
        q_ptr
        + b * stride_q_b
        + (kvh * H + (h % H if E4M3 else h))[:, None] * stride_q_h
        + q_cols[None, :],
        mask=None if E4M3 else (h < H)[:, None],
        other=None if E4M3 else 0.0,
    )
    if E4M3:
        # Q^ = e4m3(Q 4^-a 2^sigma) per head: sigma = 134 - (biased exponent of max |Q|), so the
        # head's largest value lands in [128, 256) of E4M3's 448; hf = 2^(9 - sigma) scales the
        # product back (_key_logits). Heads past H (zero) keep sigma = 127
        qf = qt.to(gl.float32)
        qf = gl.where((h < H)[:, None], qf, qf * 0.0)
        if scaled_extraction(OPT, K_BITS, HD):
            qf = qf * _pow4((d // 16) % 2, True)[None, :]
        amax = gl.max(gl.abs(qf), axis=1)
        ebits = gl.minimum(
            gl.maximum(261 - ((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF), 1), 254
        )
        q8 = qf * (ebits << 23).to(gl.float32, bitcast=True)[:, None]
        if PACKED:
            # the zero halves from a product, not a constant (the ptxas pairing above: with
            # constant zeros these rows read back nonzero on the H200, s10-print)
            first = (h_row < HS // 2)[:, None]
            zero = q8 * 0.0
            qt_smem.store(gl.where(first, q8, zero).to(gl.float8e4nv))
            qb_smem.store(gl.where(first, zero, q8).to(gl.float8e4nv))
        else:
            qt_smem.store(q8.to(gl.float8e4nv))
        hf_smem.store(((263 - ebits) << 23).to(gl.float32, bitcast=True))
    else:
        if scaled_extraction(OPT, K_BITS, HD) and not K_CHANNEL:  # Q~ = Q 4^-a, exact in bf16
            qt = (qt.to(gl.float32) * _pow4(_scaled_exponent_k(d), True)[None, :]).to(gl.bfloat16)
        if PACKED:  # the zero halves from a product (see the E4M3 branch)
            first = (h_row < HS // 2)[:, None]
            zero = qt * 0.0
            qt_smem.store(gl.where(first, qt, zero))
            qb_smem.store(gl.where(first, zero, qt))
        else:
            qt_smem.store(qt)
        hf_smem.store(gl.full([HS], 1.0, gl.float32, gl.SliceLayout(1, ql)))


@gluon.jit
def _merge_consumers(m0, l0, num0, m_smem, l_smem, o_smem, HS: gl.constexpr):
    """Merge consumer 1's state (shared memory) into consumer 0's: (o [D, HS] normalised,
    lse [HS] in the log2 domain, -inf when empty)."""
    acc_l: gl.constexpr = acc_layout(HS)
    m1 = m_smem.load(gl.SliceLayout(0, acc_l))
    l1 = l_smem.load(gl.SliceLayout(0, acc_l))
    num1 = o_smem.load(acc_l)
    m = gl.maximum(m0, m1)
    m_safe = gl.where(m == -float("inf"), 0.0, m)
    a0 = gl.exp2(m0 - m_safe)
    a1 = gl.exp2(m1 - m_safe)
    l_tot = l0 * a0 + l1 * a1
    num = num0 * a0[None, :] + num1 * a1[None, :]
    o = num / gl.where(l_tot > 0, l_tot, 1.0)[None, :]
    lse = gl.where(l_tot > 0, m + gl.log2(gl.where(l_tot > 0, l_tot, 1.0)), -float("inf"))
    return o, lse


@gluon.jit
def _store_heads(o, o_base, stride_o_h, H: gl.constexpr, HS: gl.constexpr):
    """o [D, HS] (acc layout) to ``o_base + h * stride_o_h + d`` for the H real heads, converted
    to the pointer's element type."""
    acc_l: gl.constexpr = acc_layout(HS)
    d = gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, acc_l))
    h = gl.arange(0, HS, layout=gl.SliceLayout(0, acc_l))
    gl.store(
        o_base + h[None, :] * stride_o_h + d[:, None],
        o.to(o_base.dtype.element_ty),
        mask=(h < H)[None, :],
    )


# ------------------------------------------------------------------------------------- producer
@gluon.jit
def _producer(descs, ring, kv_indices_ptr, split, CFG: gl.constexpr):
    kw_desc, ks_desc, vw_desc, vs_desc = descs
    TP: gl.constexpr = CFG[8]
    OPT: gl.constexpr = CFG[5]
    PS: gl.constexpr = CFG[10]
    if PS != UNIT:
        _producer_units(descs, ring, kv_indices_ptr, split, CFG)
        return
    t_begin, _, t_end, n_q, page_base = _split_span(*split, TP, OPT)
    kvh = gl.program_id(1)
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    SPC: gl.constexpr = CFG[0]
    V_CHANNEL: gl.constexpr = CFG[4]
    K_CHANNEL: gl.constexpr = CFG[6]
    COMPUTE_ONLY: gl.constexpr = (OPT & 64) != 0
    # a stage: TP pages of words, and TP scale chunks of each role (one-page tiles of a
    # channel-wise role take both chunks of the page's 2-page group)
    nbytes: gl.constexpr = (
        (kw_desc.block_type.nbytes + vw_desc.block_type.nbytes) * TP
        + ks_desc.block_type.nbytes * (2 if K_CHANNEL else TP)
        + vs_desc.block_type.nbytes * (2 if V_CHANNEL else TP)
    )
    n = t_end - t_begin
    idx = kv_indices_ptr + page_base + TP * t_begin
    page_next = gl.load(idx, mask=n > 0, other=0)
    if TP == 2:  # page b of the last tile may lie past the history: page a again (masked rows)
        n_pages = gl.cdiv(n_q, 64)
        pb_next = gl.load(idx + 1, mask=(n > 0) & (TP * t_begin + 1 < n_pages), other=page_next)
    elif V_CHANNEL or K_CHANNEL:  # the other page of tile t's 2-page group, t ^ 1, one tile ahead
        sib_next = gl.load(kv_indices_ptr + page_base + (t_begin ^ 1), mask=n > 0, other=0)
    for j in range(n):
        # the page indices of tile j+1 are loaded one iteration ahead: their latency overlaps the
        # wait for a free stage instead of delaying the TMA issue
        page = page_next
        page_next = gl.load(idx + TP * (j + 1), mask=j + 1 < n, other=0)
        if TP == 2:
            page_b = pb_next
            pb_ok = (j + 1 < n) & (TP * (t_begin + j + 1) + 1 < n_pages)
            pb_next = gl.load(idx + TP * (j + 1) + 1, mask=pb_ok, other=page_next)
        elif V_CHANNEL or K_CHANNEL:
            sib = sib_next
            t_next = t_begin + j + 1
            sib_next = gl.load(kv_indices_ptr + page_base + (t_next ^ 1), mask=j + 1 < n, other=0)
        i = j // 2
        s = (j % 2) * SPC + i % SPC
        mbarrier.wait(empty.index(s), ((i // SPC) & 1) ^ 1)  # fresh barriers pass phase 1
        bar = ready.index(s)
        if COMPUTE_ONLY and j >= 2 * SPC:
            mbarrier.arrive(bar)  # timing ablation: consumers recompute stale stages, no HBM
        elif TP == 2:
            # pages a, b: words at 2s, 2s + 1; scale chunks likewise (for a channel-wise role
            # the tile is its group, so these are the group's two chunks)
            mbarrier.expect(bar, nbytes)
            _copy_page(descs, (kw_bufs, ks_bufs, vw_bufs, vs_bufs), page, kvh, 2 * s, 2 * s, bar)
            _copy_page(
                descs, (kw_bufs, ks_bufs, vw_bufs, vs_bufs), page_b, kvh, 2 * s + 1, 2 * s + 1, bar
            )
        else:
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(kw_desc, [page, kvh, 0, 0], bar, kw_bufs.index(s))
            tma.async_copy_global_to_shared(vw_desc, [page, kvh, 0, 0], bar, vw_bufs.index(s))
            if V_CHANNEL or K_CHANNEL:
                # a channel-wise group of 128 tokens keeps its 128 (s', z') pairs in the
                # scale chunks of its two pages (foscar.cache): both, for either tile
                odd = (t_begin + j) % 2
                g0 = page + (sib - page) * odd  # the group's first page
                g1 = sib + (page - sib) * odd
            if K_CHANNEL:
                tma.async_copy_global_to_shared(ks_desc, [g0, kvh, 0], bar, ks_bufs.index(2 * s))
                tma.async_copy_global_to_shared(
                    ks_desc, [g1, kvh, 0], bar, ks_bufs.index(2 * s + 1)
                )
            else:
                tma.async_copy_global_to_shared(ks_desc, [page, kvh, 0], bar, ks_bufs.index(s))
            if V_CHANNEL:
                tma.async_copy_global_to_shared(vs_desc, [g0, kvh, 0], bar, vs_bufs.index(2 * s))
                tma.async_copy_global_to_shared(
                    vs_desc, [g1, kvh, 0], bar, vs_bufs.index(2 * s + 1)
                )
            else:
                tma.async_copy_global_to_shared(vs_desc, [page, kvh, 0], bar, vs_bufs.index(s))


@gluon.constexpr_function
def _part_row(c, copies, rows):
    """The first buffer row of copy c (of ``copies`` per 64-token unit, ``rows`` each)."""
    return (c % copies) * rows


@gluon.jit
def _producer_units(descs, ring, kv_indices_ptr, split, CFG: gl.constexpr):
    """The producer for a cache page size PS other than the tile's 64 tokens (token-wise K and
    V): a stage still holds TP 64-token units, each its rows of one page (PS > 64: unit u is
    rows 64 (u % (PS / 64)) of page u // (PS / 64)) or 64 / PS whole pages copied into row
    slices of the unit's buffers (PS < 64). A tile's page indices are one vector load, issued
    before the wait for its stage. Units and pages past the history repeat the last one (the
    consumers mask those rows)."""
    kw_desc, ks_desc, vw_desc, vs_desc = descs
    TP: gl.constexpr = CFG[8]
    OPT: gl.constexpr = CFG[5]
    PS: gl.constexpr = CFG[10]
    SPC: gl.constexpr = CFG[0]
    gl.static_assert(not (CFG[4] or CFG[6]), "page sizes other than 64: token-wise K and V")
    t_begin, _, t_end, n_q, page_base = _split_span(*split, TP, OPT)
    kvh = gl.program_id(1)
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    COMPUTE_ONLY: gl.constexpr = (OPT & 64) != 0
    ROWS: gl.constexpr = PS if PS < UNIT else UNIT  # rows of one copy
    COPIES: gl.constexpr = UNIT // ROWS  # copies per unit and role
    UPP: gl.constexpr = PS // UNIT if PS > UNIT else 1  # units per page
    NP: gl.constexpr = TP * COPIES  # pages (or page parts) a tile
    nbytes: gl.constexpr = (
        kw_desc.block_type.nbytes
        + vw_desc.block_type.nbytes
        + ks_desc.block_type.nbytes
        + vs_desc.block_type.nbytes
    ) * NP
    last_unit = gl.cdiv(n_q, UNIT) - 1
    last_page = gl.cdiv(n_q, PS) - 1  # (PS < 64)
    k = gl.arange(0, NP, layout=gl.BlockedLayout([1], [32], [1], [0]))
    for j in range(t_end - t_begin):
        i = j // 2
        s = (j % 2) * SPC + i % SPC
        bar = ready.index(s)
        # copy k of the tile: unit k // COPIES, its page part k % COPIES
        unit = gl.minimum(TP * (t_begin + j) + k // COPIES, last_unit)
        if PS < UNIT:
            page = gl.minimum(unit * COPIES + k % COPIES, last_page)
        else:
            page = unit // UPP
        pages = gl.load(kv_indices_ptr + page_base + page)
        rows = (unit % UPP) * UNIT  # the unit's first row in its page (PS > 64)
        mbarrier.wait(empty.index(s), ((i // SPC) & 1) ^ 1)  # fresh barriers pass phase 1
        if COMPUTE_ONLY and j >= 2 * SPC:
            mbarrier.arrive(bar)  # timing ablation: consumers recompute stale stages, no HBM
        else:
            mbarrier.expect(bar, nbytes)
            for c in gl.static_range(NP):
                pg = gl.sum(gl.where(k == c, pages, 0), axis=0)
                row = gl.sum(gl.where(k == c, rows, 0), axis=0)
                w = TP * s + c // COPIES
                # its rows in the unit's buffers: _part_row(c, COPIES, ROWS) of the words, twice
                # that of the scales
                tma.async_copy_global_to_shared(
                    kw_desc,
                    [pg, kvh, row, 0],
                    bar,
                    kw_bufs.index(w).slice(_part_row(c, COPIES, ROWS), ROWS, 2),
                )
                tma.async_copy_global_to_shared(
                    vw_desc,
                    [pg, kvh, row, 0],
                    bar,
                    vw_bufs.index(w).slice(_part_row(c, COPIES, ROWS), ROWS, 2),
                )
                tma.async_copy_global_to_shared(
                    ks_desc,
                    [pg, kvh, 2 * row],
                    bar,
                    ks_bufs.index(w).slice(_part_row(c, COPIES, 2 * ROWS), 2 * ROWS, 2),
                )
                tma.async_copy_global_to_shared(
                    vs_desc,
                    [pg, kvh, 2 * row],
                    bar,
                    vs_bufs.index(w).slice(_part_row(c, COPIES, 2 * ROWS), 2 * ROWS, 2),
                )


@gluon.jit
def _copy_page(descs, bufs, page, kvh, w_idx, s_idx, bar):
    """TMA copies of one page (K and V words, K and V scale chunks) into the given buffers."""
    kw_desc, ks_desc, vw_desc, vs_desc = descs
    kw_bufs, ks_bufs, vw_bufs, vs_bufs = bufs
    tma.async_copy_global_to_shared(kw_desc, [page, kvh, 0, 0], bar, kw_bufs.index(w_idx))
    tma.async_copy_global_to_shared(vw_desc, [page, kvh, 0, 0], bar, vw_bufs.index(w_idx))
    tma.async_copy_global_to_shared(ks_desc, [page, kvh, 0], bar, ks_bufs.index(s_idx))
    tma.async_copy_global_to_shared(vs_desc, [page, kvh, 0], bar, vs_bufs.index(s_idx))


# --------------------------------------------------------------------------------------- kernel
@gluon.jit
def gluon_decode_split_kernel(
    q_ptr,  # [B, Hq, D] bf16
    kw_desc,  # k_words [pages, Hkv, PS, W] int32, box [1, 1, min(PS, 64), W]
    ks_desc,  # k_scales viewed [pages, Hkv, 2*PS] fp32, box [1, 1, 2 min(PS, 64)]
    vw_desc,
    vs_desc,
    kv_indptr_ptr,  # [B + 1] int32
    kv_indices_ptr,  # [nnz] int32
    num_quantized_ptr,  # [B] int32
    o_part_ptr,  # [B, Hq, num_splits (+1), D] fp32
    lse_part_ptr,  # [B, Hq, num_splits (+1)] fp32, log2 domain
    qk_scale,  # sm_scale * log2(e)
    magic,  # 0x43004300
    num_splits,
    stride_q_b,
    stride_q_h,
    stride_op_b,
    stride_op_h,
    stride_op_split,
    stride_lp_b,
    stride_lp_h,
    out_ptr,  # [B, Hq, D] (q's dtype): the output, written here when num_parts == 1
    lse_out_ptr,  # [B, Hq] fp32, natural log (when num_parts == 1 and write_lse)
    num_parts,  # num_splits + the window partial, if any
    write_lse,
    stride_o_b,
    stride_o_h,
    stride_lo_b,
    stride_lo_h,
    H: gl.constexpr,  # query heads per KV head
    HS: gl.constexpr,  # padded: the wgmma N (8 or 16)
    K_BITS: gl.constexpr,  # 2 or 4
    V_BITS: gl.constexpr,
    V_CHANNEL: gl.constexpr,  # channel-wise V groups of 128 tokens (else token-wise, g = D)
    K_CHANNEL: gl.constexpr,  # channel-wise K groups of 128 tokens (else token-wise, g = D)
    HD: gl.constexpr,  # head_dim: 128, or 64 (token-wise K and V only)
    SPC: gl.constexpr,  # ring stages per consumer (2 x SPC in all)
    TP: gl.constexpr,  # pages per tile and stage: 1, or 2 (one channel-wise group)
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    OPT: gl.constexpr,  # see the consumer section
    PS: gl.constexpr = 64,  # the cache's page size: 64, or 16-256 for token-wise K and V
):
    gl.static_assert(HS >= H)
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)

    # ---- shared memory: the ring, Q^T, P' per consumer, merge buffers, barriers
    NS: gl.constexpr = 2 * SPC
    gl.static_assert(TP == 1 or TP == 2)
    # a unit of 64 tokens per buffer (the TMA box holds fewer rows when the page does: PS < 64)
    kw_bufs = gl.allocate_shared_memory(
        gl.int32, [NS * TP, 1, 1, UNIT, HD * K_BITS // 32], kw_desc.layout
    )
    vw_bufs = gl.allocate_shared_memory(
        gl.int32, [NS * TP, 1, 1, UNIT, HD * V_BITS // 32], vw_desc.layout
    )
    # scale chunks a stage: TP, or two for a channel-wise role (its group's)
    KSB: gl.constexpr = NS * (2 if K_CHANNEL else TP)
    ks_bufs = gl.allocate_shared_memory(gl.float32, [KSB, 1, 1, 2 * UNIT], ks_desc.layout)
    VSB: gl.constexpr = NS * (2 if V_CHANNEL else TP)
    vs_bufs = gl.allocate_shared_memory(gl.float32, [VSB, 1, 1, 2 * UNIT], vs_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    # Q^T [HS, D] per consumer (the prologue's, in buffer 0, unless each consumer stages its own:
    # OPT 2048) and its per-head factor
    op_dtype: gl.constexpr = gl.float8e4nv if e4m3_operands(OPT) else gl.bfloat16
    qt_bufs = gl.allocate_shared_memory(  # packed heads: each consumer's qb at 2 + C
        op_dtype,
        [4 if packed_heads(OPT) else 2, HS, HD],
        gl.NVMMASharedLayout.get_default_for([HS, HD], op_dtype),
    )
    hf_bufs = gl.allocate_shared_memory(gl.float32, [2 * HS], plain_shared_layout(1))
    CFG: gl.constexpr = (SPC, HS, K_BITS, V_BITS, V_CHANNEL, OPT, K_CHANNEL, HD, TP, H, PS)
    q_args = (q_ptr, stride_q_b, stride_q_h)
    if not q_in_consumers(OPT):
        _stage_q(*q_args, qt_bufs.index(0), hf_bufs.slice(0, HS), CFG)
    p_bufs = gl.allocate_shared_memory(  # P'^T of each consumer's pages
        op_dtype, [2 * TP, HS, 64], gl.NVMMASharedLayout.get_default_for([HS, 64], op_dtype)
    )
    # channel-wise K: each consumer's Q' [HS, 128] (the QK product's B operand, built per tile)
    # and its offsets zq [HS]
    KQB: gl.constexpr = 2 if K_CHANNEL else 1
    kq_bufs = gl.allocate_shared_memory(
        gl.bfloat16, [KQB, HS, 128], gl.NVMMASharedLayout.get_default_for([HS, 128], gl.bfloat16)
    )
    zq_bufs = gl.allocate_shared_memory(gl.float32, [KQB * HS], plain_shared_layout(1))
    m_smem = gl.allocate_shared_memory(gl.float32, [HS], plain_shared_layout(1))
    l_smem = gl.allocate_shared_memory(gl.float32, [HS], plain_shared_layout(1))
    o_smem = gl.allocate_shared_memory(gl.float32, [HD, HS], plain_shared_layout(2))
    fence_async_shared()

    o_base = o_part_ptr + b * stride_op_b + (kvh * H) * stride_op_h + split * stride_op_split
    lse_base = lse_part_ptr + b * stride_lp_b + (kvh * H) * stride_lp_h + split

    ring = (kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty)
    descs = (kw_desc, ks_desc, vw_desc, vs_desc)
    split_args = ((kv_indptr_ptr, num_quantized_ptr), num_splits)  # _split_span in each partition
    gl.static_assert(HD == 128 or not (K_CHANNEL or V_CHANNEL))
    op_bufs = (p_bufs, kq_bufs, zq_bufs, qt_bufs, hf_bufs)
    m0, l0, num0 = gl.warp_specialize(
        [
            (_consumer0, (ring, q_args, op_bufs, split_args, qk_scale, magic, CFG)),
            (
                _consumer1,
                (
                    ring,
                    q_args,
                    op_bufs,
                    (m_smem, l_smem, o_smem),
                    split_args,
                    qk_scale,
                    magic,
                    CFG,
                ),
            ),
            (
                _producer,
                (descs, ring, kv_indices_ptr, split_args, CFG),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    o, lse = _merge_consumers(m0, l0, num0, m_smem, l_smem, o_smem, HS)
    hh = gl.arange(0, HS, layout=gl.SliceLayout(0, acc_layout(HS)))
    if num_parts == 1:  # one split and no window partial: this split is the output
        # as the merge of one part: a sequence without tokens (lse -inf) gives NaN there
        no_tokens = lse == -float("inf")
        o = gl.where(no_tokens[None, :], float("nan"), o)
        _store_heads(o, out_ptr + b * stride_o_b + (kvh * H) * stride_o_h, stride_o_h, H, HS)
        gl.store(
            lse_out_ptr + b * stride_lo_b + (kvh * H + hh) * stride_lo_h,
            gl.where(no_tokens, float("nan"), lse * 0.6931471805599453),
            mask=(hh < H) & (write_lse != 0),
        )
    else:  # a partial for the merge
        _store_heads(o, o_base, stride_op_h, H, HS)
        gl.store(lse_base + hh * stride_lp_h, lse, mask=hh < H)
        if merge_pdl(OPT):
            # the merge, launched as a programmatic dependent, may launch once every CTA is
            # here (it waits for this grid's writes, griddepcontrol.wait, before reading them)
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // $0",
                "=r",
                [],
                dtype=gl.int32,
                is_pure=False,
                pack=1,
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
