"""The cache's writers: quantize, pack and scatter new tokens into one layer's pool tensors.

Two paths store the same bits (``tests/test_cache_decode.py``, ``tests/test_cache_write.py``):

* :func:`write_tokens`, any number of tokens per sequence (a prefill): index tensors built per
  sequence with ``arange``, so a 100K-token prefill costs a few tensor operations;
* :func:`write_decode_step`, one token per sequence (a decode step): the same scatter with index
  lists built in Python, or the fused Triton write (foscar.cache.fused_write);
* :func:`write_planned_step`, a decode step planned once for every layer
  (foscar.cache.decode_step): the fused write over the step's device descriptors, or the torch
  scatter with the step's index tensors, no host planning per layer.

Every token is rounded to the window dtype on entry, so a token quantizes to the same bits
whether it is demoted from the tail ring or written straight into the history by a prefill.
A demoted token leaves the tail ring (or, with no recent window, is the new token itself), is
quantized per group with the layer's history format (its clip ratio and, for keys, GPTQ
rounding: foscar.cache.transforms), folded to ``(s', z')`` and packed in the role's channel
order (foscar.formats). Shapes: ``H`` KV heads, ``D`` head_dim, ``n`` demoted tokens.

These functions take the :class:`foscar.cache.QuantizedKVCache` whose append has checked every
argument; they read its pools, formats and transforms.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..formats import GroupAxis, KVFormat, fold_scale_offset, pack_codes, words_per_row
from ..quantize import quantize, quantize_gptq
from . import fused_write
from .pages import host_to

__all__ = [
    "DECODE_WRITE_PATHS",
    "DecodeScatter",
    "LayerStorage",
    "allocate_layer",
    "check_decode_write",
    "write_decode_step",
    "write_planned_step",
    "write_tokens",
]

DECODE_WRITE_PATHS = ("auto", "fused", "torch")


def check_decode_write(decode_write: str) -> None:
    """Raise ``ValueError`` unless ``decode_write`` names a decode-step write path."""
    if decode_write not in DECODE_WRITE_PATHS:
        raise ValueError(f"decode_write must be one of {DECODE_WRITE_PATHS}, got {decode_write!r}")


@dataclass
class FusedWriteState:
    """What a cache's fused decode write keeps between calls (``cache.fused_write_state``)."""

    #: (a step's descriptor rows, the same as a device tensor): every layer of a step writes
    #: with the same descriptor, copied to the device once per step
    descriptors: tuple | None = None
    #: why the fused write stopped being taken under ``decode_write="auto"`` (None: it was not)
    failure: str | None = None


@dataclass
class LayerStorage:
    """The pool tensors of one layer (shapes in the foscar.cache docstring)."""

    k_words: torch.Tensor
    k_scales: torch.Tensor
    v_words: torch.Tensor
    v_scales: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    k_tail: torch.Tensor
    v_tail: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(vars(self))


def allocate_layer(cache, fmt: KVFormat) -> LayerStorage:
    """Zeroed pool and window tensors of one layer of format ``fmt``."""
    p, h, d, ps = cache.num_pages, cache.num_kv_heads, cache.head_dim, cache.page_size
    dev = cache.device

    def words(f):
        return torch.zeros(p, h, ps, words_per_row(d, f.bits), dtype=torch.int32, device=dev)

    def scales(f):
        e = cache.scale_entries_per_page(f)
        return torch.zeros(p, h, e, 2, dtype=torch.float32, device=dev)

    s, r = fmt.sink_tokens, fmt.tail_capacity
    wd = cache.window_dtype
    return LayerStorage(
        k_words=words(fmt.key),
        k_scales=scales(fmt.key),
        v_words=words(fmt.value),
        v_scales=scales(fmt.value),
        k_sink=torch.zeros(cache.max_seqs, h, s, d, dtype=wd, device=dev),
        v_sink=torch.zeros(cache.max_seqs, h, s, d, dtype=wd, device=dev),
        k_tail=torch.zeros(cache.max_seqs, h, r, d, dtype=wd, device=dev),
        v_tail=torch.zeros(cache.max_seqs, h, r, d, dtype=wd, device=dev),
    )


