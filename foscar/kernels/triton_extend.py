"""Extend attention (a chunked prefill's later chunks) over INT2/INT4 KV pages (Triton).

Math, for one request, one KV head and a block of the chunk's queries, in the log2 domain
(c = sm_scale * log2 e); query column (tau, h) is chunk token tau (position P + tau, with P the
request's stored tokens) and query head h of the KV head:
    S[n, (tau, h)] = c * Q[tau, h] . K[n]    n: the stored tokens (sink, history, tail) and the
                                            chunk's tokens j <= tau (bottom-right causal)
    O[(tau, h)] = sum_n exp2(S - m) V[n] / sum_n exp2(S - m)
The quantized history is read by the decode kernel's tile (foscar.kernels.triton_decode
``quantized_tile``) with the block's query columns in place of decode's heads, so it is folded
exactly as decode folds it (scales into Q or P, offsets as corrections from the rounded operand,
operands built from the packed bits); the BF16 sink and tail by decode's window program; the
chunk's own BF16 keys and values by a causal tile here. Split ``s`` of a launch reads its run of
history tiles; split 0 also reads the windows and the chunk and merges them in registers. One
split writes the output; several write log2-LSE partials that foscar.backends.combine merges.

Data contract (foscar.cache, foscar.formats; the decode kernel's, see its docstring):
    q:        [T, Hq, D] bf16 (fp32 under the interpreter), query head kvh * H + h
    k_chunk:  [T, Hkv, D] bf16, v_chunk likewise (the chunk's keys and values, stored coordinates)
    k_words, k_scales, v_*, k_sink, k_tail, ...: the layer's pools, as the decode kernel reads
    kv_indptr, kv_indices, num_quantized, seq_lens, slots: a DecodeBatch's, read at ``row``
    o:        [T, Hq, D] (one split), or o_part: [T, Hq, splits, D] fp32 and
    lse_part: [T, Hq, splits] fp32 log2-domain LSE (-inf when a split saw no token)
Supports what the decode Triton kernel supports (K_BITS, V_BITS in {2, 4}, D in {64, 128}, every
group axis and size the cache stores); the query columns HS = BLOCK_T * H padded to a power of two
of at least 16. Not: an fp32 query on a GPU (rounded to bf16 operands), RECONSTRUCT.
"""

import triton
import triton.language as tl

from .triton_decode import quantized_tile, tile_config, windows_partial
from .triton_loads import channel_scale_pages, channel_scales_at
from .triton_operands import fold_channel_k, pad_cols, pick_block, round_bf16, to_operand


@triton.jit
def _merge(o1, lse1, o2, lse2):
    """LSE merge of two normalised partials ``o: [D, HS]``, ``lse: [HS]`` (log2; -inf: empty)."""
    m = tl.maximum(lse1, lse2)
    m = tl.where(m == -float("inf"), 0.0, m)
    w1 = tl.exp2(lse1 - m)
    w2 = tl.exp2(lse2 - m)
    denom = w1 + w2
    safe = tl.where(denom > 0, denom, 1.0)
    o = (o1 * w1[None, :] + o2 * w2[None, :]) / safe[None, :]
    lse = tl.where(denom > 0, m + tl.log2(safe), -float("inf"))
    return o, lse


