"""Warp-specialized FOSCAR decode split kernel in Gluon (Hopper, sm_90a): a compile-only prototype.

Scope: token-wise INT2 K and V, group size g = D = 128, 4 query heads per KV head padded to
HS = 8 (wgmma n8), page size 64 = one tile, one (sequence, KV head, split) per CTA, quantized
history only (no BF16 sink/tail windows: the Triton kernel's window split can stay as is).

Partitions (gl.warp_specialize, triton 3.6.0):
    default  (4 warps): consumer 0, tiles t_begin + 0, 2, 4, ...; at the end merges consumer 1's
                        softmax state (through shared memory) and writes the split's output
    worker 0 (4 warps): consumer 1, tiles t_begin + 1, 3, 5, ...
    worker 1 (1 warp) : producer, TMA copies of packed K/V words and (s', z') scales of one page
                        per tile into a ring of 2 x SPC stages (SPC stages per consumer)

Per tile, a consumer (one warpgroup) does
    LDS packed words -> K operand [64 tok, 128 ch] bf16 in registers (SHF + LOP3, no PRMT)
    S^T = K_op @ Q^T        wgmma m64n8k16 x 8, A from registers, Q^T [128, 8] bf16 in smem
    V^T operand [128 ch, 64 tok] (PRMT + SHF + LOP3) while the QK wgmma runs
    acc-fold of K (per token s'_K, z'_K), online softmax over the 64 tokens (cross-warp max)
    operand-fold of V into P: P' = bf16(P * s'_V); offset term z2 += P' * z'_V / s'_V
    O^T(tile) = V^T_op @ P'   wgmma m64n8k16 x 2 x 4, P' [64, 8] bf16 through smem,
    added to the running O^T on the CUDA cores (Note [tensor-core accumulation] in foscar)

Data contract (foscar.cache / foscar.kernels.triton_decode.decode_split_kernel):
    q:        [B, Hq, D] bf16
    k_words:  [pages, Hkv, PAGE, D*2/32] int32 (channel order of role "key") -> TMA box [1,1,64,8]
    k_scales: [pages, Hkv, PAGE*D/g, 2] fp32 viewed as [pages, Hkv, 2*PAGE]  -> TMA box [1,1,128]
    v_*:      likewise (role "value")
    o_part:   [B, Hq, num_splits (+1 window part), D] fp32, normalised partial outputs
    lse_part: [B, Hq, num_splits (+1)] fp32, log2-domain LSE (-inf when empty)

Packed words: foscar's Hopper layouts are used unchanged; both fit the wgmma register fragments
(checked with convert_layout(..., assert_trivial=True): the bit twiddling lands every bf16 pair in
the register the m64nNk16 A fragment wants, so no data moves between threads):
    K: thread (warp w, lane l) owns rows l//4 + 8i + 16w and words 2*(l%4) + {0,1} of its rows
       (2 x LDS.64 per tile); register (i, i', kb) = field 2*(kb%4) + i' of word 2*(l%4) + kb//4.
    V: thread owns byte (l//4)%4 of word 2w + (l//4)//4 of 16 tokens (16 x LDS.32, 4 threads read
       the same word); one PRMT per token pair joins the bytes, 4 SHF/LOP3 pairs make 8 operands.

The file also holds a numpy emulation (`emulate_*`) that replays the kernel's tensor program on
packed words made by foscar.formats and checks, bit for bit, that the operand tensors equal
0x4300 | code, and that the compiler's layouts match the PTX wgmma fragment formula.

    python foscar_gluon_proto.py            # emulation + compile for sm_90a + SASS report
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_init  # noqa: E402

D = 128
PAGE = 64
WORDS = D * 2 // 32  # 8 int32 words per token row (INT2)


# ------------------------------------------------------------------------------------------ layouts
@gluon.constexpr_function
def acc_layout(HS):
    """wgmma accumulator (and, sliced, per-token / per-head vectors): one warpgroup, n = HS."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HS, 16])


@gluon.constexpr_function
def a_operand_layout(HS):
    """wgmma A operand in registers, bf16 (k_width 2: a bf16 pair per 32-bit register)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout(HS), k_width=2)


@gluon.constexpr_function
def k_words3_layout():
    """[64 tokens, 8 words, 8 fields]: words exactly as the m64n8 accumulator (thread owns rows
    l//4 + 8i + 16w, words 2*(l%4) + e), the 8 extraction fields in registers."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [8, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 8, 8],
    )


@gluon.constexpr_function
def v_words4_layout():
    """[32 token pairs m, 8 words, 4 bytes X, 4 fields]: pair m = 8kb + 4i' + T with T = lane%4,
    word = 2w + (lane//4)//4, byte X = (lane//4)%4, the fields and (kb, i') in registers."""
    return gl.DistributedLinearLayout(
        reg_bases=[[4, 0, 0, 0], [8, 0, 0, 0], [16, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]],
        lane_bases=[[1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0]],
        warp_bases=[[0, 2, 0, 0], [0, 4, 0, 0]],
        block_bases=[],
        shape=[32, 8, 4, 4],
    )


