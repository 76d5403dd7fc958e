"""Operand programs of the Triton decode kernel (foscar.kernels.triton_decode): packed words ->
bf16 matrix-unit operands, the column helpers of the products, and channel-wise K's fold of Q.

Math: a code q becomes y = q + 128 by mantissa injection, ``((x >> BITS f) & mask) | magic``
with magic = 0x43004300 (two bf16 128.0): one SHF and one LOP3 per two operands; a V^T operand
pairs two tokens of one channel in a register (one PRMT joins their containers first).

Data contract: words ``[BLOCK_N, D * BITS / 32]`` int32 in foscar.formats' channel orders (role
"key": channel 8 (u PAIRS + k) + 2 T + j in word T U + u at bit BITS k + 16 j; role "value": a
row cut into 32 pieces of BITS * D / 32 bits); product columns ``(j, h)``: a column block j (a
channel group of token-wise K / V, a token group of channel-wise ones) times the HS padded heads.

Supported: BITS 2 and 4, D 64 and 128, under the interpreter too (``INTERP``: fp32 operands and
integer emulations of PRMT and of the bf16 rounding, the interpreter's bf16 arithmetic being
wrong). Not: other bit widths.
"""

import triton
import triton.language as tl


# ---------------------------------------------------------------------------- bits -> operands
@triton.jit
def round_bf16(x, INTERP: tl.constexpr):
    """Round fp32 to the nearest bf16 (ties to even), returned as fp32 values."""
    if INTERP:
        u = x.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
        return u.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def fast_div(x, y, INTERP: tl.constexpr):
    """``x / y`` by reciprocal approximation (MUFU.RCP + FMUL; 2 ulp), exact in the interpreter."""
    if INTERP:
        return x / y
    else:
        return tl.extra.cuda.libdevice.fast_dividef(x, y)


