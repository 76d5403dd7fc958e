"""A decode step planned once for every layer (:meth:`QuantizedKVCache.plan_decode_step`).

A decode step appends one token to each of ``B`` sequences in every layer, then attends.
Through :meth:`~QuantizedKVCache.append` and :meth:`~QuantizedKVCache.plan` every layer plans its
scatter on the host, advances its own lengths and copies its page tables; a planned step does
that once:

* **on the host, once per step** (:func:`plan`): every sequence's lengths advance in every layer
  (pages taken as an append takes them), and the fused write's descriptors
  (``[rows, 6]`` int32, foscar.kernels.cache_write.DESC_FIELDS) and the step's
  :class:`DecodeBatch` (the lengths after the step, the same in every layer) are computed;
* **one copy** moves them into the cache's step buffer (:class:`StepBuffer`, an int32 device
  tensor); the step's descriptors and DecodeBatch tensors are views of it at offsets fixed by the
  row count, so every step of ``rows`` rows hands the kernels the same tensors;
* **per layer** (:meth:`QuantizedKVCache.write_decode_step`, :func:`foscar.decode_attention`):
  the fused write over the descriptors and the decode kernels over the layer's DecodeBatch
  (``step.batches[layer]``: every layer's holds the same tensors), launches
  that read device buffers only. A CUDA graph captured over one step's layers replays any later
  step of as many rows once :func:`plan` has refreshed the buffer.

Step buffer of ``R`` rows (int32), for a step of ``rows <= R`` rows, from offset 0: descriptors
``[rows, 6]``, ``kv_indptr [rows + 1]``, ``kv_last_page_len``, ``seq_lens``, ``num_quantized``,
``slots`` (``[rows]`` each), then ``kv_indices`` (the step's pages; the buffer keeps room for
``num_pages + R``). Only the used prefix is copied.

Padding rows (``padding_rows``) follow the sequences: their descriptors write nothing
(:data:`foscar.cache.write.NO_WRITE`) and their plan rows read one stored token (a length-1
sequence in window slot 0, reading pool page 0 where a format keeps no windows), whatever that
holds: finite, meaningless outputs that a caller ignores. A CUDA graph of a padded batch thus
serves every step with fewer sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import write
from .layout import num_quantized
from .pages import DecodeBatch, SequenceState

__all__ = ["DecodeStep", "StepBuffer", "plan"]


@dataclass
class DecodeStep:
    """One decode step of ``seq_ids``, planned for every layer (module docstring).

    ``batches``: the step's :class:`DecodeBatch` of each layer (``batches[layer]``; lengths
    after the step), the same tensors, views of the cache's step buffer; ``desc``: ``[rows, 6]``
    int32 descriptors of the fused write (None where the format demotes more than one token at
    a time: channel-wise groups, written by torch); ``rows``: sequences plus padding rows.
    Valid until the cache plans its next step, frees any sequence, or appends to one of the
    step's sequences in the layer being written. ``written``: the layers stored so far; the
    cache plans no further step while some layer of this one is unwritten and its sequences live.
    """

    seq_ids: tuple
    batches: tuple[DecodeBatch, ...]
    desc: torch.Tensor | None
    rows: int
    padding_rows: int
    serial: int  # the cache's count of planned steps when this one was made
    seqs: tuple[SequenceState, ...] = field(repr=False)
    new_lengths: tuple[int, ...] = field(repr=False)
    _scatter: write.DecodeScatter | None = field(default=None, repr=False)
    written: set[int] = field(default_factory=set, repr=False)

    def scatter(self, cache) -> write.DecodeScatter:
        """The torch path's index tensors, made once per step on first need."""
        if self._scatter is None:
            self._scatter = write.decode_scatter(cache, self.seqs, self.new_lengths)
        return self._scatter


