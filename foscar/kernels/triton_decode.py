"""Split-KV paged decode attention over INT2/INT4 KV caches with affine folding (Triton).

Math, for one sequence, one KV head and its H query heads, in the log2 domain (c = sm_scale*log2 e):
    S[n, h] = c * sum_d Q[h, d] * (s'_K * y_K + z'_K)[n, d]      y = q + 128, built from the bits
    P = exp2(S - m);   O[h, :] = sum_n P[n, h] * (s'_V * y_V + z'_V)[n, :] / sum_n P[n, h]
The scales and offsets are never applied per value (design.md): token-wise K acc-folds into the
QK partials, channel-wise K operand-folds into Q, token-wise V operand-folds into P, channel-wise
V acc-folds into group-local PV partials; every offset correction is computed from the operand
the matrix unit consumed (Note [offset cancellation]).

Formulation (docs/design.md has the SASS study behind it): tokens are the M dimension of
both products and the K and V^T operands are built in registers as the wgmma A operand,
    part[n, (j, h)]  = K_op[n, :] @ Qx[:, (j, h)]        Qx: Q spread over column blocks
    acc[c, (j, h)]  += V_op^T[c, :] @ P'[:, (j, h)]      P': P folded and rounded to bf16
where a column block ``j`` is a channel group (token-wise K / V) or a token group of the tile
(channel-wise K / V) and ``h`` a query head padded to HS >= 8, so that one MMA computes every
group-local partial product at once.

Data contract (foscar.cache, foscar.formats):
    q:        [B, Hq, D] bf16
    k_words:  [pages, Hkv, PAGE, D*K_BITS/32] int32, channel order of role "key"
    k_scales: [pages, Hkv, PAGE*D/K_GROUP, 2] fp32 (s', z') pairs
    v_*:      likewise (role "value")
    k_sink:   [slots, Hkv, SINK, D] bf16; k_tail: [slots, Hkv, TAIL, D] bf16 (ring)
    o_part:   [B, Hq, num_splits + HAS_WINDOWS, D] fp32, normalised partial outputs
    lse_part: [B, Hq, num_splits + HAS_WINDOWS] fp32, log2-domain LSE (-inf when empty)
    num_quantized: [B] int32, the history length; a multiple of every channel-wise group size
              (foscar.cache demotes KVFormat.demotion_quantum tokens at a time): with
              channel-wise K groups longer than BLOCK_N the loop runs whole groups only
Supports: K_BITS, V_BITS in {2, 4}; D in {64, 128}; any group size the cache stores; any
H <= 16; BLOCK_N in {32, 64, 128} with PAGE a multiple or divisor of BLOCK_N. INTERP runs the same
code under TRITON_INTERPRET=1 with fp32 operands (the interpreter's bf16 arithmetic is wrong).
RECONSTRUCT builds bf16(s*y + z) for every value instead of folding: the baseline that
KIVI/BitDecoding/OSCAR-style kernels use, kept in the same kernel to measure what folding gains.

Modules: this one holds the tile, the BF16 window program, the split kernel and the LSE merge of
the splits (``merge_splits_kernel``, also the Gluon backend's merge); the operand programs are in
foscar.kernels.triton_operands, the paged loads in foscar.kernels.triton_loads.
"""

import dataclasses

import triton
import triton.language as tl

from .triton_loads import (
    channel_scale_pages,
    channel_scales_at,
    load_scales,
    load_words,
    token_pages,
)
from .triton_operands import (
    fast_div,
    fold_channel_k,
    k_operand,
    pad_cols,
    pick_block,
    round_bf16,
    spread_cols,
    to_operand,
    vt_operand,
)

try:  # griddepcontrol.wait (programmatic dependent launch); older triton releases lack it
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - the merge is then never launched with PDL

    @triton.jit
    def gdc_wait():
        pass


_LN2 = tl.constexpr(0.6931471805599453)


