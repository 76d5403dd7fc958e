"""The page allocator of the cache: the pool's free pages and window slots, the live sequences
with their pages and per-layer lengths, and the decode plans (:class:`DecodeBatch`) made from
them.

A sequence's quantized history lives in pages of ``page_size`` tokens, listed in FlashInfer's
CSR convention (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, int32). Pages are shared
by all layers (one page table per sequence); each layer has its own pool tensors. This module
holds no pool tensor: it decides where tokens go, the writers (foscar.cache.write) put them
there.

Note [stale plans]: a DecodeBatch copies page lists and lengths to the device once, so the
kernels never ask the host; a plan is therefore only right while the sequences it covers keep
the state it was made from. :meth:`PageTable.check_plan` (run by :func:`foscar.decode_attention`
before any launch) compares them on the host, with no device sync: each sequence must be the
same live sequence (not freed, its id not reused) holding the planned number of tokens in the
plan's layer. An append to another layer leaves the plan right: it writes only that layer's
pool tensors, and a live sequence's page list only grows, so the planned pages stay its first
pages. Every change bumps a per-layer stamp; the cache remembers, per plan (weakly, by
identity), the stamp it last found the plan right at, so a plan reused with nothing changed (a
CUDA-graph replay, a step's plans) is checked in constant time. The plan itself stays data.

Note [shared prefixes]: sequences whose first tokens are equal can hold the same full history
pages (:meth:`PageTable.share_pages`): a page counts its holders and goes back to the free list
when the last one is freed. Only full pages that every holder has already quantized are shared,
and nothing writes into a full page again, so a shared page is read-only. A sequence that adopts
``n`` pages starts at ``sink_tokens + n * page_size`` tokens with ``history_floor = n *
page_size``: its quantized history is ``max(num_quantized(L), history_floor)`` tokens
(:meth:`SequenceState.quantized`), so the adopted tokens are never counted in its BF16 tail. Once
its length passes the pages it adopted plus the recent window, the floor no longer binds and its
layout is the one it would have had writing every token itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..formats import KVFormat
from .layout import check_int, num_quantized

__all__ = ["DecodeBatch", "PageTable", "SequenceState", "host_to"]

#: stamps of the layers' states, unique over every cache of the process: a plan that matches a
#: stamp belongs to that cache and layer, unchanged since (Note [stale plans])
_STAMPS = itertools.count()


def host_to(device: torch.device, values, dtype=torch.long) -> torch.Tensor:
    """A host list or CPU tensor on ``device`` without a stream sync: CUDA copies go through
    pinned memory, non-blocking (a plain ``torch.tensor(..., device="cuda")`` waits for every
    kernel queued before it, which serialised each layer's append with the GPU)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(eq=False)  # compared by identity: the cache remembers plans it checked
class DecodeBatch:
    """Where each sequence of a decode batch lives in the cache, as the kernels read it.

    Device tensors (int32), ``B`` sequences::

        kv_indptr:        [B + 1]  CSR offsets into kv_indices
        kv_indices:       [nnz]    pages of the quantized history, in order
        kv_last_page_len: [B]      tokens in the last page (1..page_size; 0 if no pages)
        seq_lens:         [B]      total tokens L (sink + history + tail)
        num_quantized:    [B]      tokens in the quantized history Lq
        slots:            [B]      row of the sequence in the sink/tail buffers

    The sink holds ``min(L, sink_tokens)`` tokens; the tail holds positions
    ``sink_tokens + Lq .. L - 1`` at ring slots ``(p - sink_tokens) % tail_capacity``.
    ``*_host`` lists mirror the device tensors for host-side planning.

    ``padding_rows`` rows follow the planned sequences (``batch_size = len(seq_ids) +
    padding_rows``): rows of a step padded to a fixed size (a CUDA graph replayed for any step of
    that size), each reading one stored token of the cache, whatever it holds; their outputs mean
    nothing. ``fixed_split_history``: history tokens the kernels plan their split count for,
    instead of the longest sequence's, so that one captured launch serves every later step
    (:attr:`split_history`).

    A plan stays valid until a sequence it covers is freed or appended to in ``layer``
    (Note [stale plans] in foscar.cache.pages); :func:`foscar.decode_attention` raises on a
    stale one. :meth:`for_layer` gives the same tables for another layer whose lengths agree.

    A plan is data only: the decode backends' workspaces and bound launches belong to their
    plans (:class:`foscar.DecodePlan`), never to the batch.
    """

    seq_ids: tuple
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    seq_lens: torch.Tensor
    num_quantized: torch.Tensor
    slots: torch.Tensor
    seq_lens_host: list[int]
    num_quantized_host: list[int]
    pages_host: list[list[int]]
    slots_host: list[int]
    page_size: int
    sink_tokens: int
    tail_capacity: int
    layer: int
    padding_rows: int = 0
    fixed_split_history: int | None = None
    #: the planned sequences' records (compared by identity: Note [stale plans])
    sequence_records: tuple = field(default=(), repr=False, compare=False)

    def for_layer(self, layer: int) -> DecodeBatch:
        """The same page tables and lengths (the same device tensors) as a plan of ``layer``,
        for a layer that holds as many tokens of each sequence (every layer of a decode step;
        :meth:`PageTable.check_plan` raises where they differ)."""
        if layer == self.layer:
            return self
        return dataclasses.replace(self, layer=layer)

    @property
    def batch_size(self) -> int:
        """Rows of the plan: the sequences, then the padding rows."""
        return len(self.seq_ids) + self.padding_rows

    @property
    def split_history(self) -> int:
        """History tokens the decode kernels plan their split count for."""
        if self.fixed_split_history is not None:
            return self.fixed_split_history
        return max(self.num_quantized_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    def sink_len(self, i: int) -> int:
        return min(self.seq_lens_host[i], self.sink_tokens)

    def tail_range(self, i: int) -> tuple[int, int]:
        """Positions ``[start, end)`` of sequence ``i``'s BF16 tail."""
        start = self.sink_tokens + self.num_quantized_host[i]
        return min(start, self.seq_lens_host[i]), self.seq_lens_host[i]


@dataclass
class SequenceState:
    """One live sequence: its row in the window buffers, its pages, its tokens per layer.

    ``history_floor``: history tokens quantized whatever the length says, the pages a sequence
    adopted from another (Note [shared prefixes]); 0 for a sequence that wrote all its tokens.
    """

    slot: int
    pages: list[int]
    lengths: list[int]
    history_floor: int = 0

    def quantized(self, length: int, fmt: KVFormat) -> int:
        """Tokens of the quantized history at ``length`` tokens: the format's rule
        (:func:`~foscar.cache.layout.num_quantized`), never below the adopted pages."""
        return max(num_quantized(length, fmt), self.history_floor)


class PageTable:
    """Free pages and window slots of a pool, the live sequences, their decode plans.

    The base of :class:`foscar.cache.QuantizedKVCache`, which adds the pool tensors and the
    writers. ``windows``: the format whose sink, recent window and demotion quantum every layer
    shares (it sets how many tokens are quantized, so how many pages a length needs).
    """

    def __init__(
        self,
        *,
        num_pages: int,
        max_seqs: int,
        num_layers: int,
        page_size: int,
        windows: KVFormat,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.max_seqs = max_seqs
        self.num_layers = num_layers
        self.page_size = page_size
        self.device = device
        #: the KVFormat whose BF16 windows (sink, tail) and operand mapping every layer shares
        self.windows = windows
        # the free pages: a stack (pop() gives 0 first) and the same pages as a set, so that a
        # serving step's checks cost its own pages, not the pool's
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_set: set[int] = set(self._free_pages)
        self._free_slots: list[int] = list(range(max_seqs - 1, -1, -1))
        #: holders beyond the first of each shared page (Note [shared prefixes])
        self._extra_holders: dict[int, int] = {}
        self._seqs: dict[object, SequenceState] = {}
        self._next_id = 0
        self._stamps = [next(_STAMPS) for _ in range(num_layers)]
        #: plan -> {layer: the stamp at which it was last found valid there} (Note [stale plans])
        self._valid_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: planned decode steps so far, and frees (a planned step is valid while this stands)
        self._step_serial = 0

    @property
    def step_serial(self) -> int:
        """Planned decode steps and frees so far: a planned step is valid while this stands."""
        return self._step_serial

    # copies (deepcopy, pickle) forget which plans were found valid: plans are this process's
    # objects, weakly held, and a copy checks any plan in full once
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_valid_plans"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._valid_plans = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ sequences
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def page_is_free(self, page: int) -> bool:
        """Whether pool page ``page`` is free (no sequence holds it)."""
        return page in self._free_set

    @property
    def sequences(self) -> tuple:
        return tuple(self._seqs)

    def seq_len(self, seq_id, layer: int = 0) -> int:
        return self._lookup(seq_id, "seq_id").lengths[self._check_layer(layer)]

    def pages_of(self, seq_id) -> list[int]:
        return list(self._lookup(seq_id, "seq_id").pages)

    def add_sequence(self, seq_id=None, *, pages: Sequence[int] | None = None):
        """Start an empty sequence and return its id.

        ``pages`` optionally hands the sequence specific pool pages (e.g. from a serving
        engine's block manager); they are used first, in order, and more come from the free
        list as the sequence grows. They must be in ``[0, num_pages)``, distinct, and not held by
        another sequence.
        """
        if seq_id is None:
            while self._next_id in self._seqs:
                self._next_id += 1
            seq_id = self._next_id
        elif seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already a live sequence")
        if not self._free_slots:
            raise ValueError(f"max_seqs ({self.max_seqs}) sequences are already live")
        pages = self._check_pages(pages)
        self._take_free(pages)
        slot = self._free_slots.pop()
        self._seqs[seq_id] = SequenceState(
            slot=slot, pages=list(pages), lengths=[0] * self.num_layers
        )
        return seq_id

    def add_pages(self, seq_id, pages: Sequence[int]) -> None:
        """Give a live sequence more pool pages, used after the ones it holds (a serving engine's
        block manager growing a request block by block). ``pages`` are checked as
        :meth:`add_sequence`'s are, before anything changes. Plans stay valid: a plan's page
        table lists the pages its tokens sit in, and those do not move."""
        seq = self._lookup(seq_id, "seq_id")
        pages = self._check_pages(pages)
        self._take_free(pages)
        seq.pages.extend(pages)

    def free_pages(self) -> frozenset[int]:
        """The pool pages no sequence holds."""
        return frozenset(self._free_set)

    def _take_free(self, pages: list[int]) -> None:
        """Take checked free ``pages`` out of the free stack and set."""
        if pages:
            taken = set(pages)
            self._free_pages = [p for p in self._free_pages if p not in taken]
            self._free_set -= taken

    def _pop_free(self) -> int:
        page = self._free_pages.pop()
        self._free_set.discard(page)
        return page

    def free_slot_order(self) -> list[int]:
        """The free window slots in the order new sequences take them, the next one last."""
        return list(self._free_slots)

    def sequence_state(self, seq_id) -> SequenceState:
        """A copy of live sequence ``seq_id``'s record: its window slot, pages and tokens per
        layer."""
        seq = self._lookup(seq_id, "seq_id")
        return SequenceState(
            slot=seq.slot,
            pages=list(seq.pages),
            lengths=list(seq.lengths),
            history_floor=seq.history_floor,
        )

    def free_page_order(self) -> list[int]:
        """The free pages in the order appends take them, the next one last (the order
        :meth:`set_free_order` sets)."""
        return list(self._free_pages)

    def set_free_order(self, order: list[int]) -> None:
        """Benchmarks: the order free pages are taken in (``order`` holds the free pages, each
        once; the last is taken first), e.g. scattered over the pool."""
        if len(order) != len(self._free_set) or set(order) != self._free_set:
            raise ValueError("order must list every free page once")
        self._free_pages = list(order)

    def _check_pages(self, pages) -> list[int]:
        if pages is None:
            return []
        if isinstance(pages, torch.Tensor):
            pages = pages.tolist()
        pages = list(pages)
        for i, p in enumerate(pages):
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(f"pages[{i}] must be an int, got {type(p).__name__}")
            if not 0 <= p < self.num_pages:
                raise ValueError(
                    f"pages[{i}] = {p} points outside the pool (expected 0 <= page < "
                    f"{self.num_pages})"
                )
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages lists a page twice: {pages}")
        for i, p in enumerate(pages):
            if p not in self._free_set:
                owner = next((s for s, q in self._seqs.items() if p in q.pages), None)
                raise ValueError(f"pages[{i}] = {p} overlaps the pages of sequence {owner!r}")
        return pages

    def quantized_tokens(self, seq_id, length: int) -> int:
        """Tokens live sequence ``seq_id`` keeps quantized at ``length`` tokens (the format's
        rule, and at least the pages it adopted: Note [shared prefixes])."""
        return self._lookup(seq_id, "seq_id").quantized(length, self.windows)

    def page_holders(self, page: int) -> int:
        """How many live sequences hold pool page ``page`` (0: free)."""
        if page in self._free_set:
            return 0
        return 1 + self._extra_holders.get(page, 0)

    @property
    def num_shared_pages(self) -> int:
        """Pool pages more than one live sequence holds (Note [shared prefixes])."""
        return len(self._extra_holders)

    def share_pages(self, seq_id, donor_id, num_pages: int) -> None:
        """Have empty sequence ``seq_id`` hold the first ``num_pages`` pages of ``donor_id``
        too, quantized by the donor and read-only from now on, its history floor set to them
        (Note [shared prefixes]). Lengths and windows are the caller's
        (:meth:`foscar.QuantizedKVCache.adopt_prefix`)."""
        seq = self._lookup(seq_id, "seq_id")
        donor = self._lookup(donor_id, "donor_id")
        check_int(num_pages, "num_pages", low=1)
        if seq is donor:
            raise ValueError(f"donor_id {donor_id!r} is seq_id itself")
        if seq.pages or any(seq.lengths):
            raise ValueError(f"seq_id {seq_id!r} must be empty (no pages, no tokens) to share")
        if num_pages > len(donor.pages):
            raise ValueError(
                f"num_pages must be <= {len(donor.pages)} (the pages donor {donor_id!r} holds), "
                f"got {num_pages}"
            )
        shared = donor.pages[:num_pages]
        self.count_holder(shared)
        seq.pages = list(shared)
        seq.history_floor = num_pages * self.page_size

    def count_holder(self, pages: Sequence[int]) -> None:
        """One more sequence holds each of the held ``pages`` (the caller adds them to its list:
        Note [shared prefixes])."""
        for page in pages:
            self._extra_holders[page] = self._extra_holders.get(page, 0) + 1

    def free(self, seq_id) -> None:
        """End a sequence: its pages and window slot return to the pool for reuse (and the plans
        that cover it go stale). A page another live sequence holds too stays held by it."""
        seq = self._lookup(seq_id, "seq_id")
        del self._seqs[seq_id]
        released = []
        for page in seq.pages:
            others = self._extra_holders.get(page, 0)
            if others == 0:
                released.append(page)
            elif others == 1:
                del self._extra_holders[page]
            else:
                self._extra_holders[page] = others - 1
        self._free_pages.extend(reversed(released))
        self._free_set.update(released)
        self._free_slots.append(seq.slot)
        self._touch(range(self.num_layers))
        self._step_serial += 1

    def _lookup(self, seq_id, name: str) -> SequenceState:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise ValueError(
                f"{name} {seq_id!r} is not a live sequence (unknown or already freed)"
            ) from None

    def _check_layer(self, layer) -> int:
        check_int(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return layer

    def _touch(self, layers) -> None:
        """Mark ``layers`` changed: plans must be checked again (Note [stale plans])."""
        for layer in layers:
            self._stamps[layer] = next(_STAMPS)

    # ------------------------------------------------------------------ growing
    def _pages_needed(self, seqs: list[SequenceState], new_lengths: list[int]) -> list[int]:
        """Pages each sequence must take to hold ``new_lengths`` tokens; raises (before any
        change) if the pool has too few free."""
        need = [
            max(0, math.ceil(s.quantized(n, self.windows) / self.page_size) - len(s.pages))
            for s, n in zip(seqs, new_lengths)
        ]
        if sum(need) > len(self._free_pages):
            raise ValueError(
                f"page pool exhausted: this append needs {sum(need)} more pages, "
                f"{len(self._free_pages)} of {self.num_pages} are free"
            )
        return need

    def _take_pages(self, seqs: list[SequenceState], need: list[int]) -> None:
        for s, n in zip(seqs, need):
            for _ in range(n):
                s.pages.append(self._pop_free())

    def assume_appended(self, seq_id, length: int) -> None:
        """Benchmarks only: mark ``length`` tokens of every layer present without writing them.

        Pages are taken as an append would take them, but the pool keeps whatever bits it
        holds (decode cost does not depend on the values). Tests and serving never call this.
        """
        seq = self._lookup(seq_id, "seq_id")
        need = math.ceil(seq.quantized(length, self.windows) / self.page_size) - len(seq.pages)
        if need > len(self._free_pages):
            raise ValueError(
                f"page pool exhausted: {need} more pages needed, {len(self._free_pages)} free"
            )
        for _ in range(max(0, need)):
            seq.pages.append(self._pop_free())
        seq.lengths = [length] * self.num_layers
        self._touch(range(self.num_layers))

    # ------------------------------------------------------------------ planning
    def plan(self, seq_ids: Sequence, layer: int = 0) -> DecodeBatch:
        """Page tables and window descriptors of ``seq_ids`` (in that order) for decoding.

        Plan after the step's appends: the plan is valid until a sequence it covers is freed or
        appended to in ``layer`` (Note [stale plans]).
        """
        layer = self._check_layer(layer)
        seq_ids = tuple(seq_ids)
        if not seq_ids:
            raise ValueError("seq_ids must name at least one sequence")
        seqs = [self._lookup(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        lens, nq, pages = [], [], []
        for i, s in enumerate(seqs):
            n = s.lengths[layer]
            if n == 0:
                raise ValueError(f"seq_ids[{i}] = {seq_ids[i]!r} has no tokens in layer {layer}")
            q = s.quantized(n, self.windows)
            lens.append(n)
            nq.append(q)
            pages.append(s.pages[: math.ceil(q / self.page_size)])
        indptr = [0]
        for p in pages:
            indptr.append(indptr[-1] + len(p))
        last = [(q - 1) % self.page_size + 1 if q else 0 for q in nq]
        dev = self.device

        def i32(values):
            return host_to(dev, values, torch.int32)

        batch = DecodeBatch(
            seq_ids=seq_ids,
            kv_indptr=i32(indptr),
            kv_indices=i32([p for ps in pages for p in ps]),
            kv_last_page_len=i32(last),
            seq_lens=i32(lens),
            num_quantized=i32(nq),
            slots=i32([s.slot for s in seqs]),
            seq_lens_host=lens,
            num_quantized_host=nq,
            pages_host=pages,
            slots_host=[s.slot for s in seqs],
            page_size=self.page_size,
            sink_tokens=self.windows.sink_tokens,
            tail_capacity=self.windows.tail_capacity,
            layer=layer,
            sequence_records=tuple(seqs),
        )
        self.mark_plan_valid(batch, layer)
        return batch

    def check_plan(self, batch: DecodeBatch) -> None:
        """Raise ``ValueError`` if ``batch`` no longer describes its sequences in
        ``batch.layer`` of this cache: one was freed (its pages may hold another sequence now)
        or appended to since :meth:`plan`. Host-side only, no device sync (Note [stale
        plans])."""
        layer = batch.layer
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"batch.layer must be in [0, {self.num_layers}), got {layer!r}")
        self._check_plan_at(batch, layer)

    def _check_plan_at(self, batch: DecodeBatch, layer: int) -> None:
        """:meth:`check_plan` of ``batch`` in ``layer`` (a valid layer index)."""
        stamp = self._stamps[layer]
        valid_at = self._valid_plans.get(batch)
        if valid_at is not None and valid_at.get(layer) == stamp:
            return
        seqs = batch.sequence_records
        if len(seqs) != len(batch.seq_ids):
            raise ValueError("batch was not made by cache.plan(); plan the sequences with it")
        # C-level loops: this runs once per layer and decode step (Note [stale plans])
        live = list(map(self._seqs.get, batch.seq_ids))
        lengths = batch.seq_lens_host
        if batch.padding_rows:
            lengths = lengths[: len(seqs)]
        if any(map(operator.is_not, live, seqs)) or lengths != [s.lengths[layer] for s in seqs]:
            self._raise_stale(batch, layer, live)
        self._valid_plans.setdefault(batch, {})[layer] = stamp

    def mark_plan_valid(self, batch: DecodeBatch, layer: int) -> None:
        """Record ``batch`` as made now for ``layer`` (its only valid layer until checked again):
        :meth:`plan` and a planned decode step call this for the batches they fill."""
        self._valid_plans[batch] = {layer: self._stamps[layer]}

    def _raise_stale(self, batch: DecodeBatch, layer: int, live: list) -> None:
        """The error of :meth:`check_plan`, naming the first sequence that changed."""
        for i, (sid, seq, now, n) in enumerate(
            zip(batch.seq_ids, batch.sequence_records, live, batch.seq_lens_host)
        ):
            if now is not seq:
                raise ValueError(
                    f"batch is a stale plan: seq_ids[{i}] = {sid!r} was freed after "
                    "cache.plan() made it (or the plan is another cache's); its pages may hold "
                    "another sequence now: plan again"
                )
            if seq.lengths[layer] != n:
                raise ValueError(
                    f"batch is a stale plan: seq_ids[{i}] = {sid!r} holds {seq.lengths[layer]} "
                    f"tokens in layer {layer}, the plan {n}: call cache.plan() after the step's "
                    "appends"
                )
