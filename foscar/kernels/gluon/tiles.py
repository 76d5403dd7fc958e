"""Tile programs of the Gluon decode kernel: one consumer's work on one ring stage.

Math, per tile of 64 (or 128) tokens n and the H query heads h of a KV head, log2 domain:
    S[n, h] = c (s'_K (Q . y_K) + z'_K sum(Q))        acc-fold of token-wise K (c = sm_scale log2 e)
    P = exp2(S - m);  P' = bf16(P s'_V);  O^T += V_y^T P',  z2 += P' z'_V / s'_V   (operand-fold)
channel-wise K folds Q instead (S = Q' . q + zq), channel-wise V folds the accumulator
(O = s'_c V_y^T P + z'_c sum P'); every offset term comes from the operand the tensor core saw
(design.md Note [offset cancellation]).

Data contract: a tile reads stage s of the ring (words [64, W] int32 per page, scale chunks
[128] fp32 per page or per channel-wise group), Q^T [HS, D] and P'^T [HS, 64] buffers in shared
memory (K-major B operands), and carries the consumer's online-softmax state
``(m_i [HS], l_i [64, HS], z_i [64, HS], acc [D, HS], zp_i [64, HS])``: running max, row sums
and token-wise V's offset sums (reduced once after the loop), O^T, and the sum of P' (for the
scaled extraction and E4M3's centred codes).

Variants (``step`` picks by CFG): ``_tile`` one page, any axis pair, bf16 or E4M3 operands, the
reconstruct ablation; ``_tile_pair`` two pages (a channel-wise group is one tile), bf16
operands; ``_tile_pair_packed`` / ``_tile_pair_packed_bf16`` two pages whose scores share one
[64, 8] tile (GluonFlag.PACKED_HEADS: token-wise K and V at head_dim 128, H <= 4). Not: E4M3
with two-page tiles other than packed heads, packed heads with channel-wise groups or the
reconstruct ablation.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .layouts import (
    a_operand_layout,
    acc_layout,
    e4m3_operands,
    fast_max,
    fast_rcp,
    packed_heads,
    reconstructs,
    scaled_extraction,
    warp_max_layout,
)
from .operands import (
    channel_key_operand,
    channel_scale_pairs,
    k_fields_e4m3,
    k_operand_from_fields,
    load_k_words,
    load_v_words,
    page_k_operand,
    page_vt_operand,
    pow4,
    scale_pairs,
    scaled_exponent_v,
    vt_fields_e4m3,
    vt_operand_from_fields,
)


# ------------------------------------------------------------------------ softmax-side helpers
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
    if reconstructs(CFG.OPT):
        return s_acc * qk_scale
    elif e4m3_operands(CFG.OPT):
        ks, kz = _tile_factor(ks), _tile_factor(kz)
        return (s_acc * dq[None, :]) * (ks * qk_scale) + (kz + 128.0 * ks) * qsum[None, :]
    elif CFG.K_CHANNEL:
        return (s_acc + zq[None, :]) * qk_scale
    elif scaled_extraction(CFG.OPT, CFG.K_BITS, CFG.HD):
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
):
    """acc-fold of channel-wise V: O = alpha O + s'_c (V_y^T P')[c, h] + z'_c sum_n P'[n, h].
    Scaled extraction: the product holds y~ = 128 + 4^a q, i.e. 4^a V_y^T P' - 128 (4^a - 1)
    sum P', so s'_c becomes s'_c 4^-a and z'_c becomes z'_c + 128 s'_c (1 - 4^-a). p_sum: the
    ones @ P' product [64, HS] (every row the sum)."""
    if SCALED:
        c = gl.arange(0, 128, layout=gl.SliceLayout(1, acc_layout(HS)))
        inv = pow4(scaled_exponent_v(c), True)
        vz = vz + 128.0 * vs * (1.0 - inv)
        vs = vs * inv
    offset = vz[:, None] * _rows_to_128(p_sum, HS)
    return acc * alpha[None, :] + vs[:, None] * o_t + offset