# ---------------------------------------------------------------------------- one tile
TILE_FIELDS = (
    "HS",  # H padded (>= 8, power of two)
    "D",
    "PAGE",
    "BLOCK_N",
    "K_BITS",
    "V_BITS",
    "K_CHANNEL",
    "V_CHANNEL",
    "K_GROUP",
    "V_GROUP",
    "HPK",  # columns of the QK product: (column blocks x HS), at least 16
    "HPV",  # columns of the PV product
    "RECONSTRUCT",
    "INTERP",
    "TILE_ACC",  # token-wise V: a fresh PV accumulator per tile (Note [tensor-core accumulation])
)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """The split kernel's compile-time arguments that a tile reads, by field name (the kernel's
    constexprs of the same names)."""

    HS: int
    D: int
    PAGE: int
    BLOCK_N: int
    K_BITS: int
    V_BITS: int
    K_CHANNEL: bool
    V_CHANNEL: bool
    K_GROUP: int
    V_GROUP: int
    HPK: int
    HPV: int
    RECONSTRUCT: bool
    INTERP: bool
    TILE_ACC: bool

    def __repr__(self):
        # the constexpr's part of the mangled names of the functions that take it: letters,
        # digits and underscores only
        return "TileConfig_" + "_".join(f"{n}{int(getattr(self, n))}" for n in TILE_FIELDS)


@triton.constexpr_function
def tile_config(*values):
    """:class:`TileConfig` of the kernel's constexprs, in :data:`TILE_FIELDS` order."""
    return TileConfig(*values)