@gluon.constexpr_function
def v_words_load_layout():
    """[64 tokens, 8 words] as the V path reads them from smem: token bit 0 (the pair's parity)
    in a register, lanes 2,3 replicated (the 4 threads that take different bytes of one word)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 1]],
        warp_bases=[[0, 2], [0, 4]],
        block_bases=[],
        shape=[64, 8],
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
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, HS])


@gluon.constexpr_function
def plain_shared_layout(rank):
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=list(range(rank - 1, -1, -1)))


# ------------------------------------------------------------------------------ bits -> operands
@gluon.jit
def _prmt(a, b, sel):
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _bf16_pair(x):
    """int32 [...] holding two bf16 (low, high) -> bf16 [..., 2] (register views, no instructions)."""
    lo = (x & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (x >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _k_operand(words, magic, HS: gl.constexpr):
    """K operand [64 tokens, 128 channels] bf16 (natural channel order) in the wgmma A layout,
    from words [64, 8] in SliceLayout(2, k_words3_layout())."""
    L3: gl.constexpr = k_words3_layout()
    f = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    x = ((gl.expand_dims(words, 2) >> (2 * f)[None, None, :]) & 0x00030003) | magic  # [n, word, k]
    y = _bf16_pair(x)  # [n, word = 2T + e, k = 2*kbl + i', j]
    y = y.reshape([64, 4, 2, 4, 2, 2])  # n, T, e, kbl, i', j
    y = gl.permute(y, [0, 2, 3, 4, 1, 5])  # n, e, kbl, i', T, j : channel 64e + 16kbl + 8i' + 2T + j
    return gl.convert_layout(y.reshape([64, 128]), a_operand_layout(HS), assert_trivial=True)


@gluon.jit
def _vt_operand(words, magic, HS: gl.constexpr):
    """V^T operand [128 channels, 64 tokens] bf16 in the wgmma A layout, from words [64, 8] in
    v_words_load_layout(). One PRMT joins byte X of an even and an odd token (twice each)."""
    L4: gl.constexpr = v_words4_layout()
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    even, odd = gl.split(gl.permute(words.reshape([32, 2, 8]), [0, 2, 1]))  # [m, word] each
    even = gl.convert_layout(even, gl.SliceLayout(2, L3), assert_trivial=True)
    odd = gl.convert_layout(odd, gl.SliceLayout(2, L3), assert_trivial=True)
    X = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    sel = X | (X << 4) | ((X + 4) << 8) | ((X + 4) << 12)  # bytes (a.X, a.X, b.X, b.X)
    xb = _prmt(gl.expand_dims(even, 2), gl.expand_dims(odd, 2), sel[None, None, :])  # [m, word, X]
    f = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    x = ((gl.expand_dims(xb, 3) >> (2 * f)[None, None, None, :]) & 0x00030003) | magic
    y = _bf16_pair(x)  # [m, word, X, f, J]
    y = y.reshape([4, 2, 4, 4, 2, 4, 2, 2, 2])  # kb, i', T, w, g2, X, b, a, J
    y = gl.permute(y, [6, 3, 7, 4, 5, 0, 1, 2, 8])  # b, w, a, g2, X | kb, i', T, J
    return gl.convert_layout(y.reshape([128, 64]), a_operand_layout(HS), assert_trivial=True)


@gluon.jit
def _scale_pairs(buf, HS: gl.constexpr):
    """(s', z') of the 64 tokens of a tile, each [64] in the accumulator's row layout."""
    sz = buf.reshape([64, 2]).load(scale_pair_layout())
    s, z = gl.split(sz)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout(HS))
    return (gl.convert_layout(s, row_l, assert_trivial=True),
            gl.convert_layout(z, row_l, assert_trivial=True))


@gluon.jit
def _rcp(x):
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _col_max(sc, HS: gl.constexpr, FAST_MAX: gl.constexpr):
    """max over the 64 token rows of sc [64, HS] (acc layout) -> [HS] in SliceLayout(0, acc)."""
    if FAST_MAX:
        # per-warp max (shuffles only), then one exchange of the 4 warp maxima through smem
        wmax = gl.max(sc.reshape([4, 16, HS]), axis=1)  # [4 warps, HS]
        wmax = gl.convert_layout(wmax, warp_max_layout(HS))
        return gl.convert_layout(gl.max(wmax, axis=0), gl.SliceLayout(0, acc_layout(HS)),
                                 assert_trivial=True)
    else:
        return gl.max(sc, axis=0)


