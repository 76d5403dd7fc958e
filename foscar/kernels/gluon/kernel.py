"""The warp-specialized FOSCAR decode split kernel for Hopper (sm_90a), in Triton's Gluon dialect.

Math, for one sequence, one KV head and its H query heads, log2 domain (c = sm_scale log2 e):
    S[n, h] = c sum_d Q[h, d] (s' y + z')_K[n, d]       y = 128 + q, built from the packed bits
    P = exp2(S - m);  O[h] = sum_n P[n, h] (s' y + z')_V[n] / sum_n P[n, h]
over this split's tiles of the quantized history, the scales folded, never applied per value
(foscar.kernels.gluon.tiles has the folds).

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

Data contract (foscar.cache; the same as the Triton ``decode_split_kernel``):
    q:        [B, Hq, D] bf16
    k_words:  [pages, Hkv, PS, W = D*bits/32] int32 (channel order of role "key")
              -> TMA box [1, 1, min(PS, 64), W]
    k_scales: [pages, Hkv, PS*D/g, 2] fp32 viewed as [pages, Hkv, 2*PS]
              -> TMA box [1, 1, 2 min(PS, 64)]
    v_*:      likewise (role "value")
    o_part:   [B, Hq, num_splits, D] fp32, normalised partial outputs
    lse_part: [B, Hq, num_splits] fp32, log2-domain LSE (-inf when empty)
A launch of one part (one split, no BF16 window partial) writes ``out`` [B, Hq, D] and the
natural-log LSE itself; otherwise the Triton ``merge_splits_kernel`` merges the partials, as a
programmatic dependent launch that this kernel's CTAs signal after storing them
(GluonFlag.MERGE_PDL).

``CFG``, the compile-time configuration every partition takes, read by field name
(foscar.kernels.gluon.layouts.TileConfig: SPC, HS, K_BITS, V_BITS, V_CHANNEL, OPT, K_CHANNEL,
HD, TP, H, PS); ``CFG.OPT`` holds the config's GluonFlag bits.

Supported: INT2/INT4 K and V, each token-wise (g = D) or channel-wise (groups of 128 tokens = 2
pages) at D = 128, token-wise at D = 64; cache pages of 64 tokens, or 16-256 for token-wise K
and V (a tile is 64 tokens: 64 / PS whole pages or a 64-row part of one); tiles of TP = 1 or 2
pages; up to 8 query heads per KV head (HS = 8); the quantized history only (a format's BF16
sink and recent windows are read by the Triton window program into one more partial). B operands
are stored K-major: MN-major Q^T / P' with 16-byte rows made the wgmma read shared memory out of
bounds on the H200 (compute-sanitizer memcheck).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from .layouts import (
    UNIT,
    acc_layout,
    e4m3_operands,
    merge_pdl,
    packed_heads,
    plain_shared_layout,
    q_in_consumers,
    scaled_extraction,
    tile_config,
)
from .operands import e4m3_key_channel, pow4, scaled_exponent_k, scaled_exponent_v
from .tiles import step, swap_halves

__all__ = ["gluon_decode_split_kernel"]


@gluon.jit
def _split_span(seq_ptrs, num_splits, TP: gl.constexpr):
    """This CTA's tiles (TP pages each), as decode_split_kernel computes them for pages: (t_begin,
    t_full, t_end, n_q, page_base). Every partition computes it from the kernel's arguments: values
    computed before ``warp_specialize`` reach the workers through a shared-memory capture buffer
    that triton 3.6 lets the default partition's layout-conversion scratch overlap, so consumer 0
    could overwrite a worker's span before the worker read it (compute-sanitizer racecheck,
    wrong outputs on the H200 that changed from call to call)."""
    kv_indptr_ptr, num_quantized_ptr = seq_ptrs
    b = gl.program_id(0)
    split = gl.program_id(2)
    n_q = gl.load(num_quantized_ptr + b)
    page_base = gl.load(kv_indptr_ptr + b)
    n_tiles = gl.cdiv(n_q, 64 * TP)
    per_split = gl.cdiv(n_tiles, num_splits)
    t_begin = gl.minimum(split * per_split, n_tiles)
    t_end = gl.minimum(t_begin + per_split, n_tiles)
    t_full = gl.maximum(gl.minimum(t_end, n_q // (64 * TP)), t_begin)
    return t_begin, t_full, t_end, n_q, page_base


# ------------------------------------------------------------------------ consumers
@gluon.jit
def _consume(C: gl.constexpr, ring, q_args, op_bufs, split, qk_scale, magic, CFG: gl.constexpr):
    """Consumer C's loop over tiles t_begin + C + 2i; returns (m, l, unnormalised O^T [D, HS]).
    q_args: (q_ptr, stride_q_b, stride_q_h) for _stage_q (GluonFlag.Q_IN_CONSUMERS); split:
    (seq_ptrs, num_splits) for _split_span; op_bufs: (P'^T per page, channel-wise K's Q' and zq,
    Q^T and its per-head factor) buffers of both consumers; CFG: see the kernel."""
    TP: gl.constexpr = CFG.TP
    HS: gl.constexpr = CFG.HS
    OPT: gl.constexpr = CFG.OPT
    K_CHANNEL: gl.constexpr = CFG.K_CHANNEL
    HD: gl.constexpr = CFG.HD
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
    t_begin, t_full, t_end, n_q, _ = _split_span(*split, TP)
    E4M3: gl.constexpr = e4m3_operands(OPT)
    SCALED_K: gl.constexpr = scaled_extraction(OPT, CFG.K_BITS, HD) and not K_CHANNEL
    SCALED_V: gl.constexpr = scaled_extraction(OPT, CFG.V_BITS, HD) and not CFG.V_CHANNEL
    ql: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    qf = qt_smem.load(ql).to(gl.float32)  # Q, or Q~ = Q 4^-a with the scaled extraction
    if PACKED:  # column c of the score tile: head c % (HS / 2), from qa or qb
        qf = qf + qb_smem.load(ql).to(gl.float32)
    if E4M3:  # qf = Q^ 2^sigma 4^-a per column (see the kernel): sum(Q^) and hf = 2^(9 - sigma)
        k = gl.arange(0, HD, layout=gl.SliceLayout(0, ql))
        if SCALED_K:
            qf = qf * pow4((k // 16) % 2, False)[None, :]
        hf = hf_smem.load(gl.SliceLayout(0, acc_l))
        q_sum = gl.convert_layout(gl.sum(qf, axis=1), gl.SliceLayout(0, acc_l)) * hf * (1 / 512)
        dq = hf
    elif SCALED_K:
        c = gl.arange(0, HD, layout=gl.SliceLayout(0, ql))
        q_sum = gl.sum(qf * pow4(scaled_exponent_k(c), False)[None, :], axis=1)
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
    st = (  # the online-softmax state (see foscar.kernels.gluon.tiles)
        gl.full([HS], -float("inf"), gl.float32, gl.SliceLayout(0, acc_l)),
        gl.zeros([64, HS], gl.float32, acc_l),
        gl.zeros([64, HS], gl.float32, acc_l),
        gl.zeros([HD, HS], gl.float32, acc_l),
        gl.zeros([64, HS], gl.float32, acc_l),  # sum of P' (scaled token-wise V, E4M3)
    )
    n_all = gl.maximum(t_end - t_begin - C + 1, 0) // 2
    n_full = gl.maximum(t_full - t_begin - C + 1, 0) // 2
    ops = (ring, qt_smem, p_bufs, qsums, kfold, qk_scale, magic, qb_smem)
    for i in range(n_full):
        st = step(i, t_begin + C + 2 * i, n_q, st, ops, C, CFG, False)
    if n_full < n_all:  # the last tile, partly past the history
        st = step(n_full, t_begin + C + 2 * n_full, n_q, st, ops, C, CFG, True)
    m_i, l_i, z_i, acc, zp_i = st
    l_tot = gl.sum(l_i, axis=0)
    num = acc + gl.sum(z_i, axis=0)[None, :]  # V offset term: one scalar per head for g = D
    if E4M3:  # acc = sum P'^ q 4^a / 2 (E4M3 y = q 4^a 2^-9 against 256 P'^); see _tile
        c = gl.arange(0, HD, layout=gl.SliceLayout(1, acc_l))
        if SCALED_V:
            vfac = 2.0 * pow4((c // 8) % 2, True)
        else:
            vfac = gl.full([HD], 2.0, gl.float32, gl.SliceLayout(1, acc_l))
        C_MID: gl.constexpr = ((1 << CFG.V_BITS) - 1) / 2
        offset = gl.sum(z_i, axis=0) - (C_MID / 256) * gl.sum(zp_i, axis=0)
        num = acc * vfac[:, None] + offset[None, :]
    elif SCALED_V:  # acc holds sum_n P' y~, y~ = 128 + 4^a q: O = acc 4^-a + 128 (1 - 4^-a) sum P'
        c = gl.arange(0, HD, layout=gl.SliceLayout(1, acc_l))
        inv = pow4(scaled_exponent_v(c), True)
        p_tot = gl.sum(zp_i, axis=0)
        num = acc * inv[:, None] + (128.0 * (1.0 - inv))[:, None] * p_tot[None, :]
        num = num + gl.sum(z_i, axis=0)[None, :]
    if PACKED:  # each head's two columns (pages a and b, one running max) added
        num = num + swap_halves(num)
        l_tot = l_tot + swap_halves(l_tot)
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


@gluon.jit
def _stage_q(q_ptr, stride_q_b, stride_q_h, qt_smem, hf_smem, CFG: gl.constexpr, qb_smem=0):
    """Q [HS, D] of this CTA's KV head into ``qt_smem`` as the QK product's operand, K-major (its
    transposed view is the B operand; heads past H are zero), and the per-head factor into
    ``hf_smem`` (E4M3: 2^(9 - sigma); bf16: 1). The caller fences and synchronizes.
    B operands are stored K-major (MN-major B with 16-byte rows read out of bounds on the H200:
    compute-sanitizer memcheck). Packed heads (GluonFlag.PACKED_HEADS): row c holds head
    c % (HS / 2), in ``qt_smem`` for the first HS / 2 rows (page a's columns) and in ``qb_smem``
    for the rest, the other rows zero; ``hf_smem`` per row."""
    HS: gl.constexpr = CFG.HS
    K_BITS: gl.constexpr = CFG.K_BITS
    OPT: gl.constexpr = CFG.OPT
    K_CHANNEL: gl.constexpr = CFG.K_CHANNEL
    HD: gl.constexpr = CFG.HD
    H: gl.constexpr = CFG.H
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    h_row = gl.arange(0, HS, layout=gl.SliceLayout(1, ql))
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, ql))
    E4M3: gl.constexpr = e4m3_operands(OPT)
    PACKED: gl.constexpr = packed_heads(OPT)
    h = h_row % (HS // 2) if PACKED else h_row
    # E4M3: column d holds channel e4m3_key_channel(d) (the K operand's column order)
    q_cols = e4m3_key_channel(d, K_BITS) if E4M3 else d
    # E4M3: rows past H load row h % H and are zeroed by a product below, not by a masked
    # load: with the load's constant zeros, all of a padding row's E4M3 pairs are one value,
    # and ptxas (triton 3.6.0's) packs such a pair with the upper half taken from a register
    # never written (F2FP.E4M3 ..._MERGE_C Rd, Ra, Ra, R3), so the stored row held junk
    # (nonzero padding rows on the H200; racecheck's write-write hazard between the lanes that
    # store it)
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
            qf = qf * pow4((d // 16) % 2, True)[None, :]
        amax = gl.max(gl.abs(qf), axis=1)
        ebits = gl.minimum(
            gl.maximum(261 - ((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF), 1), 254
        )
        q8 = qf * (ebits << 23).to(gl.float32, bitcast=True)[:, None]
        if PACKED:
            # the zero halves from a product, not a constant (the ptxas pairing above: with
            # constant zeros these rows read back nonzero on the H200)
            first = (h_row < HS // 2)[:, None]
            zero = q8 * 0.0
            qt_smem.store(gl.where(first, q8, zero).to(gl.float8e4nv))
            qb_smem.store(gl.where(first, zero, q8).to(gl.float8e4nv))
        else:
            qt_smem.store(q8.to(gl.float8e4nv))
        hf_smem.store(((263 - ebits) << 23).to(gl.float32, bitcast=True))
    else:
        if scaled_extraction(OPT, K_BITS, HD) and not K_CHANNEL:  # Q~ = Q 4^-a, exact in bf16
            qt = (qt.to(gl.float32) * pow4(scaled_exponent_k(d), True)[None, :]).to(gl.bfloat16)
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


# ------------------------------------------------------------------------ producer
@gluon.jit
def _producer(descs, ring, kv_indices_ptr, split, CFG: gl.constexpr):
    kw_desc, ks_desc, vw_desc, vs_desc = descs
    TP: gl.constexpr = CFG.TP
    PS: gl.constexpr = CFG.PS
    if PS != UNIT:
        _producer_units(descs, ring, kv_indices_ptr, split, CFG)
        return
    t_begin, _, t_end, n_q, page_base = _split_span(*split, TP)
    kvh = gl.program_id(1)
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
    SPC: gl.constexpr = CFG.SPC
    V_CHANNEL: gl.constexpr = CFG.V_CHANNEL
    K_CHANNEL: gl.constexpr = CFG.K_CHANNEL
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
        if TP == 2:
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
    TP: gl.constexpr = CFG.TP
    PS: gl.constexpr = CFG.PS
    SPC: gl.constexpr = CFG.SPC
    gl.static_assert(
        not (CFG.V_CHANNEL or CFG.K_CHANNEL), "page sizes other than 64: token-wise K and V"
    )
    t_begin, _, t_end, n_q, page_base = _split_span(*split, TP)
    kvh = gl.program_id(1)
    kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty = ring
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


# ------------------------------------------------------------------------ kernel
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
    OPT: gl.constexpr,  # int(GluonDecodeConfig.flags): foscar.configs.GluonFlag
    PS: gl.constexpr = 64,  # the cache's page size: 64, or 16-256 for token-wise K and V
):
    """One (sequence, KV head, split) of the quantized history: a normalised partial output and
    its log2 LSE, or, for a launch of one part (``num_parts == 1``), the output itself."""
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
    # GluonFlag.Q_IN_CONSUMERS) and its per-head factor
    op_dtype: gl.constexpr = gl.float8e4nv if e4m3_operands(OPT) else gl.bfloat16
    qt_bufs = gl.allocate_shared_memory(  # packed heads: each consumer's qb at 2 + C
        op_dtype,
        [4 if packed_heads(OPT) else 2, HS, HD],
        gl.NVMMASharedLayout.get_default_for([HS, HD], op_dtype),
    )
    hf_bufs = gl.allocate_shared_memory(gl.float32, [2 * HS], plain_shared_layout(1))
    CFG: gl.constexpr = tile_config(
        SPC, HS, K_BITS, V_BITS, V_CHANNEL, OPT, K_CHANNEL, HD, TP, H, PS
    )
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
