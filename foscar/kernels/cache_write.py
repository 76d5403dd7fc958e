"""Triton kernel of a decode step's cache write: one new token per sequence, in one launch.

What :meth:`foscar.cache.QuantizedKVCache.append` does for a decode step with a token-wise
history format (clipped per token, and keys rounded by GPTQ, as a layer's transform says), bit
for bit (``tests/test_cache_write.py``), fused: the torch path spends ~60 small tensor
operations per role and layer (quantize, fold, pack, scatters; GPTQ's rounding 5 more per
channel), which made the host, not the GPU, the limit of an end-to-end decode step
(docs/tuning.md).

One program per ``(sequence, KV head)`` of one role (K or V):

1. if the step demotes a token into the quantized history, load it (from the tail ring, or the
   new token itself when there is no recent window) in the packed channel order, clip it (its
   percentile of ``|x|`` found by counting ranks), quantize each group
   (``s = max(hi - lo, 1e-8) / levels``, ``q = floor((x - lo) / s + 0.5)``, IEEE division as in
   :func:`foscar.quantize.quantize`; GPTQ's codes channel by channel where the layer has
   factors, as :func:`foscar.quantize.quantize_gptq`), fold (``s' = s / alpha``,
   ``z' = lo - beta s'``), and store the packed words and the ``(s', z')`` pairs;
2. store the new token into the sink or the tail ring (never the demoted token's ring slot).

NaN and infinities (a cache with ``check_finite=False``): min, max and the scale floor propagate
NaN as torch does, so a non-finite value poisons its group's ``(s', z')`` on both paths (the
codes of such a group are unspecified on both; with GPTQ keys, the codes of the whole token,
since each channel's error is fed forward into the later ones). A clipped row orders NaN above
every number, as ``torch.kthvalue`` does, so enough NaNs make the percentile NaN and poison every
group of the row. A zero group minimum is stored as +0 on both paths.

The per-sequence integers (slot, positions, destination page) are computed on the host, as in
the torch path, and passed as one ``[batch, 6]`` int32 tensor: ``slot, sink position, tail
position, ring position of the demoted token (-1: the new token itself), history page (-1: no
demotion), row in that page``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["decode_write_kernel", "DESC_FIELDS"]

#: columns of the descriptor tensor
DESC_FIELDS = ("slot", "sink_pos", "tail_pos", "ring_pos", "page", "row")


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _nan_min(a, b):
    # NaN-propagating, as torch's amin: a NaN poisons its group (check_finite=False)
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_scale(x, member, LEVELS: tl.constexpr):
    """``(lo, s)`` of the group ``member`` selects in ``x``: min-max, the 1e-8 span floor, IEEE
    division (foscar.quantize.quantize; NaN-propagating)."""
    lo = tl.reduce(tl.where(member, x, float("inf")), 0, _nan_min)
    lo = tl.where(lo == 0.0, 0.0, lo)  # +0 for either zero, as quantize's ``+ 0.0``
    hi = tl.reduce(tl.where(member, x, float("-inf")), 0, _nan_max)
    span = tl.maximum(hi - lo, 1e-8, propagate_nan=tl.PropagateNan.ALL)
    return lo, tl.math.div_rn(span, LEVELS)


@triton.jit
def _clip_per_token(x, x_row, clip_index, D: tl.constexpr):
    """foscar.quantize.clip_per_token of the row ``x`` (any channel order; ``x_row`` points at
    the same values in memory): clamp to ``[-tau, tau]``, ``tau`` the ``(clip_index + 1)``-th
    smallest ``|x|``, NaN ordered above every number as torch.kthvalue orders it.

    ``tau`` is the value whose rank brackets ``clip_index``: ``#{a_j < a} <= clip_index <
    #{a_j <= a}``, counted over the row's channels one scalar at a time (counting 16 channels at
    a time as a ``[D, 16]`` comparison was slower: docs/tuning.md, Cache write and host path,
    row "the clip's ranks counted 16 channels at a time")."""
    a = tl.abs(x)
    below = tl.zeros(x.shape, tl.int32)
    at = tl.zeros(x.shape, tl.int32)
    for j in range(D):
        aj = tl.abs(tl.load(x_row + j).to(tl.float32))
        # a NaN is above every number and equal to another NaN
        below += tl.where(a != a, aj == aj, aj < a).to(tl.int32)
        at += tl.where(a != a, aj != aj, aj == a).to(tl.int32)
    kth = tl.where(below <= clip_index, clip_index < below + at, False)
    tau = tl.reduce(tl.where(kth, a, float("-inf")), 0, _nan_max)
    clipped = tl.minimum(x, tau, propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(clipped, -tau, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _gptq_group(w, q, order, g, lo, s, factor, D: tl.constexpr, GROUP: tl.constexpr,
                LEVELS: tl.constexpr):  # fmt: skip
    """foscar.quantize.quantize_gptq's codes of group ``g`` of one token (positions in the
    packed ``order``), its scale and offset ``(s, lo)`` those of the clipped row: channel by
    channel in natural order, ``q = floor((w_j - lo) / s + 0.5)`` clamped, its error divided by
    ``U[j, j]`` fed forward as ``w_c -= err * U[j, c]`` into the channels ``c > j`` (the later
    groups' too). ``w`` starts as the unclipped row; returns ``(w, q)`` with the group's codes
    in ``q``. Products and sums round separately (the launch turns off FMA contraction), as
    torch's do."""
    # the factor's row and diagonal element one channel ahead of the chain through w, so a
    # load's latency overlaps a step's reduction and divisions
    j = g * GROUP
    diag_next = tl.load(factor + j * D + j)
    row_next = tl.load(factor + j * D + order, mask=order > j, other=0.0)
    for jj in range(GROUP):
        j = g * GROUP + jj
        later = order > j
        diag, row = diag_next, row_next
        jn = tl.minimum(j + 1, D - 1)
        diag_next = tl.load(factor + jn * D + jn)
        row_next = tl.load(factor + jn * D + order, mask=order > jn, other=0.0)
        here = order == j
        wj = tl.sum(tl.where(here, w, 0.0), 0)
        qj = tl.floor(tl.math.div_rn(wj - lo, s) + 0.5)
        qj = tl.minimum(tl.maximum(qj, 0.0), LEVELS)
        q = tl.where(here, qj, q)
        err = tl.math.div_rn(wj - (qj * s + lo), diag)
        w = tl.where(later, w - err * row, w)
    return w, q


@triton.jit
def _prefetch_lines(base, NBYTES: tl.constexpr):
    """Ask for the ``NBYTES`` at ``base`` in L1 (one ``prefetch.global.L1`` per 128-byte line):
    the GPTQ factor's rows are read one per step of a serial chain, each read otherwise a trip to
    L2 or HBM that nothing overlaps."""
    lines = (base.to(tl.pointer_type(tl.int8)) + tl.arange(0, NBYTES // 128) * 128).to(tl.int64)
    tl.inline_asm_elementwise(
        "prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [lines],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["clip_index"])  # one kernel for every fitted clip ratio
def decode_write_kernel(
    src_ptr,  # [batch, H, D] the new tokens, window dtype
    src_stride_b,
    src_stride_h,
    desc_ptr,  # [batch, 6] int32
    sink_ptr,  # [max_seqs, H, S, D] window dtype
    tail_ptr,  # [max_seqs, H, R, D] window dtype
    words_ptr,  # [P, H, ps, W] int32
    scales_ptr,  # [P, H, E, 2] float32
    order_ptr,  # [D] int32: packed position -> channel
    shifts_ptr,  # [32 // BITS] int32: bit offset of each field of a word
    H,
    SINK,
    RING,
    PAGE,
    ENTRIES,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,  # 2**BITS - 1, as a float
    ALPHA_INV: tl.constexpr,  # 1 / alpha (a power of two)
    BETA: tl.constexpr,
    clip_index,  # with CLIP: tau is the (clip_index + 1)-th smallest |x| of the row
    factor_ptr,  # with GPTQ: [H, D, D] float32 upper-triangular GPTQ factors
    CLIP: tl.constexpr = False,
    GPTQ: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,  # prefetch the GPTQ factor (PTX; not in the interpreter)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    desc = desc_ptr + b * 6
    slot = tl.load(desc)
    sink_pos = tl.load(desc + 1)
    tail_pos = tl.load(desc + 2)
    ring_pos = tl.load(desc + 3)
    page = tl.load(desc + 4)
    row = tl.load(desc + 5)
    PER_WORD: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // PER_WORD
    NG: tl.constexpr = D // GROUP

    d = tl.arange(0, D)
    src = src_ptr + b.to(tl.int64) * src_stride_b + h * src_stride_h
    ring = tail_ptr + ((slot.to(tl.int64) * H + h) * RING) * D

    if page >= 0:
        if GPTQ and PREFETCH and D <= 128:  # (D = 256's 256 KiB would not stay in L1)
            _prefetch_lines(factor_ptr + h * D * D, D * D * 4)
        order = tl.load(order_ptr + d)
        from_ring = ring_pos >= 0
        x_ring = tl.load(ring + ring_pos * D + order, mask=(d < D) & from_ring, other=0.0)
        x_new = tl.load(src + order, mask=(d < D) & (ring_pos < 0), other=0.0)
        x = tl.where(from_ring, x_ring.to(tl.float32), x_new.to(tl.float32))
        if CLIP:
            x_row = tl.where(from_ring, ring + ring_pos * D, src)  # the token, channel order
            xc = _clip_per_token(x, x_row, clip_index, D)
        else:
            xc = x
        group = order // GROUP
        lo = tl.zeros([D], tl.float32)
        scale = tl.full([D], 1.0, tl.float32)
        entry0 = scales_ptr + (((page.to(tl.int64) * H + h) * ENTRIES) + row * NG) * 2
        if GPTQ:  # the unclipped row, rounded group by group as each group's scale is known
            w = x
            q = tl.zeros([D], tl.float32)
        for j in tl.static_range(NG):
            member = group == j
            lo_j, s_j = _group_scale(xc, member, LEVELS)
            lo = tl.where(member, lo_j, lo)
            scale = tl.where(member, s_j, scale)
            s_fold = s_j * ALPHA_INV  # exact: alpha is a power of two
            tl.store(entry0 + 2 * j, s_fold)
            if BETA == 0.0:  # as fold_scale_offset: no 0 * s' (NaN when s' overflowed)
                tl.store(entry0 + 2 * j + 1, lo_j)
            else:  # BETA * s_fold is exact; the launch turns off FMA contraction
                tl.store(entry0 + 2 * j + 1, lo_j - BETA * s_fold)
            if GPTQ:
                w, q = _gptq_group(w, q, order, j, lo_j, s_j, factor_ptr + h * D * D, D, GROUP,
                                   LEVELS)  # fmt: skip
        if not GPTQ:
            q = tl.floor(tl.math.div_rn(xc - lo, scale) + 0.5)
        q = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.int32)
        shifts = tl.load(shifts_ptr + tl.arange(0, PER_WORD))
        fields = tl.reshape(q, [W, PER_WORD]) << shifts[None, :]
        words = tl.reduce(fields, 1, _or)
        w = tl.arange(0, W)
        tl.store(words_ptr + ((page.to(tl.int64) * H + h) * PAGE + row) * W + w, words)

    # (the demoted token's ring slot is never the new token's: (l0 - S - W) % (W + 1) against
    # (l0 - S) % (W + 1), so no barrier is needed between the two)
    x_in = tl.load(src + d)
    if sink_pos >= 0:
        tl.store(sink_ptr + ((slot.to(tl.int64) * H + h) * SINK + sink_pos) * D + d, x_in)
    if tail_pos >= 0:
        tl.store(ring + tail_pos * D + d, x_in)