# ------------------------------------------------------------------------------------- consumer
# OPT bits (constexpr): 1 = one-barrier cross-warp max; 2 = deferred PV wait (the PV wgmma of tile
# i in flight across the loop back-edge: ptxas C7512 serializes every wgmma, do not use);
# 4 = rcp.approx for z'/s'; 8 = arrive on `empty` after the QK wgmma issue (same barrier count);
# 32 = memory-only timing ablation (consumers only wait/arrive); 64 = compute-only timing
# ablation (after the first 2*SPC tiles the producer arrives without loading). Default 5.
@gluon.jit
def _tile(i, t, n_q, st, kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_smem, qsum,
          qk_scale, magic, C: gl.constexpr, SPC: gl.constexpr, HS: gl.constexpr,
          MASKED: gl.constexpr, OPT: gl.constexpr):
    FAST_MAX: gl.constexpr = (OPT & 1) != 0
    PIPE: gl.constexpr = (OPT & 2) != 0
    FAST_RCP: gl.constexpr = (OPT & 4) != 0
    acc_l: gl.constexpr = acc_layout(HS)
    m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev = st
    s = C * SPC + i % SPC
    mbarrier.wait(ready.index(s), (i // SPC) & 1)
    MEMORY_ONLY: gl.constexpr = (OPT & 32) != 0
    if MEMORY_ONLY:  # timing ablation: stream the ring, no math (the output is garbage)
        mbarrier.arrive(empty.index(s))
        return m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev
    kw = kw_bufs.index(s).reshape([64, 8]).load(gl.SliceLayout(2, k_words3_layout()))
    vw = vw_bufs.index(s).reshape([64, 8]).load(v_words_load_layout())
    ks, kz = _scale_pairs(ks_bufs.index(s), HS)
    vs, vz = _scale_pairs(vs_bufs.index(s), HS)
    LATE_ARRIVE: gl.constexpr = (OPT & 8) != 0
    if not LATE_ARRIVE:
        mbarrier.arrive(empty.index(s))  # stage s may be refilled (Gluon puts a partition bar.sync first)

    k_op = _k_operand(kw, magic, HS)
    s_tok = warpgroup_mma(k_op, qt_smem.permute((1, 0)), gl.zeros([64, HS], gl.float32, acc_l), use_acc=False,
                          is_async=True)
    if LATE_ARRIVE:
        mbarrier.arrive(empty.index(s))  # after the QK wgmma is issued
    vt_op = _vt_operand(vw, magic, HS)  # meant to overlap the QK wgmma
    if FAST_RCP:
        ratio = vz * _rcp(vs)
    else:
        ratio = gl.fdiv(vz, vs)
    if PIPE:
        # waits for QK(i) and for PV(i-1), issued at the end of the previous tile
        s_acc, k_op, o_prev, vt_prev = warpgroup_mma_wait(0, deps=[s_tok, k_op, o_tok, vt_prev])
        acc = acc * alpha_prev[None, :] + o_prev
    else:
        s_acc, k_op = warpgroup_mma_wait(0, deps=[s_tok, k_op])

    # acc-fold of token-wise K: S = c * (s'_K * (Q . y_K) + z'_K * sum(Q)), c in ks and qsum
    sc = s_acc * (ks * qk_scale)[:, None] + kz[:, None] * qsum[None, :]
    if MASKED:
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        valid = t * 64 + rows < n_q
        sc = gl.where(valid[:, None], sc, -float("inf"))
        vs = gl.where(valid, vs, 1.0)
        ratio = gl.where(valid, ratio, 0.0)
    m_new = gl.maximum(m_i, _col_max(sc, HS, FAST_MAX))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[None, :])
    l_i = l_i * alpha[None, :] + p  # row sums reduced once after the loop
    # operand-fold of token-wise V into P, offset term from the rounded P'
    pv = (p * vs[:, None]).to(gl.bfloat16)
    z_i = z_i * alpha[None, :] + pv.to(gl.float32) * ratio[:, None]
    p_smem.store(gl.permute(pv, [1, 0]))  # P'^T [HS, 64]: K-major B operand
    fence_async_shared()
    o_tok = warpgroup_mma(vt_op, p_smem.permute((1, 0)), gl.zeros([128, HS], gl.float32, acc_l), use_acc=False,
                          is_async=True)
    if PIPE:
        alpha_prev = alpha
        vt_prev = vt_op
    else:
        o_t, vt_op = warpgroup_mma_wait(0, deps=[o_tok, vt_op])
        acc = acc * alpha[None, :] + o_t  # fresh accumulator per tile, added in fp32
    return m_new, l_i, z_i, acc, o_tok, alpha_prev, vt_prev


@gluon.jit
def _consume(C: gl.constexpr, kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_bufs,
             t_begin, t_full, t_end, n_q, qk_scale, magic, SPC: gl.constexpr, HS: gl.constexpr,
             OPT: gl.constexpr):
    """Consumer C's loop over tiles t_begin + C + 2i; returns (m, l, unnormalised O^T [D, HS])."""
    PIPE: gl.constexpr = (OPT & 2) != 0
    acc_l: gl.constexpr = acc_layout(HS)
    p_smem = p_bufs.index(C)
    qf = qt_smem.load(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])).to(gl.float32)
    qsum = gl.convert_layout(gl.sum(qf, axis=1), gl.SliceLayout(0, acc_l)) * qk_scale
    acc = gl.zeros([128, HS], gl.float32, acc_l)
    st = (gl.full([HS], -float("inf"), gl.float32, gl.SliceLayout(0, acc_l)),
          gl.zeros([64, HS], gl.float32, acc_l),
          gl.zeros([64, HS], gl.float32, acc_l),
          acc,
          warpgroup_mma_init(acc),
          gl.full([HS], 1.0, gl.float32, gl.SliceLayout(0, acc_l)),
          gl.zeros([128, 64], gl.bfloat16, a_operand_layout(HS)))
    n_all = gl.maximum(t_end - t_begin - C + 1, 0) // 2
    n_full = gl.maximum(t_full - t_begin - C + 1, 0) // 2
    for i in range(n_full):
        st = _tile(i, t_begin + C + 2 * i, n_q, st, kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty,
                   qt_smem, p_smem, qsum, qk_scale, magic, C, SPC, HS, False, OPT)
    if n_full < n_all:
        st = _tile(n_full, t_begin + C + 2 * n_full, n_q, st, kw_bufs, ks_bufs, vw_bufs, vs_bufs,
                   ready, empty, qt_smem, p_smem, qsum, qk_scale, magic, C, SPC, HS, True, OPT)
    m_i, l_i, z_i, acc, o_tok, alpha_prev, vt_prev = st
    if PIPE:
        o_prev, vt_prev = warpgroup_mma_wait(0, deps=[o_tok, vt_prev])
        acc = acc * alpha_prev[None, :] + o_prev
    l_tot = gl.sum(l_i, axis=0)
    num = acc + gl.sum(z_i, axis=0)[None, :]  # V offset term: one scalar per head for g = D
    return m_i, l_tot, num


@gluon.jit
def _consumer1(kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_bufs, m_smem, l_smem,
               o_smem, t_begin, t_full, t_end, n_q, qk_scale, magic, SPC: gl.constexpr,
               HS: gl.constexpr, OPT: gl.constexpr):
    """Consumer 1 leaves its state in shared memory; the kernel merges it after the partitions
    join (the join is a CTA barrier, so no mbarrier hand-off is needed)."""
    m1, l1, num1 = _consume(1, kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_bufs,
                            t_begin, t_full, t_end, n_q, qk_scale, magic, SPC, HS, OPT)
    m_smem.store(m1)
    l_smem.store(l1)
    o_smem.store(num1)


@gluon.jit
def _consumer0(kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_bufs, t_begin, t_full,
               t_end, n_q, qk_scale, magic, SPC: gl.constexpr, HS: gl.constexpr, OPT: gl.constexpr):
    return _consume(0, kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_bufs,
                    t_begin, t_full, t_end, n_q, qk_scale, magic, SPC, HS, OPT)


@gluon.jit
def _merge_and_store(m0, l0, num0, m_smem, l_smem, o_smem, o_base, lse_base, stride_op_h,
                     stride_lp_h, H: gl.constexpr, HS: gl.constexpr):
    """Merge consumer 1's state (shared memory) into consumer 0's and write this split's partial."""
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
    d = gl.arange(0, 128, layout=gl.SliceLayout(1, acc_l))
    h = gl.arange(0, HS, layout=gl.SliceLayout(0, acc_l))
    gl.store(o_base + h[None, :] * stride_op_h + d[:, None], o, mask=(h < H)[None, :])
    gl.store(lse_base + h * stride_lp_h, lse, mask=h < H)