# ------------------------------------------------------------------------ one page, two pages
@gluon.jit
def _tile(i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr):
    """One page (64 tokens) of consumer C: tile t, its i-th (ops: see step)."""
    SPC: gl.constexpr = CFG.SPC
    HS: gl.constexpr = CFG.HS
    V_BITS: gl.constexpr = CFG.V_BITS
    V_CHANNEL: gl.constexpr = CFG.V_CHANNEL
    OPT: gl.constexpr = CFG.OPT
    K_CHANNEL: gl.constexpr = CFG.K_CHANNEL
    HD: gl.constexpr = CFG.HD
    FAST_MAX: gl.constexpr = fast_max(OPT)
    FAST_RCP: gl.constexpr = fast_rcp(OPT)
    RECONSTRUCT: gl.constexpr = reconstructs(OPT)
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    E4M3: gl.constexpr = e4m3_operands(OPT)
    gl.static_assert(
        not (E4M3 and (V_CHANNEL or K_CHANNEL or RECONSTRUCT or HD != 128)),
        "E4M3 operands: token-wise K and V at head_dim 128",
    )
    acc_l: gl.constexpr = acc_layout(HS)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, _ = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, zp_i = st
    p_smem = p_bufs.index(C)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    kw = load_k_words(kw_bufs.index(s), CFG.K_BITS, HD)
    vw = load_v_words(vw_bufs.index(s), V_BITS, HD, E4M3)
    ks, kz, zq = 0, 0, 0
    if K_CHANNEL and RECONSTRUCT:  # per channel, read before the stage is released
        ks, kz = channel_scale_pairs(ks_bufs.index(2 * s), ks_bufs.index(2 * s + 1), HS)
        b_qk = qt_smem.permute((1, 0))
    elif K_CHANNEL:
        zq, b_qk = channel_key_operand(ks_bufs, s, qt_smem, kfold, CFG)
    else:
        ks, kz = scale_pairs(ks_bufs.index(s), HS)
        b_qk = qt_smem.permute((1, 0))
    if V_CHANNEL:
        # per channel of the tile's group: [128] in the rows of the PV accumulator
        vs, vz = channel_scale_pairs(vs_bufs.index(2 * s), vs_bufs.index(2 * s + 1), HS)
    else:
        vs, vz = scale_pairs(vs_bufs.index(s), HS)
    # stage s may be refilled (Gluon puts a partition bar.sync before the arrive)
    mbarrier.arrive(empty.index(s))
    if E4M3:  # the int32 fields stay the wait's deps; the E4M3 operand is their bytes
        kx = k_fields_e4m3(kw, CFG.K_BITS, HD, scaled_extraction(OPT, CFG.K_BITS, HD))
        k_op = k_operand_from_fields(kx, HS, CFG.K_BITS, HD)
    else:
        k_op = page_k_operand(kw, ks, kz, magic, HS, CFG)

    mma_l: gl.constexpr = acc_layout(HS, 32 if E4M3 else 16)  # acc_l, for the instruction's k
    s_tok = warpgroup_mma(
        k_op,
        b_qk,
        gl.zeros([64, HS], gl.float32, mma_l),
        use_acc=False,
        is_async=True,
    )
    if E4M3:  # V's fields as the QK wait's deps: built while the QK product runs
        vx = vt_fields_e4m3(vw, V_BITS, HD, SCALED_V)
    else:
        vt_op = page_vt_operand(vw, vs, vz, magic, HS, CFG)  # meant to overlap the QK wgmma
    ratio = _value_ratio(vs, vz, V_CHANNEL, FAST_RCP)
    if E4M3:  # int32 deps: triton 3.6 rejects 8-bit ones (see k_fields_e4m3)
        s_acc, kx, vx = warpgroup_mma_wait(0, deps=[s_tok, kx, vx])
        s_acc = gl.convert_layout(s_acc, acc_l, assert_trivial=True)
        vt_op = vt_operand_from_fields(vx, HS, HD)
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
        # its whole P z (0.35 against bf16's 2.3e-3); with the fp32 P'
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
    if V_CHANNEL and not RECONSTRUCT:
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
        acc = _channel_value_fold(acc, alpha, o_t, p_sum, vs, vz, HS, SCALED_V)
    else:
        if E4M3:
            o_t, vx = warpgroup_mma_wait(0, deps=[pv_tok, vx])
            o_t = gl.convert_layout(o_t, acc_l, assert_trivial=True)
        else:
            o_t, vt_op = warpgroup_mma_wait(0, deps=[o_tok, vt_op])
        acc = acc * alpha[None, :] + o_t  # fresh accumulator per tile, added in fp32
    return m_new, l_i, z_i, acc, zp_i


