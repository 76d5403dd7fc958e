"""Operand programs of the Gluon decode kernel: packed words -> wgmma A operands in registers.

Math: a code q of a word becomes the bf16 operand y = 128 + q by mantissa injection (one shift
and one LOP3 per bf16 pair: ``((x >> b f) & mask) | 0x43004300``), or the E4M3 operand q 2^-9
(four codes per shift and mask); the folds apply x = s' y + z' outside the products.

Data contract: words ``[64 tokens, W = head_dim * bits / 32]`` int32 as the TMA ring holds them,
in foscar.formats' channel orders (role "key": a thread's rows and words are the m64n8
accumulator's; role "value": a row cut into 32 pieces of bits * head_dim / 32 bits); scale
chunks ``[128]`` fp32 as (s', z') pairs per token (token-wise) or per channel of a 128-token
group over two pages (channel-wise). Every ``convert_layout(..., assert_trivial=True)`` is a
compile-time proof that the bit operations land each value in the register the m64nNk16 (bf16)
or m64nNk32 (E4M3) A fragment wants: the layouts of foscar.kernels.gluon.layouts.

``CFG``: the kernel's compile-time configuration, read by field name
(foscar.kernels.gluon.layouts.TileConfig).

Supported: INT2/INT4, head_dim 128 and 64 (bf16; a head_dim-64 INT2 V piece is a nibble), E4M3
at head_dim 128 with token-wise K and V; the scaled INT2 extraction (GluonFlag.SCALED_INT2) at
head_dim 128; the reconstruct ablation (GluonFlag.RECONSTRUCT) on bf16 operands. Not: other
bit widths, E4M3 with channel-wise groups or head_dim 64.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .layouts import (
    a_operand_layout,
    acc_layout,
    k_chunk_scale_layout,
    k_words3_layout,
    q_fold_layout,
    reconstructs,
    scale_pair_layout,
    scaled_extraction,
    v_e4m3_layout,
    v_words4_layout,
    v_words_e4m3_load_layout,
    v_words_load_layout,
)


# ------------------------------------------------------------------------ bf16 operands
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
def scaled_exponent_k(c):
    """Scaled extraction (INT2): key channel c is field k = (c // 8) % 8 of its word half
    (foscar.formats.kernel_bit_location); after a shift by 6 (k // 3) it sits at mantissa bits
    2 (k % 3), so its operand is 128 + 4^(k % 3) q. Returns k % 3."""
    return ((c // 8) % 8) % 3


@gluon.jit
def scaled_exponent_v(c):
    """Scaled extraction (INT2, head_dim 128): value channel c is field f = 2 (c // 64) + (c // 8)
    % 2 of its byte piece; its operand is 128 + 4^(f % 3) q. Returns f % 3."""
    return (2 * (c // 64) + (c // 8) % 2) % 3


@gluon.jit
def pow4(a, inverse: gl.constexpr):
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


# ------------------------------------------------------------------------ E4M3 operands
# The paper's Blackwell mapping on Hopper's FP8 wgmma (m64nNk32, e4m3 x e4m3 -> fp32): a code q in
# the low bits of a byte is the E4M3 value q 2^-9 (subnormal up to 7, exact up to 15), so one
# shift and one mask make four operands. The kernel reads the bf16-layout cache as it is: its
# K words hold a thread's channels in another order than the E4M3 fragment's columns, and the
# reduction over channels does not care, so Q is stored in the operand's column order
# (e4m3_key_channel); V^T's columns are tokens in natural order, so P' needs no permutation.
# Q and P' are per-head scaled E4M3 copies (Q: a power of two per head, P': 256 P' with P' <= 1).
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
def e4m3_key_channel(k, BITS: gl.constexpr):
    """The key channel in column k of the E4M3 K operand (and of Q's E4M3 copy): column k = b + 4T
    + 16 (f + NF e) is byte b of extraction f (NF = 8 / BITS per word) of the thread's word e,
    i.e. field NF (b % 2) + f of half b // 2 of word E T + e (foscar.formats role "key")."""
    NF: gl.constexpr = 8 // BITS
    b = k % 4
    idx = k // 16
    return 16 * NF * (idx // NF) + 8 * NF * (b % 2) + 8 * (idx % NF) + 2 * ((k // 4) % 4) + b // 2


@gluon.jit
def k_fields_e4m3(words, BITS: gl.constexpr, HD: gl.constexpr, SCALED: gl.constexpr):
    """The int32 registers of the E4M3 K operand: [64 tokens, W words, NF extractions] from
    words [64, W] in SliceLayout(2, k_words3_layout(BITS, HD)), NF = 8 / BITS per word (INT2
    scaled: 1 shift and 4 masks per 16 codes). k_operand_from_fields views them as E4M3; the
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
def k_operand_from_fields(x, HS: gl.constexpr, BITS: gl.constexpr, HD: gl.constexpr):
    """K operand [64 tokens, HD columns] E4M3 in the wgmma A layout (k_width 4), columns in
    e4m3_key_channel's order: the bytes of k_fields_e4m3's registers (no instructions)."""
    E: gl.constexpr = HD * BITS // 128
    NF: gl.constexpr = 8 // BITS
    y = _bytes4(x).reshape([64, 4, E, NF, 4])  # n, T, e, f, b
    y = gl.permute(y, [0, 2, 3, 1, 4])  # n, e, f, T, b: column b + 4T + 16 (f + NF e)
    return gl.convert_layout(y.reshape([64, HD]), a_operand_layout(HS, 4), assert_trivial=True)


@gluon.jit
def vt_fields_e4m3(words, BITS: gl.constexpr, HD: gl.constexpr, SCALED: gl.constexpr):
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
def vt_operand_from_fields(x, HS: gl.constexpr, HD: gl.constexpr):
    """V^T operand [HD channels, 64 tokens] E4M3 in the wgmma A layout (k_width 4): the bytes of
    vt_fields_e4m3's registers (no instructions)."""
    # quad 8 kb + 4 i' + T, piece 8w + g = word PW + X, field 2b + a = hb NFB + fb, token byte j
    y = _bytes4(x).reshape([2, 2, 4, 4, 8, 2, 2, 4])  # kb, i', T, w, g, b, a, j
    y = gl.permute(y, [5, 3, 6, 4, 0, 1, 2, 7])  # b, w, a, g | kb, i', T, j
    return gl.convert_layout(y.reshape([HD, 64]), a_operand_layout(HS, 4), assert_trivial=True)


# ------------------------------------------------------------------------ scales and folds
@gluon.jit
def scale_pairs(buf, HS: gl.constexpr):
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
def channel_scale_pairs(buf0, buf1, HS: gl.constexpr):
    """(s', z') of the 128 channels of a channel-wise group (channels 0-63 in the chunk of its
    first page, 64-127 in its second), each [128] in the rows of the [128, HS] accumulator (V's
    fold; channel-wise K's reconstruct ablation converts them to K's columns)."""
    s0, z0 = scale_pairs(buf0, HS)
    s1, z1 = scale_pairs(buf1, HS)
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
    SCALED: gl.constexpr = False,
):
    """Channel-wise K (a group of 128 tokens, channels 0-63 in the scale chunk of its first page,
    64-127 in its second): Q' = bf16(Q s'_c) into q_smem, the B operand of the tile's QK product
    over the zero-offset codes q, and the offset zq[h] = sum_c Q'_c (128 + z'_c / s'_c) into
    zq_smem, so that S = Q' . q + zq = sum_c (Q'_c / s'_c) x_c (x = s' (q + 128) + z'): the logit
    of a Q rounded to bf16, whose error scales with x. An offset from the unrounded Q (sum_c Q_c
    (z'_c + 128 s'_c)) leaves the error of Q' times s' q, up to the group's range: 2.5x larger,
    over the 5e-3 bar at 32K on the H200. The +128 stays out of the product and cancels in fp32
    here. Q is read from qt_smem per tile (held in registers across the loop it made the KcVc
    consumer spill 232 bytes). zq reaches the accumulator's columns through zq_smem."""
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
        inv = pow4(scaled_exponent_k(gl.arange(0, 128, layout=col_l)), True)
        q_smem.store((qb.to(gl.float32) * inv[None, :]).to(gl.bfloat16))
    else:
        q_smem.store(qb)
    zq = gl.sum(qb.to(gl.float32) * (128.0 + gl.fdiv(z, s))[None, :], axis=1)  # [8]
    zq_smem.store(zq)
    fence_async_shared()
    return zq_smem.load(gl.SliceLayout(0, acc_layout(HS)))


@gluon.jit
def channel_key_operand(ks_bufs, s, qt_smem, kfold, CFG: gl.constexpr):
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
        CFG.HS,
        scaled_extraction(CFG.OPT, CFG.K_BITS, CFG.HD),
    )
    return zq, q_smem.permute((1, 0))


# ------------------------------------------------------------------------ one page
@gluon.jit
def load_k_words(buf, BITS: gl.constexpr, HD: gl.constexpr):
    """One page's packed K words [64, W] as _k_operand takes them."""
    return buf.reshape([64, HD * BITS // 32]).load(gl.SliceLayout(2, k_words3_layout(BITS, HD)))


@gluon.jit
def load_v_words(buf, BITS: gl.constexpr, HD: gl.constexpr, E4M3: gl.constexpr = False):
    """One page's packed V words [64, W] as _vt_operand (or vt_fields_e4m3) takes them."""
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
def page_k_operand(words, ks, kz, magic, HS: gl.constexpr, CFG: gl.constexpr):
    """K operand [64 tokens, HD] of one page's words (reconstructed in the ablation)."""
    K_BITS: gl.constexpr = CFG.K_BITS
    K_CHANNEL: gl.constexpr = CFG.K_CHANNEL
    HD: gl.constexpr = CFG.HD
    RECONSTRUCT: gl.constexpr = reconstructs(CFG.OPT)
    SCALED: gl.constexpr = scaled_extraction(CFG.OPT, K_BITS, HD)
    k_op = _k_operand(words, magic, HS, K_BITS, HD, K_CHANNEL and not RECONSTRUCT, SCALED)
    if RECONSTRUCT:  # token-wise: the rows of K; channel-wise: its columns
        k_op = _reconstruct(k_op, ks, kz, not K_CHANNEL, HS)
    return k_op


@gluon.jit
def page_vt_operand(words, vs, vz, magic, HS: gl.constexpr, CFG: gl.constexpr):
    """V^T operand [HD, 64 tokens] of one page's words (reconstructed in the ablation)."""
    V_BITS: gl.constexpr = CFG.V_BITS
    V_CHANNEL: gl.constexpr = CFG.V_CHANNEL
    HD: gl.constexpr = CFG.HD
    vt_op = _vt_operand(words, magic, HS, V_BITS, HD, scaled_extraction(CFG.OPT, V_BITS, HD))
    if reconstructs(CFG.OPT):  # channel-wise: the rows of V^T; token-wise: its columns
        vt_op = _reconstruct(vt_op, vs, vz, V_CHANNEL, HS)
    return vt_op