# ---------------------------------------------------------------------------- any token count
def write_tokens(cache, layer, seqs, new_lengths, counts, k, v) -> None:
    """Scatter ``counts[i]`` new tokens of each sequence (``k, v: [sum(counts), H, D]``, the
    sequences' tokens one after another) to the sink, the history (quantized) and the tail ring;
    ``new_lengths``: the sequences' lengths after the call."""
    fmt = cache.windows
    st = cache.layers[layer]
    sink, cap, ps = fmt.sink_tokens, fmt.tail_capacity, cache.page_size
    ar = torch.arange
    sink_src, sink_slot, sink_pos = [], [], []
    tail_src, tail_slot, tail_pos = [], [], []
    old_slot, old_ring, old_dst = [], [], []  # demoted tokens read back from the tail ring
    new_src, new_dst = [], []  # demoted tokens taken straight from this call's input
    hist_page, hist_row = [], []  # destination of each demoted token, in demotion order
    segments = []  # (pages of the sequence, first quantized index, count)
    offset = n_demoted = 0
    for seq, l1, n in zip(seqs, new_lengths, counts):
        l0 = l1 - n
        lq0, lq1 = seq.quantized(l0, fmt), seq.quantized(l1, fmt)
        pages = torch.tensor(seq.pages, dtype=torch.long)
        if l0 < sink:
            p = ar(l0, min(l1, sink))
            sink_src.append(offset + p - l0)
            sink_pos.append(p)
            sink_slot.append(torch.full_like(p, seq.slot))
        if lq1 > lq0:
            split = min(max(l0 - sink, lq0), lq1)  # history indices below it come from the ring
            t_old, t_new = ar(lq0, split), ar(split, lq1)
            old_slot.append(torch.full_like(t_old, seq.slot))
            old_ring.append(t_old % cap)
            old_dst.append(n_demoted + t_old - lq0)
            new_src.append(offset + sink + t_new - l0)
            new_dst.append(n_demoted + t_new - lq0)
            t = ar(lq0, lq1)
            hist_page.append(pages[t // ps])
            hist_row.append(t % ps)
            segments.append((pages, lq0, lq1 - lq0))
            n_demoted += lq1 - lq0
        first_tail = max(l0, sink + lq1)
        p = ar(first_tail, max(first_tail, l1))
        tail_src.append(offset + p - l0)
        tail_pos.append((p - sink) % cap)
        tail_slot.append(torch.full_like(p, seq.slot))
        offset += n

    dev = cache.device

    def cat(parts):
        return (
            host_to(dev, torch.cat(parts))
            if parts
            else torch.empty(0, dtype=torch.long, device=dev)
        )

    if n_demoted:
        _write_demoted(
            cache,
            layer,
            k,
            v,
            (cat(old_slot), cat(old_ring), cat(old_dst)),
            (cat(new_src), cat(new_dst)),
            segments,
            cat(hist_page),
            cat(hist_row),
        )
    wd = cache.window_dtype
    if sink_src:
        src, slot, pos = cat(sink_src), cat(sink_slot), cat(sink_pos)
        st.k_sink[slot, :, pos] = k[src].to(wd)
        st.v_sink[slot, :, pos] = v[src].to(wd)
    src, slot, pos = cat(tail_src), cat(tail_slot), cat(tail_pos)
    if src.numel():
        st.k_tail[slot, :, pos] = k[src].to(wd)
        st.v_tail[slot, :, pos] = v[src].to(wd)


# ---------------------------------------------------------------------------- one token each
def write_decode_step(cache, layer, seqs, new_lengths, k, v, fused: bool = False) -> None:
    """:func:`write_tokens` for one new token per sequence (``k, v: [B, H, D]``), bit for bit.

    The same scatter, with index lists built in Python: per sequence that is a few integer
    operations, where :func:`write_tokens` spends a dozen tensor operations on every call.
    ``fused``: quantize, pack and scatter in one
    Triton launch per role instead (foscar.cache.fused_write); where that launch fails and the
    cache's ``decode_write`` is "auto", warn once and write with torch from then on.
    """
    if fused:
        rows = tuple(decode_descriptors(cache, seqs, new_lengths))
        # every layer of a step has the same descriptor: one host-to-device copy per step
        state = cache.fused_write_state
        if state.descriptors is None or state.descriptors[0] != rows:
            state.descriptors = (rows, host_to(cache.device, list(rows), torch.int32))
        if _write_fused_or_fail(cache, layer, k, v, state.descriptors[1]):
            return
    write_decode_scatter(cache, layer, k, v, decode_scatter(cache, seqs, new_lengths))


def write_planned_step(cache, layer, k, v, step, fused: bool) -> None:
    """One layer's write of a planned decode step (foscar.cache.decode_step.DecodeStep):
    ``k, v: [step.rows, H, D]``, padding rows past the step's sequences written nowhere. The
    fused write reads the step's descriptors; the torch path scatters with the step's index
    tensors (made at the first layer that needs them). Same bits as :func:`write_decode_step`."""
    if fused and _write_fused_or_fail(cache, layer, k, v, step.desc):
        return
    n = len(step.seqs)
    write_decode_scatter(cache, layer, k[:n], v[:n], step.scatter(cache))


def _write_fused_or_fail(cache, layer, k, v, desc) -> bool:
    """The fused write of both roles; False where it failed and the cache's ``decode_write`` is
    "auto" (warned once; the cache writes with torch from then on)."""
    try:
        write_decode_fused(cache, layer, k, v, desc)
        return True
    except Exception as e:  # e.g. Triton cannot compile here
        if cache.decode_write == "fused":
            raise
        # "auto": the torch path writes the same destinations with the same bits (a K written
        # before a failed V launch is overwritten identically)
        why = cache.fused_write_state.failure = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"foscar: the fused decode write failed ({why}); this cache "
            "writes decode steps with torch operations from now on",
            RuntimeWarning,
            stacklevel=4,
        )
        return False


@dataclass
class DecodeScatter:
    """Where the torch path puts one decode step's tokens: device index tensors, the same for
    every layer. ``sink``, ``tail``: ``(source row, slot, position)``; ``demoted``: the
    arguments of :func:`_write_demoted` after ``k, v`` (None: nothing is demoted)."""

    sink: tuple | None
    tail: tuple | None
    demoted: tuple | None


def decode_scatter(cache, seqs, new_lengths) -> DecodeScatter:
    """The torch path's scatter of one new token per sequence, sequence ``i`` growing to
    ``new_lengths[i]`` tokens (its pages already taken)."""
    sink_src, sink_slot, sink_pos = [], [], []
    tail_src, tail_slot, tail_pos = [], [], []
    old_slot, old_ring, old_dst, new_src, new_dst = [], [], [], [], []
    hist_page, hist_row, segments = [], [], []
    for i, (seq, l1) in enumerate(zip(seqs, new_lengths)):
        at_sink, at_tail, demoted = _decode_step_places(cache, seq, l1)
        if at_sink is not None:
            sink_src.append(i)
            sink_slot.append(seq.slot)
            sink_pos.append(at_sink)
        for ring, page, row in demoted:  # from the ring, or this token (ring None)
            if ring is None:
                new_src.append(i)
                new_dst.append(len(hist_page))
            else:
                old_slot.append(seq.slot)
                old_ring.append(ring)
                old_dst.append(len(hist_page))
            hist_page.append(page)
            hist_row.append(row)
        if demoted:
            lq0 = seq.quantized(l1 - 1, cache.windows)
            segments.append((seq.pages, lq0, len(demoted)))
        if at_tail is not None:
            tail_src.append(i)
            tail_slot.append(seq.slot)
            tail_pos.append(at_tail)
    dev = cache.device

    def idx(*lists):
        return tuple(host_to(dev, values) for values in lists)

    return DecodeScatter(
        sink=idx(sink_src, sink_slot, sink_pos) if sink_src else None,
        tail=idx(tail_src, tail_slot, tail_pos) if tail_src else None,
        demoted=(
            (
                idx(old_slot, old_ring, old_dst),
                idx(new_src, new_dst),
                segments,
                *idx(hist_page, hist_row),
            )
            if hist_page
            else None
        ),
    )


def write_decode_scatter(cache, layer, k, v, scatter: DecodeScatter) -> None:
    """Write one token per sequence (``k, v: [B, H, D]``) into ``layer`` as ``scatter`` says."""
    st = cache.layers[layer]
    if scatter.demoted is not None:
        _write_demoted(cache, layer, k, v, *scatter.demoted)
    wd = cache.window_dtype
    if scatter.sink is not None:
        src, slot, pos = scatter.sink
        st.k_sink[slot, :, pos] = k[src].to(wd)
        st.v_sink[slot, :, pos] = v[src].to(wd)
    if scatter.tail is not None:
        src, slot, pos = scatter.tail
        st.k_tail[slot, :, pos] = k[src].to(wd)
        st.v_tail[slot, :, pos] = v[src].to(wd)


def _decode_step_places(cache, seq, l1: int) -> tuple:
    """Where a decode step puts the token that makes ``seq`` ``l1`` tokens long:
    ``(sink position or None, tail ring position or None, demoted)`` with ``demoted`` the
    history tokens this step quantizes, each ``(ring position or None for the new token
    itself, page, row)`` (one per step for token-wise K and V; a group for channel-wise)."""
    fmt = cache.windows
    sink, cap, ps = fmt.sink_tokens, fmt.tail_capacity, cache.page_size
    l0 = l1 - 1
    lq0, lq1 = seq.quantized(l0, fmt), seq.quantized(l1, fmt)
    demoted = [
        (None if t == l0 - sink else t % cap, seq.pages[t // ps], t % ps) for t in range(lq0, lq1)
    ]
    at_sink = l0 if l0 < sink else None
    at_tail = (l0 - sink) % cap if l0 >= sink + lq1 else None
    return at_sink, at_tail, demoted


#: the descriptor of a row that writes nothing (a padding row of a planned step)
NO_WRITE = (0, -1, -1, -1, -1, -1)


def decode_descriptors(cache, seqs, new_lengths):
    """Per sequence the six integers of the fused write's descriptor
    (foscar.kernels.cache_write.DESC_FIELDS), as a generator of tuples. Token-wise history
    formats only (demotion quantum 1: at most one token demoted per step)."""
    for seq, l1 in zip(seqs, new_lengths):
        at_sink, at_tail, demoted = _decode_step_places(cache, seq, l1)
        ring, page, row = demoted[0] if demoted else (-1, -1, -1)
        yield (
            seq.slot,
            -1 if at_sink is None else at_sink,
            -1 if at_tail is None else at_tail,
            -1 if ring is None else ring,
            page,
            row,
        )


def write_decode_fused(cache, layer, k, v, desc) -> None:
    """The fused decode write of ``k, v: [B, H, D]`` into ``layer``: one launch per role over
    ``desc: [B, 6]`` int32 on the cache's device."""
    wd = cache.window_dtype
    for name, x in (("k", k), ("v", v)):
        x = x if x.dtype == wd else x.to(wd)
        if x.stride(-1) != 1:
            x = x.contiguous()
        # looked up at call time: tests replace the launcher
        fused_write.write_decode_tokens(cache, layer, name, x, desc)


# ---------------------------------------------------------------------------- the history
def _write_demoted(cache, layer, k, v, old, new, segments, hist_page, hist_row) -> None:
    """Quantize the demoted tokens of K and V into the history, in demotion order.

    old: ``(slot, ring position, destination)`` of the tokens leaving the tail rings;
    new: ``(source row, destination)`` of the tokens taken straight from this call's K/V;
    hist_page, hist_row: where each demoted token lands (``[n]`` device indices).
    """
    st = cache.layers[layer]
    (old_slot, old_ring, old_dst), (new_src, new_dst) = old, new
    for name, src in (("k", k), ("v", v)):
        tail = getattr(st, f"{name}_tail")
        demoted = torch.empty(
            len(hist_page),
            cache.num_kv_heads,
            cache.head_dim,
            dtype=tail.dtype,
            device=tail.device,
        )
        demoted[old_dst] = tail[old_slot, :, old_ring]
        demoted[new_dst] = src[new_src].to(tail.dtype)
        _write_history(cache, layer, name, demoted, segments, hist_page, hist_row)


def _write_history(cache, layer: int, name, demoted, segments, hist_page, hist_row) -> None:
    """Quantize the demoted tokens ``[n, H, D]`` of K or V; store codes, s' and z'."""
    st = cache.layers[layer]
    f = cache.stored_format(layer, name)
    mapping = cache.windows.mapping
    x = demoted.transpose(0, 1)  # [H, n, D]: channel-wise groups run along tokens
    gptq = cache.transforms[layer].key_gptq if name == "k" else None
    codes, scale, offset = quantize(x, f) if gptq is None else quantize_gptq(x, f, gptq)
    scale, offset = fold_scale_offset(scale, offset, f.bits, mapping)
    words = pack_codes(codes, f.bits, mapping, cache.channel_order(name, layer))  # [H, n, W]
    getattr(st, f"{name}_words")[hist_page, :, hist_row] = words.transpose(0, 1)
    # Scales in flat group order per sequence (the foscar.cache docstring) -> (page, entry).
    per_page = cache.scale_entries_per_page(f)
    d, g = cache.head_dim, f.group_size
    flat_page, flat_entry, list_page, list_entry = [], [], [], []
    for pages, lq0, count in segments:
        if f.axis is GroupAxis.TOKEN:
            lo, hi = lq0 * d // g, (lq0 + count) * d // g
        else:
            lo, hi = lq0 // g * d, (lq0 + count) // g * d
        if isinstance(pages, list):  # a decode step: few entries, Python beats tensor ops
            list_page += [pages[e // per_page] for e in range(lo, hi)]
            list_entry += [e % per_page for e in range(lo, hi)]
        else:
            e = torch.arange(lo, hi)
            flat_page.append(pages[e // per_page])
            flat_entry.append(e % per_page)
    if list_page:
        flat_page.append(torch.tensor(list_page, dtype=torch.long))
        flat_entry.append(torch.tensor(list_entry, dtype=torch.long))
    fp = host_to(cache.device, torch.cat(flat_page))
    fe = host_to(cache.device, torch.cat(flat_entry))
    # token-wise scale [H, n, D/g], channel-wise [H, n/g, D]: both flatten to flat order.
    h = cache.num_kv_heads
    pairs = torch.stack([scale.reshape(h, -1), offset.reshape(h, -1)], dim=-1)  # [H, n_e, 2]
    getattr(st, f"{name}_scales")[fp, :, fe] = pairs.transpose(0, 1)