@gluon.jit
def _tile_pair(i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr):
    """Two pages (128 tokens) of consumer C: tile t, its i-th, pages a and b of one ring stage.
    Per 128 tokens one stage wait and release, one cross-warp max exchange and one P' barrier
    (a page per tile passes each once per 64 tokens), and a channel-wise group is one tile, so
    K's fold runs once per group: faster for channel-wise K, no faster for token-wise K
    (docs/tuning.md, Gluon kernel, rows "two-page tiles"; token-wise K's consumers are bound
    by ALU work and wgmma latency, not by the barriers). The two QK products go to two
    [64, HS] accumulators; the two PV products of the tile chain on the tensor core (128
    tokens, within Note [tensor-core accumulation]'s fresh-per-tile rule), added to the
    running O in fp32. Page b's operands are built after page a's products
    complete (consumer 0 has 104 registers).

    Note [late stage release]: the tile releases its ring stage after its last wgmma wait, not
    after its last shared-memory read: with channel-wise K at 2 CTAs per SM, every call then
    gives the same bits, where one-page tiles, which release before their products, differ in
    19 of 20 calls in 7 of 8 channel-wise cases (`bash benchmarks/run_device.sh repeat`). Which
    read the refill overtakes is not isolated: the PTX reads no shared memory of the stage
    after the early release (docs/tuning.md)."""
    SPC: gl.constexpr = CFG.SPC
    HS: gl.constexpr = CFG.HS
    V_BITS: gl.constexpr = CFG.V_BITS
    V_CHANNEL: gl.constexpr = CFG.V_CHANNEL
    OPT: gl.constexpr = CFG.OPT
    K_CHANNEL: gl.constexpr = CFG.K_CHANNEL
    HD: gl.constexpr = CFG.HD
    FAST_MAX: gl.constexpr = fast_max(OPT)
    FAST_RCP: gl.constexpr = fast_rcp(OPT)
    RECONSTRUCT: gl.constexpr = reconstructs(OPT)
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    gl.static_assert(not e4m3_operands(OPT), "E4M3 operands: one-page tiles")
    acc_l: gl.constexpr = acc_layout(HS)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, _ = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, zp_i = st
    pa_smem = p_bufs.index(2 * C)
    pb_smem = p_bufs.index(2 * C + 1)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    # scales: page a's chunk at 2s, page b's at 2s + 1 (a channel-wise group's two chunks),
    # read after the QK products where the folds allow (registers: 104-112 per consumer thread)
    ks_a, kz_a, ks_b, kz_b, zq = 0, 0, 0, 0, 0
    if K_CHANNEL and RECONSTRUCT:
        ks_a, kz_a = channel_scale_pairs(ks_bufs.index(2 * s), ks_bufs.index(2 * s + 1), HS)
        ks_b = ks_a
        kz_b = kz_a
        b_qk = qt_smem.permute((1, 0))
    elif K_CHANNEL:
        zq, b_qk = channel_key_operand(ks_bufs, s, qt_smem, kfold, CFG)
    else:
        if RECONSTRUCT:
            ks_a, kz_a = scale_pairs(ks_bufs.index(2 * s), HS)
            ks_b, kz_b = scale_pairs(ks_bufs.index(2 * s + 1), HS)
        b_qk = qt_smem.permute((1, 0))
    zero = gl.zeros([64, HS], gl.float32, acc_l)
    K_BITS: gl.constexpr = CFG.K_BITS
    kw_a = load_k_words(kw_bufs.index(2 * s), K_BITS, HD)
    k_a = page_k_operand(kw_a, ks_a, kz_a, magic, HS, CFG)
    sa_tok = warpgroup_mma(k_a, b_qk, zero, use_acc=False, is_async=True)
    sa_tok, k_a = warpgroup_mma_wait(0, deps=[sa_tok, k_a])
    kw_b = load_k_words(kw_bufs.index(2 * s + 1), K_BITS, HD)
    k_b = page_k_operand(kw_b, ks_b, kz_b, magic, HS, CFG)
    sb_tok = warpgroup_mma(k_b, b_qk, zero, use_acc=False, is_async=True)
    sa_acc, sb_acc, k_a, k_b = warpgroup_mma_wait(0, deps=[sa_tok, sb_tok, k_a, k_b])
    if not K_CHANNEL and not RECONSTRUCT:
        ks_a, kz_a = scale_pairs(ks_bufs.index(2 * s), HS)
        ks_b, kz_b = scale_pairs(ks_bufs.index(2 * s + 1), HS)
    if V_CHANNEL:
        vs_a, vz_a = channel_scale_pairs(vs_bufs.index(2 * s), vs_bufs.index(2 * s + 1), HS)
        vs_b = vs_a
        vz_b = vz_a
    else:
        vs_a, vz_a = scale_pairs(vs_bufs.index(2 * s), HS)
        vs_b, vz_b = scale_pairs(vs_bufs.index(2 * s + 1), HS)
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
    vt_a = page_vt_operand(
        load_v_words(vw_bufs.index(2 * s), V_BITS, HD), vs_a, vz_a, magic, HS, CFG
    )
    o_tok = warpgroup_mma(vt_a, pa_smem.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    if not V_CHANNEL:  # page a's product done before page b's operand (104 registers)
        o_tok, vt_a = warpgroup_mma_wait(0, deps=[o_tok, vt_a])
    vw_b = load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD)
    vt_b = page_vt_operand(vw_b, vs_b, vz_b, magic, HS, CFG)
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
    # stage s is released once the whole tile is done (Note [late stage release])
    gl.thread_barrier()
    mbarrier.arrive(empty.index(s))
    return m_new, l_i, z_i, acc, zp_i