class StepBuffer:
    """The device storage of planned steps: one int32 tensor for up to ``rows`` rows (module
    docstring), and per row count a DecodeBatch of each layer whose tensors are views of it.

    ``fixed``: the capacity was reserved (:meth:`QuantizedKVCache.reserve_decode_rows`) and the
    tensor never moves; otherwise a step of more rows replaces it with a larger one.
    """

    def __init__(self, rows: int, num_pages: int, device: torch.device, fixed: bool) -> None:
        self.rows = rows
        self.fixed = fixed
        self.data = torch.zeros(12 * rows + 1 + num_pages + rows, dtype=torch.int32, device=device)
        self._views: dict[int, tuple] = {}  # rows -> (a DecodeBatch per layer, desc view)

    def views(self, rows: int, cache) -> tuple[tuple[DecodeBatch, ...], torch.Tensor]:
        """The per-layer DecodeBatches and the descriptor view of a step of ``rows`` rows (made
        once per row count: every step of as many rows hands the kernels the same objects and
        tensors, so the decode plans made for them are reused)."""
        if rows not in self._views:
            buf, o = self.data, 6 * rows
            desc = buf[:o].view(rows, 6)
            parts = []
            for n in (rows + 1, rows, rows, rows, rows):
                parts.append(buf[o : o + n])
                o += n
            indptr, last, lens, nq, slots = parts
            fmt = cache.windows
            batch = DecodeBatch(
                seq_ids=(),
                kv_indptr=indptr,
                kv_indices=buf[o:],
                kv_last_page_len=last,
                seq_lens=lens,
                num_quantized=nq,
                slots=slots,
                seq_lens_host=[],
                num_quantized_host=[],
                pages_host=[],
                slots_host=[],
                page_size=cache.page_size,
                sink_tokens=fmt.sink_tokens,
                tail_capacity=fmt.tail_capacity,
                layer=0,
            )
            batches = tuple(batch.for_layer(layer) for layer in range(cache.num_layers))
            self._views[rows] = (batches, desc)
        return self._views[rows]

    def made_views(self, rows: int) -> tuple | None:
        """:meth:`views` of ``rows`` rows if a step of that many rows was planned, else None."""
        return self._views.get(rows)


def plan(
    cache, seq_ids: tuple, seqs, new_lengths, padding_rows: int, split_history: int | None
) -> DecodeStep:
    """Fill the step buffer with the step of ``seq_ids`` (records ``seqs``) growing to
    ``new_lengths`` (their pages taken and their lengths advanced in every layer by the caller,
    who checked that the buffer holds the rows or may grow) and return the step."""
    fmt = cache.windows
    ps = cache.page_size
    n = len(seqs)
    rows = n + padding_rows
    buffer = cache.step_buffer(rows)
    batches, desc = buffer.views(rows, cache)

    lens = list(new_lengths)
    nq = [s.quantized(length, fmt) for s, length in zip(seqs, lens)]
    pages = [s.pages[: -(-q // ps)] for s, q in zip(seqs, nq)]
    slots = [s.slot for s in seqs]
    if padding_rows:
        # a length-1 sequence in slot 0: its token is in the windows, or in pool page 0 where the
        # format keeps none
        pad_q = num_quantized(1, fmt)
        lens += [1] * padding_rows
        nq += [pad_q] * padding_rows
        pages += [[0] if pad_q else [] for _ in range(padding_rows)]
        slots += [0] * padding_rows
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + len(p))
    last = [(q - 1) % ps + 1 if q else 0 for q in nq]
    host: list[int] = []
    demotes_one = fmt.demotion_quantum == 1
    if demotes_one:
        for row in write.decode_descriptors(cache, seqs, new_lengths):
            host.extend(row)
        host.extend(write.NO_WRITE * padding_rows)
    else:
        host.extend([0] * (6 * rows))
    host += indptr
    host += last
    host += lens
    host += nq
    host += slots
    for p in pages:
        host += p
    values = torch.tensor(host, dtype=torch.int32)
    target = buffer.data[: len(host)]
    if cache.device.type == "cuda":
        # non-blocking from pinned memory: no sync with the queued kernels (which read the
        # buffer of the previous step before this copy lands, in stream order)
        target.copy_(values.pin_memory(), non_blocking=True)
    else:
        target.copy_(values)

    sequences = tuple(seqs)
    for layer, batch in enumerate(batches):
        batch.seq_ids = seq_ids
        batch.seq_lens_host = lens
        batch.num_quantized_host = nq
        batch.pages_host = pages
        batch.slots_host = slots
        batch.padding_rows = padding_rows
        batch.fixed_split_history = split_history
        batch.sequence_records = sequences
        cache.mark_plan_valid(batch, layer)
    return DecodeStep(
        seq_ids=seq_ids,
        batches=batches,
        desc=desc if demotes_one else None,
        rows=rows,
        padding_rows=padding_rows,
        serial=cache.step_serial,
        seqs=tuple(seqs),
        new_lengths=tuple(new_lengths),
    )
