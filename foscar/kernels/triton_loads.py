"""Paged loads of the Triton decode kernel (foscar.kernels.triton_decode): the pages of a tile,
its packed words, and the (s', z') scale pairs of token- and channel-wise groups.

Math: none; addresses. A tile of BLOCK_N tokens is one page or part of one (BLOCK_N <= PAGE: a
scalar page index, so addresses stay on the uniform datapath) or BLOCK_N / PAGE whole pages.

Data contract (foscar.cache): words ``[pages, Hkv, PAGE, WORDS]`` int32; scales ``[pages, Hkv,
PAGE * D / GROUP, 2]`` fp32: token-wise, entry ``row * D / GROUP + g`` of a page; channel-wise,
a sequence's scales flattened as ``[groups, D]`` and cut into pages of ``PAGE * D / GROUP``
entries, so one group's D pairs span ``CH`` pages (or part of one). Rows and groups past the
history read (1, 0) where the caller masks.

Supported: any PAGE that is a multiple or divisor of BLOCK_N, any group size the cache stores.
"""

import triton
import triton.language as tl


@triton.jit
def token_pages(
    kv_indices_ptr,
    page_base,
    t,
    n_pages,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Pages of tile ``t`` and its first row in them.

    ``BLOCK_N <= PAGE``: one page (a scalar, so addresses stay on the uniform datapath);
    otherwise the ``BLOCK_N / PAGE`` pages as a vector (the masked tile stops at the last one).
    """
    if BLOCK_N <= PAGE:
        pages = tl.load(kv_indices_ptr + page_base + (t * BLOCK_N) // PAGE)
        row0 = (t * BLOCK_N) % PAGE
    else:
        idx = t * (BLOCK_N // PAGE) + tl.arange(0, BLOCK_N // PAGE)
        row0 = 0
        if MASKED:
            pages = tl.load(kv_indices_ptr + page_base + idx, mask=idx < n_pages, other=0)
        else:
            pages = tl.load(kv_indices_ptr + page_base + idx)
    return pages.to(tl.int64), row0


@triton.jit
def load_words(
    words_ptr,
    pages,
    row0,
    stride_page,
    head_off,
    WORDS: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Packed rows ``[BLOCK_N, WORDS]`` of one tile (16-byte loads along the words)."""
    offs_w = tl.arange(0, WORDS)
    if BLOCK_N <= PAGE:
        offs_n = tl.arange(0, BLOCK_N)
        base = words_ptr + head_off + pages * stride_page + row0 * WORDS
        return tl.load(base + offs_n[:, None] * WORDS + offs_w[None, :])
    else:
        rows = tl.arange(0, PAGE)
        off = (
            pages[:, None, None] * stride_page + rows[None, :, None] * WORDS + offs_w[None, None, :]
        )
        return tl.load(words_ptr + head_off + off).reshape(BLOCK_N, WORDS)


@triton.jit
def _load_token_scales(
    scales_ptr,
    pages,
    row0,
    stride_page,
    head_off,
    NG: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Token-wise ``(s', z')``: two ``[BLOCK_N, NG]`` tensors (entry ``row*NG + g`` of a page)."""
    offs_g = tl.arange(0, NG)
    pair = tl.arange(0, 2)
    if BLOCK_N <= PAGE:
        offs_n = tl.arange(0, BLOCK_N)
        base = scales_ptr + head_off + pages * stride_page + row0 * NG * 2
        off = (offs_n[:, None, None] * NG + offs_g[None, :, None]) * 2 + pair[None, None, :]
        sz = tl.load(base + off)
    else:
        rows = tl.arange(0, PAGE)
        off = pages[:, None, None, None] * stride_page + (
            (rows[None, :, None, None] * NG + offs_g[None, None, :, None]) * 2
            + pair[None, None, None, :]
        )
        sz = tl.load(scales_ptr + head_off + off).reshape(BLOCK_N, NG, 2)
    return tl.split(sz)


@triton.jit
def channel_scale_pages(
    kv_indices_ptr,
    page_base,
    t,
    n_q,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NTG: tl.constexpr,
    ALL_VALID: tl.constexpr = False,
):
    """Pages ``[CH, NTG]`` that hold the channel-wise scales of the ``NTG`` token groups of
    tile ``t`` (0 for groups past the history).

    A sequence's scales, flattened as ``[groups, D]``, are cut into pages of ``PAGE*D/GROUP``
    entries (foscar.cache), so one group's ``D`` entries span ``CH`` pages (or part of one).
    """
    PER_PAGE: tl.constexpr = PAGE * D // GROUP
    CH: tl.constexpr = D // PER_PAGE if D > PER_PAGE else 1
    j = (t * BLOCK_N) // GROUP + tl.arange(0, NTG)
    valid = j * GROUP < n_q
    chunk = tl.arange(0, CH)
    idx = kv_indices_ptr + page_base + (j * D)[None, :] // PER_PAGE + chunk[:, None]
    if ALL_VALID:  # the caller knows every group is in the history
        return tl.load(idx).to(tl.int64)
    else:
        return tl.load(idx, mask=valid[None, :], other=0).to(tl.int64)


@triton.jit
def channel_scales_at(
    scales_ptr,
    page,
    t,
    n_q,
    stride_page,
    head_off,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NTG: tl.constexpr,
    ALL_VALID: tl.constexpr = False,
):
    """Channel-wise ``(s', z')`` of the token groups of tile ``t`` from their pages
    (:func:`channel_scale_pages`): two ``[D, NTG]``; groups past the history read ``(1, 0)``.

    Transposed (channels first): the folds consume them as columns, beside ``Q^T`` (channel-wise
    K) and the ``[D, (j, h)]`` PV accumulator (channel-wise V), so no permute is needed.
    """
    PER_PAGE: tl.constexpr = PAGE * D // GROUP
    CH: tl.constexpr = D // PER_PAGE if D > PER_PAGE else 1
    CW: tl.constexpr = D // CH
    j = (t * BLOCK_N) // GROUP + tl.arange(0, NTG)
    valid = j * GROUP < n_q
    first = j * D  # flat index of the group's first entry
    entry = (first % PER_PAGE)[None, None, :] + tl.arange(0, CW)[None, :, None]  # [1, CW, NTG]
    off = head_off + page[:, None, :] * stride_page + entry * 2
    pair = tl.arange(0, 2)
    ptrs = scales_ptr + off[:, :, :, None] + pair[None, None, None, :]  # [CH, CW, NTG, 2]
    if ALL_VALID:
        sz = tl.load(ptrs)
    else:
        # (1, 0) as the load's fallback: no select after the load, whose result may be
        # consumed only in the next tile (prefetch)
        sz = tl.load(
            ptrs,
            mask=valid[None, None, :, None],
            other=(pair == 0).to(tl.float32)[None, None, None, :],
        )
    s, z = tl.split(sz.reshape(D, NTG, 2))
    return s, z


@triton.jit
def _load_channel_scales(
    scales_ptr,
    kv_indices_ptr,
    page_base,
    t,
    n_q,
    stride_page,
    head_off,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NTG: tl.constexpr,
):
    """Channel-wise ``(s', z')`` of the ``NTG`` token groups of tile ``t``: two ``[D, NTG]``."""
    page = channel_scale_pages(kv_indices_ptr, page_base, t, n_q, D, GROUP, PAGE, BLOCK_N, NTG)
    return channel_scales_at(
        scales_ptr, page, t, n_q, stride_page, head_off, D, GROUP, PAGE, BLOCK_N, NTG
    )


@triton.jit
def _load_channel_scales_rows(
    scales_ptr,
    kv_indices_ptr,
    page_base,
    t,
    n_q,
    stride_page,
    head_off,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NTG: tl.constexpr,
):
    """As :func:`_load_channel_scales`, as two ``[NTG, D]``: the reconstruct baseline's
    orientation, kept as it was measured (its SASS must not move with the folded kernel's)."""
    PER_PAGE: tl.constexpr = PAGE * D // GROUP
    CH: tl.constexpr = D // PER_PAGE if D > PER_PAGE else 1  # pages one group's scales span
    CW: tl.constexpr = D // CH
    j = (t * BLOCK_N) // GROUP + tl.arange(0, NTG)
    valid = j * GROUP < n_q
    first = j * D  # flat index of the group's first entry
    chunk = tl.arange(0, CH)
    page = tl.load(
        kv_indices_ptr + page_base + first[:, None] // PER_PAGE + chunk[None, :],
        mask=valid[:, None],
        other=0,
    ).to(tl.int64)  # [NTG, CH]
    entry = (first % PER_PAGE)[:, None, None] + tl.arange(0, CW)[None, None, :]  # [NTG, 1, CW]
    off = head_off + page[:, :, None] * stride_page + entry * 2
    pair = tl.arange(0, 2)
    sz = tl.load(
        scales_ptr + off[:, :, :, None] + pair[None, None, None, :],
        mask=valid[:, None, None, None],
        other=0.0,
    )  # [NTG, CH, CW, 2]
    s, z = tl.split(sz.reshape(NTG, D, 2))
    return tl.where(valid[:, None], s, 1.0), z


@triton.jit
def load_scales(
    scales_ptr,
    kv_indices_ptr,
    pages,
    row0,
    page_base,
    t,
    n_q,
    valid,
    stride_page,
    head_off,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHANNEL: tl.constexpr,
    MASKED: tl.constexpr,
    ROWS: tl.constexpr = False,
):
    """``(s', z')`` of one tile: ``[D, NTG]`` for channel-wise groups, ``[BLOCK_N, D/GROUP]``
    for token-wise ones (rows past the history read ``(1, 0)`` in the masked tile)."""
    if CHANNEL:
        NTG: tl.constexpr = BLOCK_N // GROUP if BLOCK_N > GROUP else 1
        if ROWS:
            return _load_channel_scales_rows(
                scales_ptr,
                kv_indices_ptr,
                page_base,
                t,
                n_q,
                stride_page,
                head_off,
                D,
                GROUP,
                PAGE,
                BLOCK_N,
                NTG,
            )
        else:
            return _load_channel_scales(
                scales_ptr,
                kv_indices_ptr,
                page_base,
                t,
                n_q,
                stride_page,
                head_off,
                D,
                GROUP,
                PAGE,
                BLOCK_N,
                NTG,
            )
    else:
        s, z = _load_token_scales(
            scales_ptr, pages, row0, stride_page, head_off, D // GROUP, PAGE, BLOCK_N
        )
        if MASKED:
            s = tl.where(valid[:, None], s, 1.0)
            z = tl.where(valid[:, None], z, 0.0)
        return s, z