# ------------------------------------------------------------------------ packed heads
@gluon.jit
def _halves(a, b, HS: gl.constexpr):
    """[64] per-token values of pages a and b -> [64, HS] in the accumulator layout: page a's in
    the first HS / 2 columns, page b's in the rest (the packed score tile's columns)."""
    col = gl.arange(0, HS, layout=gl.SliceLayout(0, acc_layout(HS)))
    return gl.where((col < HS // 2)[None, :], a[:, None], b[:, None])


@gluon.jit
def swap_halves(x):
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
    ks_a, kz_a = scale_pairs(ks_bufs.index(2 * s), HS)
    ks_b, kz_b = scale_pairs(ks_bufs.index(2 * s + 1), HS)
    vs_a, vz_a = scale_pairs(vs_bufs.index(2 * s), HS)
    vs_b, vz_b = scale_pairs(vs_bufs.index(2 * s + 1), HS)
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
    SPC: gl.constexpr = CFG.SPC
    HS: gl.constexpr = CFG.HS
    K_BITS: gl.constexpr = CFG.K_BITS
    V_BITS: gl.constexpr = CFG.V_BITS
    OPT: gl.constexpr = CFG.OPT
    HD: gl.constexpr = CFG.HD
    FAST_MAX: gl.constexpr = fast_max(OPT)
    FAST_RCP: gl.constexpr = fast_rcp(OPT)
    gl.static_assert(e4m3_operands(OPT) and HS == 8 and CFG.H <= HS // 2)
    gl.static_assert(not (CFG.V_CHANNEL or CFG.K_CHANNEL), "packed heads: token-wise K and V")
    SCALED_K: gl.constexpr = scaled_extraction(OPT, K_BITS, HD)
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    acc_l: gl.constexpr = acc_layout(HS)
    mma_l: gl.constexpr = acc_layout(HS, 32)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, zp_i = st
    pa_smem = p_bufs.index(2 * C)
    pb_smem = p_bufs.index(2 * C + 1)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    kx_a = k_fields_e4m3(load_k_words(kw_bufs.index(2 * s), K_BITS, HD), K_BITS, HD, SCALED_K)
    s_tok = warpgroup_mma(
        k_operand_from_fields(kx_a, HS, K_BITS, HD),
        qt_smem.permute((1, 0)),
        gl.zeros([64, HS], gl.float32, mma_l),
        use_acc=False,
        is_async=True,
    )
    SERIAL: gl.constexpr = V_BITS == 4  # INT4's registers: one K operand, V words read late
    if SERIAL:  # page a's K operand released before page b's is built
        s_tok, kx_a = warpgroup_mma_wait(0, deps=[s_tok, kx_a])
    kx_b = k_fields_e4m3(load_k_words(kw_bufs.index(2 * s + 1), K_BITS, HD), K_BITS, HD, SCALED_K)
    s_tok = warpgroup_mma(
        k_operand_from_fields(kx_b, HS, K_BITS, HD),
        qb_smem.permute((1, 0)),
        s_tok,
        use_acc=True,
        is_async=True,
    )
    # INT2 V words (8 registers for both pages) are read before the release; INT4's (16) after
    # the softmax, the stage held that much longer (at 112 registers INT4 spilled 22 bytes)
    EARLY_V: gl.constexpr = not SERIAL
    if EARLY_V:
        vw_a = load_v_words(vw_bufs.index(2 * s), V_BITS, HD, True)
        vw_b = load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD, True)
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
    m_new = gl.maximum(m_i, gl.maximum(cmax, swap_halves(cmax)))
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
        vw_a = load_v_words(vw_bufs.index(2 * s), V_BITS, HD, True)
        vw_b = load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD, True)
        mbarrier.arrive(empty.index(s))
    vx_a = vt_fields_e4m3(vw_a, V_BITS, HD, SCALED_V)
    pv_tok = warpgroup_mma(
        vt_operand_from_fields(vx_a, HS, HD),
        pa_smem.permute((1, 0)),
        gl.zeros([HD, HS], gl.float32, mma_l),
        use_acc=False,
        is_async=True,
    )
    vx_b = vt_fields_e4m3(vw_b, V_BITS, HD, SCALED_V)
    pv_tok = warpgroup_mma(
        vt_operand_from_fields(vx_b, HS, HD),
        pb_smem.permute((1, 0)),
        pv_tok,
        use_acc=True,
        is_async=True,
    )
    o_t, vx_a, vx_b = warpgroup_mma_wait(0, deps=[pv_tok, vx_a, vx_b])
    acc = acc * alpha[None, :] + gl.convert_layout(o_t, acc_l, assert_trivial=True)
    return m_new, l_i, z_i, acc, zp_i


@gluon.jit
def _tile_pair_packed_bf16(
    i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr
):
    """_tile_pair_packed with bf16 operands (mantissa injection, token-wise K and V): two pages'
    scores in one [64, HS] tile. Each page's K (and V) operand takes 32 registers, so page a's
    product completes before page b's operand is built (112 registers per consumer thread)."""
    SPC: gl.constexpr = CFG.SPC
    HS: gl.constexpr = CFG.HS
    K_BITS: gl.constexpr = CFG.K_BITS
    V_BITS: gl.constexpr = CFG.V_BITS
    OPT: gl.constexpr = CFG.OPT
    HD: gl.constexpr = CFG.HD
    FAST_MAX: gl.constexpr = fast_max(OPT)
    FAST_RCP: gl.constexpr = fast_rcp(OPT)
    gl.static_assert(not e4m3_operands(OPT) and HS == 8 and CFG.H <= HS // 2)
    gl.static_assert(not (CFG.V_CHANNEL or CFG.K_CHANNEL or reconstructs(OPT)), "packed heads: token-wise, folds")
    SCALED_V: gl.constexpr = scaled_extraction(OPT, V_BITS, HD)
    acc_l: gl.constexpr = acc_layout(HS)
    ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem = ops
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    m_i, l_i, z_i, acc, zp_i = st
    pa_smem = p_bufs.index(2 * C)
    pb_smem = p_bufs.index(2 * C + 1)
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    zero = gl.zeros([64, HS], gl.float32, acc_l)
    k_a = page_k_operand(load_k_words(kw_bufs.index(2 * s), K_BITS, HD), 0, 0, magic, HS, CFG)
    s_tok = warpgroup_mma(k_a, qt_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    s_tok, k_a = warpgroup_mma_wait(0, deps=[s_tok, k_a])
    k_b = page_k_operand(load_k_words(kw_bufs.index(2 * s + 1), K_BITS, HD), 0, 0, magic, HS, CFG)
    s_tok = warpgroup_mma(k_b, qb_smem.permute((1, 0)), s_tok, use_acc=True, is_async=True)
    rows = _pair_scales(ks_bufs, vs_bufs, s, HS)
    s_acc, k_b = warpgroup_mma_wait(0, deps=[s_tok, k_b])
    ks, kz, vs, vz = _pair_halves(rows, HS)  # the per-token factors, page a's columns first
    sc = _key_logits(s_acc, ks, kz, 0, qsums, qk_scale, CFG)
    if MASKED:
        sc, vs, vz = _mask_pair_rows(sc, vs, vz, t, n_q, HS)
    ratio = _value_ratio(vs, vz, False, FAST_RCP)
    cmax = _col_max(sc, HS, FAST_MAX)
    m_new = gl.maximum(m_i, gl.maximum(cmax, swap_halves(cmax)))
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
    vt_a = page_vt_operand(load_v_words(vw_bufs.index(2 * s), V_BITS, HD), 0, 0, magic, HS, CFG)
    pv_tok = warpgroup_mma(vt_a, pa_smem.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    pv_tok, vt_a = warpgroup_mma_wait(0, deps=[pv_tok, vt_a])
    vw_b = load_v_words(vw_bufs.index(2 * s + 1), V_BITS, HD)
    mbarrier.arrive(empty.index(s))  # every read of stage s is done (a partition bar.sync first)
    vt_b = page_vt_operand(vw_b, 0, 0, magic, HS, CFG)  # (the folds: no per-value factors)
    pv_tok = warpgroup_mma(vt_b, pb_smem.permute((1, 0)), pv_tok, use_acc=True, is_async=True)
    o_t, vt_b = warpgroup_mma_wait(0, deps=[pv_tok, vt_b])
    acc = acc * alpha[None, :] + o_t
    return m_new, l_i, z_i, acc, zp_i


# ------------------------------------------------------------------------ dispatch
@gluon.jit
def step(i, t, n_q, st, ops, C: gl.constexpr, CFG: gl.constexpr, MASKED: gl.constexpr):
    """Tile t, consumer C's i-th, of one page or two (CFG's TP), packed heads or not; ops = (ring,
    qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem)."""
    if packed_heads(CFG.OPT) and e4m3_operands(CFG.OPT):
        st = _tile_pair_packed(i, t, n_q, st, ops, C, CFG, MASKED)
    elif packed_heads(CFG.OPT):
        st = _tile_pair_packed_bf16(i, t, n_q, st, ops, C, CFG, MASKED)
    elif CFG.TP == 2:
        st = _tile_pair(i, t, n_q, st, ops, C, CFG, MASKED)
    else:
        st = _tile(i, t, n_q, st, ops, C, CFG, MASKED)
    return st