@triton.jit
def _history_partial(
    q,  # [HS, D] fp32
    row,
    kvh,
    split,
    num_splits,
    n_q,
    qk_scale,
    magic,
    zero,
    ptrs,  # (kv_indices, k_words, k_scales, v_words, v_scales)
    strides,  # (k_words, k_scales, v_words, v_scales) x (page, head)
    kv_indptr_ptr,
    HS: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_CHANNEL: tl.constexpr,
    V_CHANNEL: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    HPK: tl.constexpr,
    HPV: tl.constexpr,
    INTERP: tl.constexpr,
    TILE_ACC: tl.constexpr,
):
    """The history tiles of split ``split``, as the decode kernel's split program reads them:
    ``(o [D, HS], lse2 [HS])``, normalised (zeros and -inf when the split holds no tile)."""
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
    NGK: tl.constexpr = D // K_GROUP
    NGV: tl.constexpr = D // V_GROUP
    offs_d = tl.arange(0, D)
    page_base = tl.load(kv_indptr_ptr + row)
    n_pages = tl.load(kv_indptr_ptr + row + 1) - page_base
    n_tiles = tl.cdiv(n_q, BLOCK_N)
    # channel-wise K groups longer than a tile fold into Q once per group; splits take whole
    # groups (the history holds whole groups: foscar.cache demotes whole quanta)
    K_FOLD_ONCE: tl.constexpr = K_CHANNEL and K_GROUP > BLOCK_N
    KPT: tl.constexpr = K_GROUP // BLOCK_N if K_FOLD_ONCE else 1
    per_split = tl.cdiv(tl.cdiv(n_tiles, KPT), num_splits) * KPT
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    t_full = tl.maximum(tl.minimum(t_end, n_q // BLOCK_N), t_begin)

    if K_CHANNEL:
        qx = tl.zeros([D, HPK], tl.float32)  # built per tile (or group) from the group scales
        qsum_g = tl.zeros([1, HS], tl.float32)
        q_fold = tl.trans(q * qk_scale)  # [D, HS]
    else:
        # Qx[:, (g, h)] = Q[h] restricted to channel group g (exact in bf16)
        in_group = (offs_d[:, None] // K_GROUP == tl.arange(0, NGK)[None, :]).to(tl.float32)
        q_cols = tl.trans(q)[:, None, :] * in_group[:, :, None]  # [D, NGK, HS]
        qx = to_operand(pad_cols(q_cols.reshape(D, NGK * HS), HPK, 0.0), INTERP)
        qsum_g = tl.trans(tl.sum(q.reshape(HS, NGK, K_GROUP), axis=2)) * qk_scale  # [NGK, HS]
        if NGK == 1:
            qsum_g = qsum_g.reshape(HS)[None, :]
        q_fold = q
    if V_CHANNEL:
        z2 = tl.zeros([1, 1], tl.float32)
        # Note [channel-wise V scale prefetch] (foscar.kernels.triton_decode)
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
        z2 = tl.zeros([BLOCK_N, NGV * HS], tl.float32)
        pf_s = tl.zeros([1, 1], tl.float32)
        pf_z = tl.zeros([1, 1], tl.float32)
        pf_page = tl.zeros([1, 1], tl.int64)
    state = (
        tl.full([HS], -float("inf"), tl.float32),
        tl.zeros([BLOCK_N, HS], tl.float32),
        z2,
        tl.zeros([D, HPV], tl.float32),
        pf_s,
        pf_z,
        pf_page,
    )
    # the scale multipliers of token-wise K carry c = sm_scale * log2(e)
    k_mult = 1.0 if K_CHANNEL else qk_scale
    seq = (n_q, page_base, n_pages, kvh, magic, k_mult, zero, q_fold)
    CFG: tl.constexpr = tile_config(
        HS, D, PAGE, BLOCK_N, K_BITS, V_BITS, K_CHANNEL, V_CHANNEL, K_GROUP, V_GROUP, HPK, HPV,
        False, INTERP, TILE_ACC,
    )  # fmt: skip
    if K_FOLD_ONCE:
        for grp in range(t_begin // KPT, t_end // KPT):
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
                state = quantized_tile(
                    grp * KPT + sub, state, qx_g, corr_g, seq, ptrs, strides, CFG, False
                )
    else:
        for t in range(t_begin, t_full):
            state = quantized_tile(t, state, qx, qsum_g, seq, ptrs, strides, CFG, False)
        if t_full < t_end:
            state = quantized_tile(t_full, state, qx, qsum_g, seq, ptrs, strides, CFG, True)
    m_i, l2, z2, acc, pf_s, pf_z, pf_page = state
    l_i = tl.sum(l2, axis=0)  # [HS]
    if V_CHANNEL:
        NTV: tl.constexpr = BLOCK_N // V_GROUP if BLOCK_N > V_GROUP else 1
        if NTV == 1:
            out = pick_block(acc, offs_d * 0, 1, HS)
        else:
            out = tl.sum(acc.reshape(D, NTV, HS), axis=1)
    else:
        zacc = pad_cols(tl.sum(z2, axis=0)[None, :], HPV, 0.0)  # [1, HPV]
        out = pick_block(acc + zacc, offs_d // V_GROUP, NGV, HS)
    o = out / tl.where(l_i > 0, l_i, 1.0)[None, :]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), -float("inf"))
    return o, lse


@triton.jit
def _chunk_partial(
    qt,  # [D, HS] operand
    tok,  # [HS] int32: the chunk token of each query column (< num_tokens)
    key_end,  # chunk keys 0 .. key_end - 1 may be seen by the block
    k_ptr,  # this KV head's chunk keys, rows of stride stride_t
    v_ptr,
    stride_t,
    qk_scale,
    HS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The chunk's own BF16 keys and values under the causal mask (key j seen by the query
    columns of tokens >= j): ``(o [D, HS], lse2 [HS])``; every column sees key 0."""
    offs_d = tl.arange(0, D)
    offs = tl.arange(0, BLOCK_W)
    m_i = tl.full([HS], -float("inf"), tl.float32)
    l_i = tl.zeros([HS], tl.float32)
    acc = tl.zeros([D, HS], tl.float32)
    for t in range(0, tl.cdiv(key_end, BLOCK_W)):
        j = t * BLOCK_W + offs
        valid = j < key_end
        k = tl.load(k_ptr + j[:, None] * stride_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + j[:, None] * stride_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        if INTERP:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(k, qt) * qk_scale  # [BW, HS]
        s = tl.where(valid[:, None] & (j[:, None] <= tok[None, :]), s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = tl.dot(tl.trans(v), to_operand(round_bf16(p, INTERP), INTERP), acc * alpha[None, :])
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), -float("inf"))
    return o, lse


# the request's row, the chunk length and the split count vary from call to call: one compile
# for all of them (triton would specialize each on == 1 and on divisibility by 16)
@triton.jit(do_not_specialize=["row", "num_tokens", "num_splits"])
def extend_kernel(
    # pointers
    q_ptr,  # [T, Hq, D] bf16
    k_chunk_ptr,  # [T, Hkv, D] bf16
    v_chunk_ptr,  # [T, Hkv, D] bf16 (the strides of k_chunk)
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
    o_ptr,  # [T, Hq, D] (written when DIRECT)
    o_part_ptr,  # [T, Hq, splits, D] fp32 (written unless DIRECT)
    lse_part_ptr,  # [T, Hq, splits] fp32
    # scalars
    row,  # the request's row of the plan
    num_tokens,  # T
    qk_scale,  # sm_scale * log2(e)
    magic,  # 0x43004300
    zero,  # 0.0, opaque to the compiler (Note [tensor-core accumulation])
    num_splits,
    # strides (elements)
    stride_q_t,
    stride_q_h,
    stride_kc_t,
    stride_kc_h,
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
    stride_o_t,
    stride_o_h,
    stride_op_split,
    stride_op_t,
    stride_op_h,
    stride_lp_split,
    stride_lp_t,
    stride_lp_h,
    # constexprs
    H: tl.constexpr,  # query heads per KV head
    BLOCK_T: tl.constexpr,  # chunk tokens per program
    HS: tl.constexpr,  # query columns BLOCK_T * H, padded (power of two, >= 16)
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
    HPK: tl.constexpr,  # columns of the QK product: (column blocks x HS)
    HPV: tl.constexpr,  # columns of the PV product
    DIRECT: tl.constexpr,  # one split: write o, not partials
    ROUND_OUT: tl.constexpr,  # o is bf16 and the interpreter truncates: round first
    INTERP: tl.constexpr,
    TILE_ACC: tl.constexpr,
):
    """One (block of chunk tokens, KV head, history split)."""
    tl.static_assert(BLOCK_N % PAGE == 0 or PAGE % BLOCK_N == 0)
    tl.static_assert(HS >= 16 and HS >= BLOCK_T * H)
    tl.static_assert(D == 64 or D == 128)
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    offs_c = tl.arange(0, HS)
    offs_d = tl.arange(0, D)
    tok = qb * BLOCK_T + offs_c // H
    head = kvh * H + offs_c % H
    mask_c = (offs_c < BLOCK_T * H) & (tok < num_tokens)
    tok = tl.minimum(tok, num_tokens - 1)  # padded columns read (and see) a real token
    q_ptrs = q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_c[:, None], other=0.0).to(tl.float32)  # [HS, D]
    n_q = tl.load(num_quantized_ptr + row)

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
    o, lse = _history_partial(
        q, row, kvh, split, num_splits, n_q, qk_scale, magic, zero, ptrs, strides,
        kv_indptr_ptr, HS, D, PAGE, BLOCK_N, K_BITS, V_BITS, K_CHANNEL, V_CHANNEL, K_GROUP,
        V_GROUP, HPK, HPV, INTERP, TILE_ACC,
    )  # fmt: skip
    if split == 0:
        # Note [query reload]: Q is loaded again (an L2 hit) rather than kept live over the
        # history loop, where its [HS, D] fp32 took 32-64 registers per thread
        q = tl.load(q_ptrs, mask=mask_c[:, None], other=0.0).to(tl.float32)
        if HAS_WINDOWS:
            o_w, lse_w = windows_partial(
                q, row, kvh, qk_scale, n_q, seq_lens_ptr, slots_ptr, k_sink_ptr, v_sink_ptr,
                k_tail_ptr, v_tail_ptr, stride_sink_slot, stride_sink_head, stride_tail_slot,
                stride_tail_head, HS, D, SINK, TAIL, BLOCK_W, INTERP,
            )  # fmt: skip
            o, lse = _merge(o, lse, o_w, lse_w)
        key_end = tl.minimum(num_tokens, (qb + 1) * BLOCK_T)
        o_c, lse_c = _chunk_partial(
            to_operand(tl.trans(q), INTERP),
            tok,
            key_end,
            k_chunk_ptr + kvh * stride_kc_h,
            v_chunk_ptr + kvh * stride_kc_h,
            stride_kc_t,
            qk_scale,
            HS,
            D,
            BLOCK_W,
            INTERP,
        )
        o, lse = _merge(o, lse, o_c, lse_c)
    if DIRECT:
        if ROUND_OUT:
            o = round_bf16(o, INTERP)
        tl.store(
            o_ptr + tok[None, :] * stride_o_t + head[None, :] * stride_o_h + offs_d[:, None],
            o.to(o_ptr.dtype.element_ty),
            mask=mask_c[None, :],
        )
    else:
        tl.store(
            o_part_ptr
            + split * stride_op_split
            + tok[None, :] * stride_op_t
            + head[None, :] * stride_op_h
            + offs_d[:, None],
            o,
            mask=mask_c[None, :],
        )
        tl.store(
            lse_part_ptr + split * stride_lp_split + tok * stride_lp_t + head * stride_lp_h,
            lse,
            mask=mask_c,
        )