@triton.jit
def to_operand(x, INTERP: tl.constexpr):
    """fp32 values already exact in bf16 -> the matrix-unit operand dtype."""
    if INTERP:
        return x
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _bf16_halves(x, INTERP: tl.constexpr):
    """int32 holding two bf16 (low, high) -> the two halves; free register views in SASS."""
    if INTERP:
        lo = (x << 16).to(tl.float32, bitcast=True)
        hi = (x & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _inject(x, magic, FIELDS: tl.constexpr, BITS: tl.constexpr):
    """``[A, B] int32 -> [A, B, FIELDS] int32``: ``((x >> BITS*f) & mask) | magic``.

    One SHF and one LOP3 per two bf16 operands (``magic = 0x43004300`` arrives as a runtime
    argument so that the mask-and-merge is a single LOP3).
    """
    f = tl.arange(0, FIELDS)
    mask = ((1 << BITS) - 1) * 0x00010001
    return ((tl.expand_dims(x, 2) >> (f * BITS)[None, None, :]) & mask) | magic


@triton.jit
def k_operand(
    words, magic, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, INTERP: tl.constexpr
):
    """K operand ``[BLOCK_N, D]`` (natural channel order) from words ``[BLOCK_N, D*BITS/32]``.

    Channel ``8*(u*PAIRS + k) + 2*T + j`` sits in word ``T*U + u`` at bit ``BITS*k + 16*j``.
    """
    WORDS: tl.constexpr = D * BITS // 32
    PAIRS: tl.constexpr = 16 // BITS
    U: tl.constexpr = WORDS // 4
    x = _inject(words, magic, PAIRS, BITS)  # [N, WORDS, PAIRS]
    lo, hi = _bf16_halves(x, INTERP)
    y = tl.join(lo, hi).reshape(BLOCK_N, 4, U, PAIRS, 2)  # [N, T, u, k, j]
    return tl.permute(y, (0, 2, 3, 1, 4)).reshape(BLOCK_N, D)


@triton.jit
def _prmt(a, b, X, CB: tl.constexpr, INTERP: tl.constexpr):
    """Container ``X`` (CB = 8 or 16 bits) of ``a`` into the low half, of ``b`` into the high."""
    if INTERP:
        cmask = (1 << CB) - 1
        return ((a >> (X * CB)) & cmask) | (((b >> (X * CB)) & cmask) << 16)
    else:
        if CB == 8:
            sel = X | (X << 4) | ((X + 4) << 8) | ((X + 4) << 12)
        else:
            sel = (2 * X) | ((2 * X + 1) << 4) | ((2 * X + 4) << 8) | ((2 * X + 5) << 12)
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, sel],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def vt_operand(
    words, magic, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, INTERP: tl.constexpr
):
    """V^T operand ``[D, BLOCK_N]`` (natural order) from words ``[BLOCK_N, D*BITS/32]``.

    The wgmma fragment pairs two consecutive tokens of one channel in a register, so one PRMT
    joins the same container of an even and an odd token before the shift-and-merge.
    """
    WORDS: tl.constexpr = D * BITS // 32
    PB: tl.constexpr = BITS * D // 32  # bits of one piece (the D/32 channels of one (w, g))
    CB: tl.constexpr = 16 if PB == 16 else 8  # PRMT container: a byte or a half-word
    NX: tl.constexpr = 32 // CB
    F: tl.constexpr = CB // BITS
    w2 = tl.permute(words.reshape(BLOCK_N // 2, 2, WORDS), (0, 2, 1))
    even, odd = tl.split(w2)  # [N/2, WORDS]
    x = _prmt(even[:, :, None], odd[:, :, None], tl.arange(0, NX)[None, None, :], CB, INTERP)
    x = _inject(x.reshape(BLOCK_N // 2, WORDS * NX), magic, F, BITS)  # [m, containers, F]
    lo, hi = _bf16_halves(x, INTERP)
    # (container, field) enumerates (piece 8w + g, field 2b + a) row-major; J = token parity
    y = tl.join(lo, hi).reshape(BLOCK_N // 2, 4, 8, D // 64, 2, 2)  # [m, w, g, b, a, J]
    y = tl.permute(y, (3, 1, 4, 2, 0, 5))  # [b, w, a, g, m, J]
    return y.reshape(D, BLOCK_N)


# ---------------------------------------------------------------------------- column helpers
@triton.jit
def _first_half_cols(x):
    """``[R, 2C] -> [R, C]``: columns ``0..C-1`` (the high column bit is a register bit)."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1] // 2
    a, _ = tl.split(tl.permute(x.reshape(R, 2, C), (0, 2, 1)))
    return a


@triton.jit
def pad_cols(x, WIDTH: tl.constexpr, fill: tl.constexpr):
    """``[R, C] -> [R, WIDTH]`` with ``WIDTH`` = C or 2C, new columns set to ``fill``."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    if WIDTH == C:
        return x
    else:
        tl.static_assert(WIDTH == 2 * C)
        return tl.permute(tl.join(x, tl.zeros_like(x) + fill), (0, 2, 1)).reshape(R, WIDTH)


@triton.jit
def pick_block(x, block, NB: tl.constexpr, HS: tl.constexpr):
    """``x: [R, W]`` with columns ``(j, h)`` -> ``[R, HS]`` taking block ``block[r]`` of row r."""
    R: tl.constexpr = x.shape[0]
    if NB == 1:
        if x.shape[1] == HS:
            return x
        else:
            return _first_half_cols(x)
    else:
        x3 = x.reshape(R, NB, HS)
        sel = tl.arange(0, NB)[None, :, None] == block[:, None, None]
        return tl.sum(tl.where(sel, x3, 0.0), axis=1)


@triton.jit
def spread_cols(x, y, NB: tl.constexpr, HS: tl.constexpr, WIDTH: tl.constexpr):
    """``x: [R, HS], y: [R, NB] -> [R, WIDTH]`` with column ``(j, h) = x[:, h] * y[:, j]``."""
    R: tl.constexpr = x.shape[0]
    z = (x[:, None, :] * y[:, :, None]).reshape(R, NB * HS)
    return pad_cols(z, WIDTH, 0.0)


# ---------------------------------------------------------------------------- folds
@triton.jit
def fold_channel_k(qt, ks, kz, HPK: tl.constexpr, INTERP: tl.constexpr):
    """Channel-wise K operand-fold into Q for the token groups ``j`` of ``ks, kz: [D, NT]``.

    ``qt = c * Q^T [D, HS]`` -> ``Qx [D, HPK]`` operand with ``Qx[:, (j, h)] = bf16(qt[:, h] *
    s'_j)`` and the offset correction ``[1, HPK]`` ``sum_d Qx[d, (j, h)] * z'_j[d] / s'_j[d]``
    from the rounded Qx (Note [offset cancellation]); padded columns are zero.
    """
    D: tl.constexpr = qt.shape[0]
    HS: tl.constexpr = qt.shape[1]
    NT: tl.constexpr = ks.shape[1]
    qs = round_bf16(qt[:, None, :] * ks[:, :, None], INTERP)  # [D, NT, HS]
    corr = tl.sum(qs * fast_div(kz, ks, INTERP)[:, :, None], axis=0)  # [NT, HS]
    qx = to_operand(pad_cols(qs.reshape(D, NT * HS), HPK, 0.0), INTERP)
    return qx, pad_cols(corr.reshape(1, NT * HS), HPK, 0.0)