# ------------------------------------------------------------------------------------- producer
@gluon.jit
def _producer(kw_desc, ks_desc, vw_desc, vs_desc, kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty,
              kv_indices_ptr, page_base, t_begin, t_end, kvh, SPC: gl.constexpr, OPT: gl.constexpr):
    COMPUTE_ONLY: gl.constexpr = (OPT & 64) != 0
    nbytes: gl.constexpr = (kw_desc.block_type.nbytes + ks_desc.block_type.nbytes
                            + vw_desc.block_type.nbytes + vs_desc.block_type.nbytes)
    n = t_end - t_begin
    idx = kv_indices_ptr + page_base + t_begin
    page_next = gl.load(idx, mask=n > 0, other=0)
    for j in range(n):
        # the page index of tile j+1 is loaded one iteration ahead: its latency overlaps the
        # wait for a free stage instead of delaying the TMA issue
        page = page_next
        page_next = gl.load(idx + j + 1, mask=j + 1 < n, other=0)
        i = j // 2
        s = (j % 2) * SPC + i % SPC
        mbarrier.wait(empty.index(s), ((i // SPC) & 1) ^ 1)  # fresh barriers pass phase 1
        bar = ready.index(s)
        if COMPUTE_ONLY and j >= 2 * SPC:
            mbarrier.arrive(bar)  # timing ablation: consumers recompute stale stages, no HBM
        else:
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(kw_desc, [page, kvh, 0, 0], bar, kw_bufs.index(s))
            tma.async_copy_global_to_shared(vw_desc, [page, kvh, 0, 0], bar, vw_bufs.index(s))
            tma.async_copy_global_to_shared(ks_desc, [page, kvh, 0], bar, ks_bufs.index(s))
            tma.async_copy_global_to_shared(vs_desc, [page, kvh, 0], bar, vs_bufs.index(s))


# --------------------------------------------------------------------------------------- kernel
@gluon.jit
def foscar_gluon_decode_split(
    q_ptr,  # [B, Hq, D] bf16
    kw_desc,  # k_words [pages, Hkv, PAGE, 8] int32, box [1, 1, 64, 8]
    ks_desc,  # k_scales viewed [pages, Hkv, 2*PAGE] fp32, box [1, 1, 128]
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
    H: gl.constexpr,  # query heads per KV head
    HS: gl.constexpr,  # padded: the wgmma N (8 or 16)
    SPC: gl.constexpr,  # ring stages per consumer (2 x SPC in all)
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    OPT: gl.constexpr,  # see the consumer section
):
    gl.static_assert(HS >= H)
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)

    # ---- shared memory: the ring, Q^T, P' per consumer, merge buffers, barriers
    NS: gl.constexpr = 2 * SPC
    kw_bufs = gl.allocate_shared_memory(gl.int32, [NS] + kw_desc.block_type.shape, kw_desc.layout)
    vw_bufs = gl.allocate_shared_memory(gl.int32, [NS] + vw_desc.block_type.shape, vw_desc.layout)
    ks_bufs = gl.allocate_shared_memory(gl.float32, [NS] + ks_desc.block_type.shape, ks_desc.layout)
    vs_bufs = gl.allocate_shared_memory(gl.float32, [NS] + vs_desc.block_type.shape, vs_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    # Q [HS, D] bf16, K-major: its transposed view is the B operand of the QK product (heads past
    # H are zero). B operands are stored K-major (MN-major B with 16-byte rows read out of bounds
    # on the H200: compute-sanitizer, session 3)
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    h = gl.arange(0, HS, layout=gl.SliceLayout(1, ql))
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, ql))
    qt = gl.load(q_ptr + b * stride_q_b + (kvh * H + h)[:, None] * stride_q_h + d[None, :],
                 mask=(h < H)[:, None], other=0.0)
    qt_smem = gl.allocate_shared_memory(gl.bfloat16, [HS, 128],
                                        gl.NVMMASharedLayout.get_default_for([HS, 128], gl.bfloat16), qt)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, HS, 64],
                                       gl.NVMMASharedLayout.get_default_for([HS, 64], gl.bfloat16))
    m_smem = gl.allocate_shared_memory(gl.float32, [HS], plain_shared_layout(1))
    l_smem = gl.allocate_shared_memory(gl.float32, [HS], plain_shared_layout(1))
    o_smem = gl.allocate_shared_memory(gl.float32, [128, HS], plain_shared_layout(2))
    fence_async_shared()

    # ---- this split's tiles (one page each), as decode_split_kernel computes them
    n_q = gl.load(num_quantized_ptr + b)
    page_base = gl.load(kv_indptr_ptr + b)
    n_tiles = gl.cdiv(n_q, 64)
    per_split = gl.cdiv(n_tiles, num_splits)
    t_begin = gl.minimum(split * per_split, n_tiles)
    t_end = gl.minimum(t_begin + per_split, n_tiles)
    t_full = gl.maximum(gl.minimum(t_end, n_q // 64), t_begin)
    o_base = o_part_ptr + b * stride_op_b + (kvh * H) * stride_op_h + split * stride_op_split
    lse_base = lse_part_ptr + b * stride_lp_b + (kvh * H) * stride_lp_h + split

    m0, l0, num0 = gl.warp_specialize([
        (_consumer0, (kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_bufs, t_begin,
                      t_full, t_end, n_q, qk_scale, magic, SPC, HS, OPT)),
        (_consumer1, (kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready, empty, qt_smem, p_bufs, m_smem,
                      l_smem, o_smem, t_begin, t_full, t_end, n_q, qk_scale, magic, SPC, HS, OPT)),
        (_producer, (kw_desc, ks_desc, vw_desc, vs_desc, kw_bufs, ks_bufs, vw_bufs, vs_bufs, ready,
                     empty, kv_indices_ptr, page_base, t_begin, t_end, kvh, SPC, OPT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    _merge_and_store(m0, l0, num0, m_smem, l_smem, o_smem, o_base, lse_base, stride_op_h,
                     stride_lp_h, H, HS)


# ------------------------------------------------------------------------------- numpy emulation
MAGIC = 0x43004300


def _linear_layout(layout, shape):
    """The compiler's linear layout (reg/lane/warp bases) of a Gluon layout, outside a kernel."""
    from triton._C.libtriton import gluon_ir, ir

    ctx = ir.context()
    ir.load_dialects(ctx)
    b = gluon_ir.GluonOpBuilder(ctx)
    return b.to_linear_layout(layout._to_ir(b), list(shape))


def _coords(ll, reg, lane, warp):
    """Tensor coordinates held by (reg, lane, warp) under a linear layout (XOR of the bases)."""
    c = [0] * len(ll.shape)
    for bases, idx in ((ll.reg_bases, reg), (ll.lane_bases, lane), (ll.warp_bases, warp)):
        for bit, basis in enumerate(bases):
            if idx >> bit & 1:
                c = [x ^ y for x, y in zip(c, basis)]
    return tuple(c)


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on uint32 numpy arrays: byte i of the result is byte
    sel[4i:4i+3] of the 8-byte value {b, a}, sign-replicated if sel bit 4i+3 is set."""
    a, b, sel = (np.asarray(v, dtype=np.uint64) for v in (a, b, sel))
    src = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, sel).shape, dtype=np.uint64)
    for i in range(4):
        nib = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(nib & np.uint64(8), np.where(byte & np.uint64(0x80), 0xFF, 0), byte)
        out |= byte.astype(np.uint64) << np.uint64(8 * i)
    return out.astype(np.uint32)


def emulate_k_operand(words):
    """The tensor program of _k_operand on uint32 words [64, 8] -> bf16 bit patterns [64, 128]."""
    w = words.astype(np.uint32)
    f = np.arange(8, dtype=np.uint32)
    x = ((w[:, :, None] >> (2 * f)) & np.uint32(0x00030003)) | np.uint32(MAGIC)
    y = np.stack([x & np.uint32(0xFFFF), x >> np.uint32(16)], axis=-1)  # [n, word, k, j]
    y = y.reshape(64, 4, 2, 4, 2, 2).transpose(0, 2, 3, 4, 1, 5)
    return y.reshape(64, 128).astype(np.uint16)


def emulate_vt_operand(words):
    """The tensor program of _vt_operand on uint32 words [64, 8] -> bf16 bits [128, 64] (V^T)."""
    w = words.astype(np.uint32).reshape(32, 2, 8).transpose(0, 2, 1)
    even, odd = w[..., 0], w[..., 1]
    X = np.arange(4, dtype=np.uint32)
    sel = X | (X << 4) | ((X + 4) << 8) | ((X + 4) << 12)
    xb = prmt(even[:, :, None], odd[:, :, None], sel[None, None, :])  # [m, word, X]
    f = np.arange(4, dtype=np.uint32)
    x = ((xb[..., None] >> (2 * f)) & np.uint32(0x00030003)) | np.uint32(MAGIC)
    y = np.stack([x & np.uint32(0xFFFF), x >> np.uint32(16)], axis=-1)  # [m, word, X, f, J]
    y = y.reshape(4, 2, 4, 4, 2, 4, 2, 2, 2).transpose(6, 3, 7, 4, 5, 0, 1, 2, 8)
    return y.reshape(128, 64).astype(np.uint16)


def wgmma_a_fragment(m_tiles, k_chunks):
    """PTX ISA fragment of the wgmma A operand (.bf16, registers) for a warpgroup: for thread
    (warp w, lane l), 32-bit register q of k16 chunk kc, m64 tile mt holds the bf16 pair
    (row, col), (row, col+1) with row = 64mt + 16w + l//4 + 8*(q%2), col = 16kc + 2*(l%4) + 8*(q//2)."""
    frag = {}
    for w in range(4):
        for lane in range(32):
            regs = []
            for mt in range(m_tiles):
                for kc in range(k_chunks):
                    for q in range(4):
                        row = 64 * mt + 16 * w + lane // 4 + 8 * (q % 2)
                        col = 16 * kc + 2 * (lane % 4) + 8 * (q // 2)
                        regs.append(((row, col), (row, col + 1)))
            frag[(w, lane)] = regs
    return frag


def check_layouts():
    """The compiler's layouts against the PTX fragment formula and the kernel's thread ownership."""
    out = []
    for name, shape, mt, kc in (("K operand [64, 128]", (64, 128), 1, 8),
                                ("V^T operand [128, 64]", (128, 64), 2, 4)):
        ll = _linear_layout(a_operand_layout(8), shape)
        frag = wgmma_a_fragment(mt, kc)
        ok = True
        for (w, lane), regs in frag.items():
            held = {_coords(ll, r, lane, w) for r in range(2 ** len(ll.reg_bases))}
            want = {c for pair in regs for c in pair}
            ok &= held == want
        out.append(f"{name}: compiler DotOperandLayout == PTX wgmma A fragment: {ok}")
    # the K words layout: thread (w, l) owns rows l//4 + 8i + 16w, words 2*(l%4) + e
    ll = _linear_layout(gl.SliceLayout(2, k_words3_layout()), (64, 8))
    ok = all({_coords(ll, r, lane, w) for r in range(4)}
             == {(lane // 4 + 8 * i + 16 * w, 2 * (lane % 4) + e) for i in range(2) for e in range(2)}
             for w in range(4) for lane in range(32))
    out.append(f"K words layout: thread owns rows l//4+8i+16w, words 2(l%4)+e: {ok}")
    ll = _linear_layout(v_words_load_layout(), (64, 8))
    ok = all({_coords(ll, r, lane, w) for r in range(16)}
             == {(16 * kb + 8 * i2 + 2 * (lane % 4) + j, 2 * w + (lane // 4) // 4)
                 for kb in range(4) for i2 in range(2) for j in range(2)}
             for w in range(4) for lane in range(32))
    out.append(f"V words layout: thread owns word 2w+(l//4)//4 of tokens 16kb+8i'+2(l%4)+j: {ok}")
    return out


def emulate_threads(k_words, v_words, threads=((0, 0), (1, 5), (3, 31))):
    """Per-thread replay of the SASS sequence on the words a thread loads, against the fragment.

    K: register (i, i', kb) = ((word[2T + kb//4] >> 2*(2*(kb%4)+i')) & 0x00030003) | MAGIC of row
       l//4 + 8i + 16w.  V: register of (b, i, kb, i', a) = field 2b+a of prmt(even, odd, sel(X))
       on word 2w + g//4 of tokens 16kb + 8i' + 2T + {0,1}, g = l//4, X = g%4, T = l%4.
    Returns (thread, k_ok, v_ok, first register bits) rows."""
    from foscar.formats import Role, channel_order, unpack_codes  # noqa: F401

    rows = []
    K = k_words.astype(np.uint32)
    V = v_words.astype(np.uint32)
    kfrag = wgmma_a_fragment(1, 8)
    vfrag = wgmma_a_fragment(2, 4)
    k_ref = emulate_k_operand(k_words)
    vt_ref = emulate_vt_operand(v_words)
    for (w, lane) in threads:
        T, g = lane % 4, lane // 4
        k_ok = True
        for idx, ((r0, c0), (r1, c1)) in enumerate(kfrag[(w, lane)]):
            kc, q = divmod(idx, 4)
            i, i2, kb = q % 2, q // 2, kc
            word = K[lane // 4 + 8 * i + 16 * w, 2 * T + kb // 4]
            u = ((word >> np.uint32(2 * (2 * (kb % 4) + i2))) & np.uint32(0x00030003)) | np.uint32(MAGIC)
            k_ok &= int(u & 0xFFFF) == int(k_ref[r0, c0]) and int(u >> 16) == int(k_ref[r1, c1])
        v_ok = True
        X = g % 4
        sel = X | (X << 4) | ((X + 4) << 8) | ((X + 4) << 12)
        for idx, ((r0, c0), (r1, c1)) in enumerate(vfrag[(w, lane)]):
            # row (channel) c = 64b + 16w + 8a + g; col (token) = 16kc + 8i' + 2T + J
            b_, a_ = r0 // 64, (r0 // 8) % 2
            tok = c0  # even token of the pair
            word_idx = 2 * w + g // 4
            xb = prmt(V[tok, word_idx], V[tok + 1, word_idx], sel)
            u = ((int(xb) >> (2 * (2 * b_ + a_))) & 0x00030003) | MAGIC
            v_ok &= (u & 0xFFFF) == int(vt_ref[r0, c0]) and (u >> 16) == int(vt_ref[r1, c1])
        rows.append(((w, lane), k_ok, v_ok))
    return rows


def emulate(seed=0, verbose=True):
    """Bit-exact check of the operand construction against foscar's packing (torch, CPU)."""
    import torch

    from foscar.formats import Role, channel_order, pack_codes

    g = torch.Generator().manual_seed(seed)
    k_codes = torch.randint(0, 4, (PAGE, D), generator=g)
    v_codes = torch.randint(0, 4, (PAGE, D), generator=g)
    kw = pack_codes(k_codes, 2, "bf16", order=channel_order(Role.KEY, 2, D)).numpy().view(np.uint32)
    vw = pack_codes(v_codes, 2, "bf16", order=channel_order(Role.VALUE, 2, D)).numpy().view(np.uint32)
    k_op = emulate_k_operand(kw)
    vt_op = emulate_vt_operand(vw)
    k_want = (0x4300 | k_codes.numpy()).astype(np.uint16)
    v_want = (0x4300 | v_codes.numpy().T).astype(np.uint16)
    lines = [
        f"K operand tensor program == 0x4300 | code (64 x 128, foscar key order): {np.array_equal(k_op, k_want)}",
        f"V^T operand tensor program == 0x4300 | code (128 x 64, foscar value order): {np.array_equal(vt_op, v_want)}",
        # bf16 value check: 0x4300 | q is q + 128
        "bf16(0x4300 | q) == q + 128 for q in 0..3: "
        + str(all(np.frombuffer(np.uint32((0x4300 | q) << 16).tobytes(), np.float32)[0] == q + 128
                  for q in range(4))),
    ]
    lines += check_layouts()
    for (thr, k_ok, v_ok) in emulate_threads(kw, vw):
        lines.append(f"thread (warp, lane) {thr}: per-thread SHF/LOP3 replay matches K fragment: "
                     f"{k_ok}; PRMT+SHF/LOP3 replay matches V^T fragment: {v_ok}")
    # a few words, spelled out
    w0 = int(kw[0, 0])
    u = [((w0 >> (2 * k)) & 0x00030003) | MAGIC for k in range(3)]
    lines.append(f"example: K word[0,0] = {w0:#010x} -> fields k=0..2: " + ", ".join(f"{x:#010x}" for x in u)
                 + f" = bf16 pairs of channels (0,1), (8,9), (16,17): codes "
                 f"{[int(k_codes[0, c]) for c in (0, 1, 8, 9, 16, 17)]}")
    if verbose:
        print("\n".join(lines))
    return lines


# ------------------------------------------------------------------------------ compile helpers
def descriptor_layouts():
    words = gl.NVMMASharedLayout.get_default_for([1, 1, PAGE, WORDS], gl.int32)
    scales = gl.NVMMASharedLayout.get_default_for([1, 1, 2 * PAGE], gl.float32)
    return words, scales


def compile_proto(HS=8, SPC=2, consumer_regs=232, producer_regs=40, maxnreg=None, opt=7):
    from gcompile import compile_gluon, desc_sig

    wl, sl = descriptor_layouts()
    sig = {
        "q_ptr": "*bf16",
        "kw_desc": desc_sig("i32", [1, 1, PAGE, WORDS], wl),
        "ks_desc": desc_sig("fp32", [1, 1, 2 * PAGE], sl),
        "vw_desc": desc_sig("i32", [1, 1, PAGE, WORDS], wl),
        "vs_desc": desc_sig("fp32", [1, 1, 2 * PAGE], sl),
        "kv_indptr_ptr": "*i32",
        "kv_indices_ptr": "*i32",
        "num_quantized_ptr": "*i32",
        "o_part_ptr": "*fp32",
        "lse_part_ptr": "*fp32",
        "qk_scale": "fp32",
        "magic": "i32",
        "num_splits": "i32",
    }
    for n in ("stride_q_b", "stride_q_h", "stride_op_b", "stride_op_h", "stride_op_split",
              "stride_lp_b", "stride_lp_h"):
        sig[n] = "i32"
    consts = dict(H=4, HS=HS, SPC=SPC, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                  OPT=opt)
    return compile_gluon(foscar_gluon_decode_split, sig, consts, num_warps=4, maxnreg=maxnreg)


def _bf16_round(x):
    """fp32 -> nearest bf16 (ties to even), as fp32 values."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32)


def _bits_to_f32(bits16):
    return (bits16.astype(np.uint32) << 16).view(np.float32)


def emulate_split_kernel(q, cache, batch, num_splits, sm_scale=None):
    """Replays the kernel's control flow and arithmetic per CTA on the CPU (fp32, numpy):
    page -> stage order, tiles alternating between two consumers, the operand bits
    (emulate_k_operand / emulate_vt_operand on the stored words), the folds, online softmax with
    per-row sums, P' rounded to bf16, a fresh PV product per tile, the masked last tile, the
    merge of the two consumers, and foscar's LSE merge of the splits. Returns (o, lse) with lse
    in natural log, like foscar.decode_attention."""
    import math

    sm_scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
    c = np.float32(sm_scale * LOG2E)
    st = cache.layers[batch.layer]
    kw_pool = st.k_words.cpu().numpy().view(np.uint32)
    vw_pool = st.v_words.cpu().numpy().view(np.uint32)
    ks_pool = st.k_scales.cpu().numpy().reshape(st.k_scales.shape[0], st.k_scales.shape[1], -1)
    vs_pool = st.v_scales.cpu().numpy().reshape(st.v_scales.shape[0], st.v_scales.shape[1], -1)
    indptr = batch.kv_indptr.cpu().numpy()
    indices = batch.kv_indices.cpu().numpy()
    n_q_all = batch.num_quantized.cpu().numpy()
    qf = q.float().cpu().numpy()
    bsz, hq, _ = qf.shape
    hkv = cache.num_kv_heads
    H = hq // hkv
    o_part = np.zeros((bsz, hq, num_splits, D), np.float32)
    lse_part = np.zeros((bsz, hq, num_splits), np.float32)
    for b in range(bsz):
        n_q = int(n_q_all[b])
        n_tiles = -(-n_q // 64)
        per_split = -(-n_tiles // num_splits)
        for kvh in range(hkv):
            qh = np.zeros((8, D), np.float32)
            qh[:H] = qf[b, kvh * H:(kvh + 1) * H]
            qsum = qh.sum(axis=1) * c
            for split in range(num_splits):
                t_begin = min(split * per_split, n_tiles)
                t_end = min(t_begin + per_split, n_tiles)
                t_full = max(min(t_end, n_q // 64), t_begin)
                states = []
                for C in (0, 1):
                    m = np.full(8, -np.inf, np.float32)
                    l2 = np.zeros((64, 8), np.float32)
                    z2 = np.zeros((64, 8), np.float32)
                    acc = np.zeros((D, 8), np.float32)
                    n_all = max(t_end - t_begin - C + 1, 0) // 2
                    for i in range(n_all):
                        t = t_begin + C + 2 * i
                        page = int(indices[int(indptr[b]) + t])
                        k_y = _bits_to_f32(emulate_k_operand(kw_pool[page, kvh]))  # [64, 128]
                        vt_y = _bits_to_f32(emulate_vt_operand(vw_pool[page, kvh]))  # [128, 64]
                        ks, kz = ks_pool[page, kvh][0::2], ks_pool[page, kvh][1::2]
                        vs, vz = vs_pool[page, kvh][0::2].copy(), vs_pool[page, kvh][1::2]
                        s_acc = k_y @ qh.T  # [64, 8]  (exact products, fp32 sums)
                        with np.errstate(all="ignore"):
                            sc = s_acc * (ks * c)[:, None] + kz[:, None] * qsum[None, :]
                        with np.errstate(all="ignore"):  # unused rows hold garbage scales
                            ratio = vz / vs
                        if t >= t_full:  # the masked tile
                            valid = t * 64 + np.arange(64) < n_q
                            sc = np.where(valid[:, None], sc, -np.inf)
                            vs = np.where(valid, vs, 1.0).astype(np.float32)
                            ratio = np.where(valid, ratio, 0.0).astype(np.float32)
                        m_new = np.maximum(m, sc.max(axis=0))
                        alpha = np.exp2(m - m_new)
                        p = np.exp2(sc - m_new[None, :])
                        l2 = l2 * alpha[None, :] + p
                        pv = _bf16_round(p * vs[:, None])
                        z2 = z2 * alpha[None, :] + pv * ratio[:, None]
                        acc = acc * alpha[None, :] + vt_y @ pv  # fresh product per tile
                        m = m_new
                    states.append((m, l2.sum(axis=0), acc + z2.sum(axis=0)[None, :]))
                (m0, l0, n0), (m1, l1, n1) = states
                mm = np.maximum(m0, m1)
                ms = np.where(mm == -np.inf, 0.0, mm)
                a0, a1 = np.exp2(m0 - ms), np.exp2(m1 - ms)
                lt = l0 * a0 + l1 * a1
                num = n0 * a0[None, :] + n1 * a1[None, :]
                o = num / np.where(lt > 0, lt, 1.0)[None, :]
                lse = np.where(lt > 0, mm + np.log2(np.where(lt > 0, lt, 1.0)), -np.inf)
                o_part[b, kvh * H:(kvh + 1) * H, split] = o[:, :H].T
                lse_part[b, kvh * H:(kvh + 1) * H, split] = lse[:H]
    # foscar's merge_splits_kernel
    mx = lse_part.max(axis=2, keepdims=True)
    w = np.exp2(lse_part - mx)
    den = w.sum(axis=2)
    o = (w[..., None] * o_part).sum(axis=2) / den[..., None]
    lse = (mx[..., 0] + np.log2(den)) * np.float32(math.log(2))
    return o, lse


def emulate_decode_check(lengths=(1, 62, 63, 126, 200, 700), num_splits=(1, 2, 3, 5, 16), seed=0):
    """emulate_split_kernel against foscar's fp64 reference over the dequantized cache."""
    import sys

    import torch

    sys.path.insert(0, "/work/main/tests")
    from kernel_cases import bf16_torch_attention, build_cache, queries, rel_l2

    from foscar import KVFormat, QuantFormat
    from foscar.reference import attend_dequantized

    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    cache, batch = build_cache(fmt, list(lengths), num_kv_heads=2, seed=seed)
    q = queries(batch, 8, D, "cpu", seed=seed + 1)
    sm = 1 / D ** 0.5
    ref, ref_lse = attend_dequantized(q.double(), cache, batch, sm)
    bar = rel_l2(bf16_torch_attention(q, cache, batch, sm), ref)
    lines = [f"lengths {list(lengths)} (+2 decode steps), 2 KV heads, 4 q heads each; bf16 torch bar {bar:.2e}"]
    for ns in num_splits:
        o, lse = emulate_split_kernel(q, cache, batch, ns, sm)
        err = rel_l2(torch.from_numpy(o), ref)
        lerr = float((torch.from_numpy(lse).double() - ref_lse).abs().max())
        lines.append(f"  splits={ns:2d}: rel L2 vs fp64 dequantized {err:.2e}, max |lse err| {lerr:.1e}, "
                     f"finite {bool(np.isfinite(o).all())}")
    return lines


# ------------------------------------------------------------------------------- GPU launcher
LOG2E = 1.4426950408889634


def check_supported(cache, num_q_heads):
    fmt = cache.fmt
    for f in (fmt.key, fmt.value):
        if (f.bits, f.axis.value, f.group_size) != (2, "token", 128):
            return f"prototype covers token-wise INT2 g=128 only, got {f.short()}"
    if cache.head_dim != D or cache.page_size != PAGE:
        return f"prototype needs head_dim {D} and page_size {PAGE}"
    if fmt.sink_tokens or fmt.tail_capacity > 1:
        return "prototype has no BF16 window program (sink/recent)"
    ratio = num_q_heads // cache.num_kv_heads
    if ratio > 8:
        return f"at most 8 query heads per KV head (HS = 8), got {ratio}"
    return None


def make_descriptors(cache, layer=0):
    """TMA descriptors over the cache pools: words [pages, Hkv, 64, 8] i32 (box [1, 1, 64, 8],
    32-byte swizzle), scales viewed [pages, Hkv, 128] fp32 (box [1, 1, 128])."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    st = cache.layers[layer]
    wl, sl = descriptor_layouts()
    descs = []
    for words, scales in ((st.k_words, st.k_scales), (st.v_words, st.v_scales)):
        sv = scales.view(scales.shape[0], scales.shape[1], -1)
        descs.append(TensorDescriptor(words, list(words.shape), list(words.stride()),
                                      [1, 1, PAGE, WORDS], wl))
        descs.append(TensorDescriptor(sv, list(sv.shape), list(sv.stride()), [1, 1, 2 * PAGE], sl))
    return descs  # kw, ks, vw, vs


def decode(q, cache, batch, num_splits, *, sm_scale=None, opt=5, spc=2, consumer_regs=232,
           producer_regs=40, maxnreg=None, return_lse=False, descs=None, workspace=None):
    """GPU only (untested here): split kernel + foscar's merge kernel; returns out (and lse)."""
    import math

    import torch

    from foscar.kernels.triton_decode import merge_splits_kernel

    reason = check_supported(cache, q.shape[1])
    if reason:
        raise ValueError(reason)
    bsz, hq, d = q.shape
    ratio = hq // cache.num_kv_heads
    sm_scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    kw, ks, vw, vs = descs or make_descriptors(cache, batch.layer)
    if workspace is None:
        workspace = (torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device),
                     torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device))
    o_part, lse_part = workspace
    foscar_gluon_decode_split[(bsz, cache.num_kv_heads, num_splits)](
        q, kw, ks, vw, vs, batch.kv_indptr, batch.kv_indices, batch.num_quantized, o_part,
        lse_part, sm_scale * LOG2E, MAGIC, num_splits,
        q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        H=ratio, HS=8, SPC=spc, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, OPT=opt,
        num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}))
    out = torch.empty_like(q)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device) if return_lse else None
    merge_splits_kernel[(bsz, hq)](
        o_part_ptr=o_part, lse_part_ptr=lse_part, o_ptr=out, lse_ptr=lse if return_lse else out,
        num_parts=num_splits, stride_op_b=o_part.stride(0), stride_op_h=o_part.stride(1),
        stride_op_split=o_part.stride(2), stride_lp_b=lse_part.stride(0),
        stride_lp_h=lse_part.stride(1), stride_o_b=out.stride(0), stride_o_h=out.stride(1),
        stride_l_b=lse.stride(0) if return_lse else 0, stride_l_h=lse.stride(1) if return_lse else 0,
        D=d, BLOCK_P=max(2, 1 << (num_splits - 1).bit_length()), WRITE_LSE=return_lse,
        INTERP=False, num_warps=4)
    return (out, lse) if return_lse else out


def sass_report(ck, label=""):
    from gcompile import ptxas_info, report_loops, resources, sass, setmaxnreg_values

    s = sass(ck)
    regs = [(a, int(b, 16)) for a, b in setmaxnreg_values(s)]
    info = ptxas_info(ck)
    lines = [f"{label} {resources(ck)} total_warps={ck.metadata.num_warps} smem={ck.metadata.shared} B",
             f"  setmaxnreg in SASS (kind, regs): {sorted(set(regs))}",
             "  ptxas: " + " | ".join(ln.strip() for ln in info.splitlines()
                                       if "spill" in ln or "C7" in ln or "Used" in ln)]
    keys = ["HGMMA", "WARPGROUP", "LOP3", "SHF", "PRMT", "LDS", "LDSM", "STS", "STSM", "BAR", "SYNCS",
            "SHFL", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2F", "IMAD", "MEMBAR", "FENCE"]
    for r in report_loops(ck):
        c = r["counts"]
        lpv = f" lane-instr/value={r['lane_per_value']:.2f}" if r["kind"] == "consumer" else ""
        lines.append(f"  {r['kind']} loop {r['start']}..{r['end']}: {r['instr']} instr{lpv}")
        lines.append("    " + " ".join(f"{k}={c.get(k, 0)}" for k in keys if c.get(k, 0))
                     + f" other={r['instr'] - sum(c.get(k, 0) for k in keys)}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", type=int, default=5)
    ap.add_argument("--hs", type=int, default=8)
    ap.add_argument("--spc", type=int, default=2)
    ap.add_argument("--consumer-regs", type=int, default=232)
    ap.add_argument("--producer-regs", type=int, default=40)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--dump", default=None, help="write SASS/PTX/TTGIR with this path prefix")
    a = ap.parse_args()
    emulate()
    print("\n".join(emulate_decode_check()))
    ck = compile_proto(HS=a.hs, SPC=a.spc, consumer_regs=a.consumer_regs,
                       producer_regs=a.producer_regs, maxnreg=a.maxnreg, opt=a.opt)
    print(sass_report(ck, f"sm_90a HS={a.hs} SPC={a.spc} OPT={a.opt} maxnreg={a.maxnreg}"))
    if a.dump:
        from gcompile import sass

        open(a.dump + ".sass", "w").write(sass(ck))
        open(a.dump + ".ptx", "w").write(ck.asm["ptx"])
        open(a.dump + ".ttgir", "w").write(ck.asm["ttgir"])