@triton.jit
def quantized_tile(
    t,
    state,
    qx,
    qsum_g,
    seq,  # (n_q, page_base, n_pages, kvh, magic, qk_scale, zero, q)
    ptrs,  # (kv_indices, k_words, k_scales, v_words, v_scales)
    strides,  # (k_words, k_scales, v_words, v_scales) x (page, head)
    CFG: tl.constexpr,  # TileConfig
    MASKED: tl.constexpr,
):
    HS: tl.constexpr = CFG.HS
    D: tl.constexpr = CFG.D
    PAGE: tl.constexpr = CFG.PAGE
    BLOCK_N: tl.constexpr = CFG.BLOCK_N
    K_BITS: tl.constexpr = CFG.K_BITS
    V_BITS: tl.constexpr = CFG.V_BITS
    K_CHANNEL: tl.constexpr = CFG.K_CHANNEL
    V_CHANNEL: tl.constexpr = CFG.V_CHANNEL
    K_GROUP: tl.constexpr = CFG.K_GROUP
    V_GROUP: tl.constexpr = CFG.V_GROUP
    HPK: tl.constexpr = CFG.HPK
    HPV: tl.constexpr = CFG.HPV
    RECONSTRUCT: tl.constexpr = CFG.RECONSTRUCT
    INTERP: tl.constexpr = CFG.INTERP
    TILE_ACC: tl.constexpr = CFG.TILE_ACC
    n_q, page_base, n_pages, kvh, magic, qk_scale, zero, q = seq
    m_i, l2, z2, acc, pf_s, pf_z, pf_page = state
    kv_indices_ptr, k_words_ptr, k_scales_ptr, v_words_ptr, v_scales_ptr = ptrs
    (
        stride_kw_page,
        stride_kw_head,
        stride_ks_page,
        stride_ks_head,
        stride_vw_page,
        stride_vw_head,
        stride_vs_page,
        stride_vs_head,
    ) = strides
    offs_n = tl.arange(0, BLOCK_N)
    valid = t * BLOCK_N + offs_n < n_q
    pages, row0 = token_pages(kv_indices_ptr, page_base, t, n_pages, PAGE, BLOCK_N, MASKED)
    kw = load_words(
        k_words_ptr,
        pages,
        row0,
        stride_kw_page,
        kvh * stride_kw_head,
        D * K_BITS // 32,
        PAGE,
        BLOCK_N,
    )
    vw = load_words(
        v_words_ptr,
        pages,
        row0,
        stride_vw_page,
        kvh * stride_vw_head,
        D * V_BITS // 32,
        PAGE,
        BLOCK_N,
    )
    NGK: tl.constexpr = D // K_GROUP
    NGV: tl.constexpr = D // V_GROUP
    NTK: tl.constexpr = BLOCK_N // K_GROUP if BLOCK_N > K_GROUP else 1
    NTV: tl.constexpr = BLOCK_N // V_GROUP if BLOCK_N > V_GROUP else 1
    tok_k = offs_n // K_GROUP if BLOCK_N > K_GROUP else offs_n * 0  # token group within tile
    tok_v = offs_n // V_GROUP if BLOCK_N > V_GROUP else offs_n * 0

    # channel-wise K groups longer than the tile: the caller folds Q once per group and
    # passes the operand as qx and the offset correction as qsum_g
    K_FOLD_ONCE: tl.constexpr = K_CHANNEL and (not RECONSTRUCT) and K_GROUP > BLOCK_N

    # ---- scales (the masked tile replaces scales of rows past the history by (1, 0))
    if not K_FOLD_ONCE:
        ks, kz = load_scales(
            k_scales_ptr,
            kv_indices_ptr,
            pages,
            row0,
            page_base,
            t,
            n_q,
            valid,
            stride_ks_page,
            kvh * stride_ks_head,
            D,
            K_GROUP,
            PAGE,
            BLOCK_N,
            K_CHANNEL,
            MASKED,
            RECONSTRUCT,
        )
    # channel-wise V (acc-fold): the scales are prefetched one tile ahead and their pages two
    # tiles ahead (Note [channel-wise V scale prefetch])
    V_PREFETCH: tl.constexpr = V_CHANNEL and not RECONSTRUCT
    if V_PREFETCH:
        vs = pf_s
        vz = pf_z
        pf_s, pf_z = channel_scales_at(
            v_scales_ptr,
            pf_page,
            t + 1,
            n_q,
            stride_vs_page,
            kvh * stride_vs_head,
            D,
            V_GROUP,
            PAGE,
            BLOCK_N,
            NTV,
        )
        pf_page = channel_scale_pages(
            kv_indices_ptr, page_base, t + 2, n_q, D, V_GROUP, PAGE, BLOCK_N, NTV
        )
    else:
        vs, vz = load_scales(
            v_scales_ptr,
            kv_indices_ptr,
            pages,
            row0,
            page_base,
            t,
            n_q,
            valid,
            stride_vs_page,
            kvh * stride_vs_head,
            D,
            V_GROUP,
            PAGE,
            BLOCK_N,
            V_CHANNEL,
            MASKED,
            RECONSTRUCT,
        )

    # ---- S = Q K^T
    k_op = k_operand(kw, magic, BLOCK_N, D, K_BITS, INTERP)  # [N, D] operand values y
    if RECONSTRUCT:
        kf = k_op.to(tl.float32)
        if K_CHANNEL:
            kf = kf.reshape(NTK, BLOCK_N // NTK, D) * ks[:, None, :] + kz[:, None, :]
        else:
            kf = kf.reshape(BLOCK_N, NGK, K_GROUP) * ks[:, :, None] + kz[:, :, None]
        k_op = to_operand(round_bf16(kf.reshape(BLOCK_N, D), INTERP), INTERP)
        s_cols = tl.dot(k_op, qx)  # qx = Q^T * qk_scale, padded to HPK columns
        s = pick_block(s_cols, offs_n * 0, 1, HS)
    elif K_CHANNEL:
        # operand-fold into Q per token group j: Qx[:, (j,h)] = bf16(c * Q[h] * s'_j), and
        # the offset correction from the rounded Qx (fold_channel_k); once per group when a
        # group spans several tiles (K_FOLD_ONCE), else here for the tile's NTK groups
        if K_FOLD_ONCE:
            qx_t = qx
            corr_cols = qsum_g
        else:
            qx_t, corr_cols = fold_channel_k(q, ks, kz, HPK, INTERP)
        part = tl.dot(k_op, qx_t)  # [N, HPK]
        s = pick_block(part + corr_cols, tok_k, NTK, HS)
    else:
        # acc-fold: S = sum_g s'[n,g] * (Q_g . y[n,g]) + z'[n,g] * sum(Q_g), c folded in
        part = tl.dot(k_op, qx)  # [N, HPK], columns (g, h)
        ks = ks * qk_scale
        if NGK == 1:
            s = pick_block(part, offs_n * 0, 1, HS) * ks + kz * qsum_g
        else:
            s = tl.sum(part.reshape(BLOCK_N, NGK, HS) * ks[:, :, None], axis=1)
            # Note [no fp32 dot]: the offset term sum_g z'[n, g] * qsum[g, h] is a broadcast
            # product summed over g, which Triton rewrites into a TF32 dot of K = NGK from 16
            # query columns up (GQA 16 decode, the extend kernel): its 10-bit mantissa loses the
            # cancellation of the operands' +128 offsets, and the extend kernel faulted on an
            # H100 in that path (benchmarks/results/extend_tests.log). The opaque zero (``zero``,
            # a kernel argument) makes the summed operand no product: fp32 FMAs, as below 16
            # columns (benchmarks/tools/sass_count.py prints a kernel's fp32 dots)
            s += tl.sum(kz[:, :, None] * qsum_g[None, :, :] + zero, axis=1)
    if MASKED:
        s = tl.where(valid[:, None], s, -float("inf"))

    # ---- online softmax (row sums deferred: l2 keeps one per row, reduced after the loop)
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])  # [N, HS]
    l2 = l2 * alpha[None, :] + p

    # ---- O += P V
    vt_op = vt_operand(vw, magic, BLOCK_N, D, V_BITS, INTERP)  # [D, N]
    if RECONSTRUCT:
        vf = vt_op.to(tl.float32)
        if V_CHANNEL:
            vf = (
                vf.reshape(D, NTV, BLOCK_N // NTV) * tl.trans(vs)[:, :, None]
                + tl.trans(vz)[:, :, None]
            )
        else:
            vf = (
                vf.reshape(NGV, V_GROUP, BLOCK_N) * tl.trans(vs)[:, None, :]
                + tl.trans(vz)[:, None, :]
            )
        vt_op = to_operand(round_bf16(vf.reshape(D, BLOCK_N), INTERP), INTERP)
        p_op = pad_cols(round_bf16(p, INTERP), HPV, 0.0)
        acc = acc * pad_cols(alpha[None, :], HPV, 1.0)
        acc = tl.dot(vt_op, to_operand(p_op, INTERP), acc)
    elif V_CHANNEL:
        # acc-fold per token group j: acc += s'_j * (P_j . y_j) + rowsum(P_j) * z'_j, with P
        # rounded as the matrix unit sees it and the row sums taken from the rounded P
        # The accumulator keeps the product's (j, h) columns, so the fold stays in the MMA
        # layout; the blocks are summed once after the loop.
        p_r = round_bf16(p, INTERP)
        onehot = (tok_v[:, None] == tl.arange(0, NTV)[None, :]).to(tl.float32)  # [N, NTV]
        p_cols = spread_cols(p_r, onehot, NTV, HS, HPV)  # [N, HPV]
        part = tl.dot(vt_op, to_operand(p_cols, INTERP), tl.zeros([D, HPV], tl.float32))
        rowsum = tl.sum(p_cols, axis=0)  # [HPV]
        ones = tl.full([1, HS], 1.0, tl.float32)
        vs_cols = spread_cols(ones + tl.zeros([D, HS], tl.float32), vs, NTV, HS, HPV)
        vz_cols = spread_cols(ones + tl.zeros([D, HS], tl.float32), vz, NTV, HS, HPV)
        alpha_cols = pad_cols(
            tl.reshape(alpha[None, None, :] + tl.zeros([1, NTV, 1], tl.float32), (1, NTV * HS)),
            HPV,
            1.0,
        )
        acc = acc * alpha_cols + part * vs_cols + rowsum[None, :] * vz_cols
    else:
        # operand-fold into P per channel group g: P'[n,(g,h)] = bf16(P[n,h] * s'[n,g]), and
        # the offset correction sum_n P'[n,(g,h)] * z'[n,g] / s'[n,g] from the rounded P'
        p_scaled = round_bf16(spread_cols(p, vs, NGV, HS, NGV * HS), INTERP)  # [N, NGV*HS]
        ratio = spread_cols(
            tl.full([BLOCK_N, HS], 1.0, tl.float32), fast_div(vz, vs, INTERP), NGV, HS, NGV * HS
        )
        alpha_cols = tl.reshape(
            alpha[None, None, :] + tl.zeros([1, NGV, 1], tl.float32), (1, NGV * HS)
        )
        z2 = z2 * alpha_cols + p_scaled * ratio  # deferred: reduced over rows after the loop
        p_op = to_operand(pad_cols(p_scaled, HPV, 0.0), INTERP)
        if TILE_ACC:
            # Note [tensor-core accumulation]: acc holds ~128 * sum(P') (y = q + 128) and the
            # correction cancels that 128; the tensor core's fp32 accumulation is not IEEE, and
            # its error, carried over every tile of a split, grows with the context. A fresh
            # accumulator per tile, added in fp32 on the CUDA cores, keeps it at bf16 level.
            # (the zero comes from a runtime argument: with a constant zero accumulator Triton
            # folds "acc + dot(a, b)" back into "dot(a, b, acc)")
            fresh = tl.full([D, HPV], 0.0, tl.float32) + zero
            acc = acc * pad_cols(alpha_cols, HPV, 1.0) + tl.dot(vt_op, p_op, fresh)
        else:
            acc = tl.dot(vt_op, p_op, acc * pad_cols(alpha_cols, HPV, 1.0))
    return m_new, l2, z2, acc, pf_s, pf_z, pf_page


# ---------------------------------------------------------------------------- BF16 windows
@triton.jit
def _window_tile(
    state, k_ptr, v_ptr, rows, valid, qt, qk_scale, D: tl.constexpr, INTERP: tl.constexpr
):
    m_i, l_i, acc = state
    offs_d = tl.arange(0, D)
    k = tl.load(k_ptr + rows[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    if INTERP:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(k, qt) * qk_scale  # [BW, HP]
    s = tl.where(valid[:, None], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = tl.dot(tl.trans(v), to_operand(round_bf16(p, INTERP), INTERP), acc * alpha[None, :])
    return m_new, l_i, acc


@triton.jit
def windows_partial(
    q,
    b,
    kvh,
    qk_scale,
    n_q,
    seq_lens_ptr,
    slots_ptr,
    k_sink_ptr,
    v_sink_ptr,
    k_tail_ptr,
    v_tail_ptr,
    stride_sink_slot,
    stride_sink_head,
    stride_tail_slot,
    stride_tail_head,
    HP: tl.constexpr,
    D: tl.constexpr,
    SINK: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_W: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Attention over the BF16 sink and tail of one sequence: ``(o [D, HP], lse2 [HP])``."""
    length = tl.load(seq_lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    sink_len = tl.minimum(length, SINK)
    tail_start = tl.minimum(SINK + n_q, length)
    qt = to_operand(tl.trans(q), INTERP)  # [D, HP]
    state = (
        tl.full([HP], -float("inf"), tl.float32),
        tl.zeros([HP], tl.float32),
        tl.zeros([D, HP], tl.float32),
    )
    offs = tl.arange(0, BLOCK_W)
    k_sink = k_sink_ptr + slot * stride_sink_slot + kvh * stride_sink_head
    v_sink = v_sink_ptr + slot * stride_sink_slot + kvh * stride_sink_head
    # Note [window smem]: these BF16 tiles are software-pipelined like the main loop, and a
    # kernel's shared memory is the most any of its branches needs: at BLOCK_W = 64 and 3
    # stages they took 96 KB, so every format with a BF16 tail (channel-wise K or V, whose
    # groups wait there until complete, or sink/recent windows) ran at 102 KB per CTA, i.e. at
    # most 2 CTAs per SM where the split count assumed 3-4.
    # TritonDecodeConfig.block_window = 32 keeps it at 46 KB (4 CTAs per SM fit).
    for t in range(0, tl.cdiv(sink_len, BLOCK_W)):
        rows = t * BLOCK_W + offs
        state = _window_tile(state, k_sink, v_sink, rows, rows < sink_len, qt, qk_scale, D, INTERP)
    k_tail = k_tail_ptr + slot * stride_tail_slot + kvh * stride_tail_head
    v_tail = v_tail_ptr + slot * stride_tail_slot + kvh * stride_tail_head
    for t in range(0, tl.cdiv(length - tail_start, BLOCK_W)):
        pos = tail_start + t * BLOCK_W + offs
        state = _window_tile(
            state, k_tail, v_tail, (pos - SINK) % TAIL, pos < length, qt, qk_scale, D, INTERP
        )
    m_i, l_i, acc = state
    o = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), -float("inf"))
    return o, lse


# ---------------------------------------------------------------------------- kernels
@triton.jit
def decode_split_kernel(
    # pointers
    q_ptr,  # [B, Hq, D] bf16
    k_words_ptr,  # [pages, Hkv, PAGE, D*K_BITS/32] int32
    k_scales_ptr,  # [pages, Hkv, PAGE*D/K_GROUP, 2] fp32
    v_words_ptr,  # [pages, Hkv, PAGE, D*V_BITS/32] int32
    v_scales_ptr,  # [pages, Hkv, PAGE*D/V_GROUP, 2] fp32
    k_sink_ptr,  # [slots, Hkv, SINK, D] bf16
    v_sink_ptr,
    k_tail_ptr,  # [slots, Hkv, TAIL, D] bf16
    v_tail_ptr,
    kv_indptr_ptr,  # [B + 1] int32
    kv_indices_ptr,  # [nnz] int32
    num_quantized_ptr,  # [B] int32
    seq_lens_ptr,  # [B] int32
    slots_ptr,  # [B] int32
    o_part_ptr,  # [B, Hq, num_splits + HAS_WINDOWS, D] fp32
    lse_part_ptr,  # [B, Hq, num_splits + HAS_WINDOWS] fp32
    # scalars
    qk_scale,  # sm_scale * log2(e)
    magic,  # 0x43004300
    zero,  # 0.0, opaque to the compiler (Note [tensor-core accumulation])
    num_splits,
    # strides (elements)
    stride_q_b,
    stride_q_h,
    stride_kw_page,
    stride_kw_head,
    stride_ks_page,
    stride_ks_head,
    stride_vw_page,
    stride_vw_head,
    stride_vs_page,
    stride_vs_head,
    stride_sink_slot,
    stride_sink_head,
    stride_tail_slot,
    stride_tail_head,
    stride_op_b,
    stride_op_h,
    stride_op_split,
    stride_lp_b,
    stride_lp_h,
    # constexprs
    H: tl.constexpr,  # query heads per KV head
    HS: tl.constexpr,  # H padded (>= 8, power of two)
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_CHANNEL: tl.constexpr,
    V_CHANNEL: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    SINK: tl.constexpr,
    TAIL: tl.constexpr,
    HAS_WINDOWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HPK: tl.constexpr,  # columns of the QK product: (column blocks x HS), at least 16
    HPV: tl.constexpr,  # columns of the PV product
    RECONSTRUCT: tl.constexpr,
    INTERP: tl.constexpr,
    TILE_ACC: tl.constexpr,  # token-wise V: a fresh PV accumulator per tile (see the Note)
):
    """One (sequence, KV head, split): a normalised partial output and its log2 LSE."""
    tl.static_assert(BLOCK_N % PAGE == 0 or PAGE % BLOCK_N == 0)
    tl.static_assert(HS >= 8 and HS >= H)
    tl.static_assert(D == 64 or D == 128)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    NGK: tl.constexpr = D // K_GROUP
    NGV: tl.constexpr = D // V_GROUP

    offs_h = tl.arange(0, HS)
    offs_d = tl.arange(0, D)
    head = kvh * H + offs_h
    q = tl.load(
        q_ptr + b * stride_q_b + head[:, None] * stride_q_h + offs_d[None, :],
        mask=(offs_h < H)[:, None],
        other=0.0,
    ).to(tl.float32)  # [HS, D]
    n_q = tl.load(num_quantized_ptr + b)

    if split < num_splits:
        page_base = tl.load(kv_indptr_ptr + b)
        n_pages = tl.load(kv_indptr_ptr + b + 1) - page_base
        n_tiles = tl.cdiv(n_q, BLOCK_N)
        # channel-wise K groups longer than a tile are folded into Q once per group: splits
        # take whole groups (the history holds whole groups: foscar.cache demotes
        # fmt.demotion_quantum tokens at a time, a multiple of every channel-wise group size)
        K_FOLD_ONCE: tl.constexpr = K_CHANNEL and (not RECONSTRUCT) and K_GROUP > BLOCK_N
        KPT: tl.constexpr = K_GROUP // BLOCK_N if K_FOLD_ONCE else 1  # tiles per fold
        per_split = tl.cdiv(tl.cdiv(n_tiles, KPT), num_splits) * KPT
        t_begin = split * per_split
        t_end = tl.minimum(t_begin + per_split, n_tiles)
        t_full = tl.maximum(tl.minimum(t_end, n_q // BLOCK_N), t_begin)

        # the Q side of the QK product, built once
        if RECONSTRUCT:
            qx = to_operand(pad_cols(tl.trans(q * qk_scale), HPK, 0.0), INTERP)
            qsum_g = tl.zeros([1, HS], tl.float32)
            q_fold = q
        elif K_CHANNEL:
            qx = tl.zeros([D, HPK], tl.float32)  # rebuilt per tile from the group scales
            qsum_g = tl.zeros([1, HS], tl.float32)
            q_fold = tl.trans(q * qk_scale)  # [D, HS]: the fold scales its rows
        else:
            # Qx[:, (g, h)] = Q[h] restricted to channel group g (exact in bf16)
            in_group = (offs_d[:, None] // K_GROUP == tl.arange(0, NGK)[None, :]).to(tl.float32)
            q_cols = tl.trans(q)[:, None, :] * in_group[:, :, None]  # [D, NGK, HS]
            qx = to_operand(pad_cols(q_cols.reshape(D, NGK * HS), HPK, 0.0), INTERP)
            qsum_g = tl.sum(q.reshape(HS, NGK, K_GROUP), axis=2)  # [HS, NGK]
            qsum_g = tl.trans(qsum_g) * qk_scale  # [NGK, HS]
            if NGK == 1:
                qsum_g = qsum_g.reshape(HS)[None, :]
            q_fold = q

        if RECONSTRUCT:
            acc = tl.zeros([D, HPV], tl.float32)
            z2 = tl.zeros([1, 1], tl.float32)
        elif V_CHANNEL:
            acc = tl.zeros([D, HPV], tl.float32)
            z2 = tl.zeros([1, 1], tl.float32)
        else:
            acc = tl.zeros([D, HPV], tl.float32)
            z2 = tl.zeros([BLOCK_N, NGV * HS], tl.float32)
        if V_CHANNEL and not RECONSTRUCT:
            # Note [channel-wise V scale prefetch]: Triton's pipeliner prefetches only the loads
            # that feed a dot operand; channel-wise V scales multiply the PV product, so they
            # were loaded synchronously in every tile, after a dependent load of their page id
            # (two serial memory round trips per tile). The tile now loads the scales of the
            # next tile and the pages of the one after into the loop state.
            NTV0: tl.constexpr = BLOCK_N // V_GROUP if BLOCK_N > V_GROUP else 1
            pf_page = channel_scale_pages(
                kv_indices_ptr, page_base, t_begin, n_q, D, V_GROUP, PAGE, BLOCK_N, NTV0
            )
            pf_s, pf_z = channel_scales_at(
                v_scales_ptr,
                pf_page,
                t_begin,
                n_q,
                stride_vs_page,
                kvh * stride_vs_head,
                D,
                V_GROUP,
                PAGE,
                BLOCK_N,
                NTV0,
            )
            pf_page = channel_scale_pages(
                kv_indices_ptr, page_base, t_begin + 1, n_q, D, V_GROUP, PAGE, BLOCK_N, NTV0
            )
        else:
            pf_s = tl.zeros([1, 1], tl.float32)
            pf_z = tl.zeros([1, 1], tl.float32)
            pf_page = tl.zeros([1, 1], tl.int64)
        state = (
            tl.full([HS], -float("inf"), tl.float32),
            tl.zeros([BLOCK_N, HS], tl.float32),
            z2,
            acc,
            pf_s,
            pf_z,
            pf_page,
        )
        # the scale multipliers of token-wise K carry c = sm_scale * log2(e)
        k_mult = 1.0 if (K_CHANNEL or RECONSTRUCT) else qk_scale
        seq = (n_q, page_base, n_pages, kvh, magic, k_mult, zero, q_fold)
        CFG: tl.constexpr = tile_config(
            HS,
            D,
            PAGE,
            BLOCK_N,
            K_BITS,
            V_BITS,
            K_CHANNEL,
            V_CHANNEL,
            K_GROUP,
            V_GROUP,
            HPK,
            HPV,
            RECONSTRUCT,
            INTERP,
            TILE_ACC,
        )
        ptrs = (kv_indices_ptr, k_words_ptr, k_scales_ptr, v_words_ptr, v_scales_ptr)
        strides = (
            stride_kw_page,
            stride_kw_head,
            stride_ks_page,
            stride_ks_head,
            stride_vw_page,
            stride_vw_head,
            stride_vs_page,
            stride_vs_head,
        )
        if K_FOLD_ONCE:
            for grp in range(t_begin // KPT, t_end // KPT):
                # (every group of the loop is in the history: no masks)
                k_pages = channel_scale_pages(
                    kv_indices_ptr, page_base, grp * KPT, n_q, D, K_GROUP, PAGE, BLOCK_N, 1, True
                )
                ks, kz = channel_scales_at(
                    k_scales_ptr,
                    k_pages,
                    grp * KPT,
                    n_q,
                    stride_ks_page,
                    kvh * stride_ks_head,
                    D,
                    K_GROUP,
                    PAGE,
                    BLOCK_N,
                    1,
                    True,
                )
                qx_g, corr_g = fold_channel_k(q_fold, ks, kz, HPK, INTERP)
                for sub in tl.static_range(KPT):
                    t = grp * KPT + sub
                    state = quantized_tile(t, state, qx_g, corr_g, seq, ptrs, strides, CFG, False)
        else:
            for t in range(t_begin, t_full):
                state = quantized_tile(t, state, qx, qsum_g, seq, ptrs, strides, CFG, False)
            if t_full < t_end:
                state = quantized_tile(t_full, state, qx, qsum_g, seq, ptrs, strides, CFG, True)
        m_i, l2, z2, acc, pf_s, pf_z, pf_page = state
        l_i = tl.sum(l2, axis=0)  # [HS]
        if RECONSTRUCT:
            out = pick_block(acc, offs_d * 0, 1, HS)
        elif V_CHANNEL:
            NTV: tl.constexpr = BLOCK_N // V_GROUP if BLOCK_N > V_GROUP else 1
            if NTV == 1:
                out = pick_block(acc, offs_d * 0, 1, HS)
            else:
                out = tl.sum(acc.reshape(D, NTV, HS), axis=1)
        else:
            zacc = pad_cols(tl.sum(z2, axis=0)[None, :], HPV, 0.0)  # [1, HPV]
            out = pick_block(acc + zacc, offs_d // V_GROUP, NGV, HS)
        o = out / tl.where(l_i > 0, l_i, 1.0)[None, :]  # [D, HS]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), -float("inf"))
        tl.store(
            o_part_ptr
            + b * stride_op_b
            + head[None, :] * stride_op_h
            + split * stride_op_split
            + offs_d[:, None],
            o,
            mask=(offs_h < H)[None, :],
        )
        tl.store(lse_part_ptr + b * stride_lp_b + head * stride_lp_h + split, lse, mask=offs_h < H)
    elif HAS_WINDOWS:
        HPW: tl.constexpr = 2 * HS if HS < 16 else HS
        qw = tl.trans(pad_cols(tl.trans(q), HPW, 0.0))  # [HPW, D]
        # (names differ from the other branch: a runtime if/else may not rebind with new shapes)
        o_w, lse_w = windows_partial(
            qw,
            b,
            kvh,
            qk_scale,
            n_q,
            seq_lens_ptr,
            slots_ptr,
            k_sink_ptr,
            v_sink_ptr,
            k_tail_ptr,
            v_tail_ptr,
            stride_sink_slot,
            stride_sink_head,
            stride_tail_slot,
            stride_tail_head,
            HPW,
            D,
            SINK,
            TAIL,
            BLOCK_W,
            INTERP,
        )
        offs_hw = tl.arange(0, HPW)
        head_w = kvh * H + offs_hw
        tl.store(
            o_part_ptr
            + b * stride_op_b
            + head_w[None, :] * stride_op_h
            + split * stride_op_split
            + offs_d[:, None],
            o_w,
            mask=(offs_hw < H)[None, :],
        )
        tl.store(
            lse_part_ptr + b * stride_lp_b + head_w * stride_lp_h + split, lse_w, mask=offs_hw < H
        )


@triton.jit
def merge_splits_kernel(
    o_part_ptr,  # [B, Hq, NUM_PARTS, D] fp32
    lse_part_ptr,  # [B, Hq, NUM_PARTS] fp32, log2 domain
    o_ptr,  # [B, Hq, D] (q's dtype)
    lse_ptr,  # [B, Hq] fp32, natural log (written when WRITE_LSE)
    num_parts,
    stride_op_b,
    stride_op_h,
    stride_op_split,
    stride_lp_b,
    stride_lp_h,
    stride_o_b,
    stride_o_h,
    stride_l_b,
    stride_l_h,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """LSE merge of the partials of one (sequence, query head); empty partials (-inf) drop out.
    PDL: launched as a programmatic dependent of the split kernel (sm_90+), so its launch overlaps
    the split kernel's tail; it waits for the split kernel's writes before reading them."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D)
    mask_p = offs_p < num_parts
    lse = tl.load(
        lse_part_ptr + b * stride_lp_b + h * stride_lp_h + offs_p, mask=mask_p, other=-float("inf")
    )
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - m)
    parts = tl.load(
        o_part_ptr
        + b * stride_op_b
        + h * stride_op_h
        + offs_p[:, None] * stride_op_split
        + offs_d[None, :],
        mask=mask_p[:, None],
        other=0.0,
    )
    denom = tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * parts, axis=0) / denom
    if INTERP:
        # the interpreter truncates fp32 -> bf16 on conversion; round to nearest first
        o = round_bf16(o, INTERP)
    tl.store(o_ptr + b * stride_o_b + h * stride_o_h + offs_d, o.to(o_ptr.dtype.element_ty))
    if WRITE_LSE:
        tl.store(lse_ptr + b * stride_l_b + h * stride_l_h, (m + tl.log2(denom)) * _LN2)
