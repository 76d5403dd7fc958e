"""Engine-neutral serving core: a serving engine's requests and block ids over one foscar pool.

A continuous-batching engine runs one forward pass per step over a packed batch: the new tokens
of every scheduled request one after the other (``T`` tokens in all), each request with the
tokens it already holds (``past_length``) and the blocks its block manager gave it. This module
turns such a step into foscar operations, whatever the engine:

* **pages = the engine's block ids.** A request's quantized history lives in the pool pages named
  by its engine blocks, in order (history token ``t`` in block ``t // block_size`` of the
  request's list, row ``t % block_size``). The history starts after the BF16 sink, so a request
  of ``L`` tokens needs ``ceil(Lq / block_size) <= ceil(L / block_size)`` of its blocks: the
  engine's accounting (blocks for every token) always covers it, and the pages of the blocks
  its window tokens count stay unused (``(S + W) / block_size`` pages a request). Without block
  ids (an engine that leaves storage to foscar), the pool hands out its own pages.
* **BF16 windows per request.** Each live request holds one window slot (sink and recent ring,
  :class:`foscar.QuantizedKVCache`); ``max_requests`` slots exist. A request is started when it
  first appears with ``past_length == 0`` (a new request, or one the engine preempted and
  prefills again) and released by :meth:`PagedKV.release`; a released request's pages and slot
  go back to the pool and nothing of it is read again (a restarted request starts empty).
* **quantize-on-write.** A step's new K/V are stored per layer: the prefill and chunk rows
  through :meth:`foscar.QuantizedKVCache.append` (their tokens quantized, or kept in the
  windows, as the format says), the decode rows (one token each) through the step
  :meth:`PagedKV.begin_step` planned for every layer
  (:meth:`foscar.QuantizedKVCache.plan_decode_step`, then
  :meth:`~foscar.QuantizedKVCache.write_decode_step` per layer: the fused Triton write on a GPU).
* **attention of a step** (:meth:`PagedKV.attend`), per row:

  - *decode* (one new token on a non-empty request): the token is written and a
    :class:`foscar.DecodePlan` reads the pages through the step's :class:`foscar.DecodeBatch` of
    the layer (:meth:`foscar.attention.CacheAttention.decode_step`);
  - *prefill* (``past_length == 0``): causal attention over the new tokens at the model's
    precision (``prefill_attention``), as :class:`foscar.integrations.transformers.FoscarCache`
    does at a prefill;
  - *extend* (several new tokens on a non-empty request: a chunk of a chunked prefill): the
    stored tokens dequantized in fp32 and the new ones, causal over the new ones
    (:meth:`foscar.attention.CacheAttention.extend`, ``FoscarCache``'s extend path too); then the
    chunk is appended.

Host and device: every host decision about the decode rows is taken once per step, in
:meth:`PagedKV.begin_step`, before the forward: their lengths advance in every layer, and the fused
write's descriptors and the decode page tables go to the device in one copy (pinned memory,
non-blocking), into a buffer whose views every step of as many rows reuses (reserved for
``max_step_tokens`` rows with ``cuda_graphs``, grown as steps need without). Inside the forward a
decode row costs, per layer, the write's launches and the decode kernels' over those buffers;
nothing is planned, copied or synced (the finiteness check is off). A decode-only step of a
:class:`PagedKV` built with ``cuda_graphs=True`` is thus capturable
(:attr:`PagedKV.step_capturable`): its decode batch covers every packed token (the rows past the
requests' are padding that writes nothing and reads one stored token), and the kernels' split count
is planned for the longest history the pool holds, so a graph captured at one step replays every
later step of as many packed tokens after ``begin_step``. Steps with prefill or chunk rows do
per-row host work and stay eager; channel-wise history formats (written by torch operations) cannot
be captured and are refused.

Prefix sharing: a request whose first tokens equal a live request's starts on that request's
full quantized pages (:meth:`PagedKV.adopt_prefix`, Note [shared prefixes] in
foscar.cache.pages): the pages are counted, not copied, the sink rows are copied into the new
request's slot, and the engine goes on from the returned length, listing the shared blocks first in
the request's block table. A block of a :class:`PagedKV` is shared only that way: history page
``i`` starts after the request's own sink, so an engine's own block sharing (by token blocks)
does not line up with it, and the transformers adapter keeps the engine's block sharing off.

Shapes: ``T`` packed tokens, ``H_q`` query heads, ``H`` KV heads, ``D`` head_dim.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .. import KVFormat, QuantizedKVCache
from ..attention import CacheAttention
from ..cache import DecodeStep

__all__ = ["PagedKV", "StepRow", "window_bytes_per_request", "history_bytes_per_token"]


@dataclass(frozen=True)
class StepRow:
    """One request of an engine step.

    ``past_length``: tokens the request already holds; ``query_length``: its new tokens in this
    step (packed after the previous row's); ``block_ids``: every block the engine holds for it,
    in order (None: the pool picks pages itself).
    """

    request_id: Hashable
    past_length: int
    query_length: int
    block_ids: tuple[int, ...] | None = None


def history_bytes_per_token(formats: Sequence[KVFormat], num_kv_heads: int, head_dim: int) -> int:
    """Pool bytes one quantized history token takes over all layers (codes, and an fp32
    ``(s', z')`` pair per group, of K and V)."""
    total = 0.0
    for fmt in formats:
        for f in (fmt.key, fmt.value):
            total += num_kv_heads * (head_dim * f.bits / 8 + 8 * head_dim / f.group_size)
    return math.ceil(total)


def window_bytes_per_request(
    formats: Sequence[KVFormat], num_kv_heads: int, head_dim: int, window_dtype=torch.bfloat16
) -> int:
    """Bytes of one request's window slot over all layers: K and V of its BF16 sink and tail
    ring (``sink_tokens + recent_tokens + demotion quantum`` tokens)."""
    fmt = formats[0]
    tokens = fmt.sink_tokens + fmt.tail_capacity
    size = torch.tensor([], dtype=window_dtype).element_size()
    return len(formats) * 2 * num_kv_heads * tokens * head_dim * size


def _prefill_sdpa(query, key, value, scaling: float) -> torch.Tensor:
    """Causal attention of one request's tokens: ``query [1, H_q, T, D]``, ``key, value
    [1, H, T, D]`` -> ``[1, T, H_q, D]``, in the query's dtype."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=query.shape[2] > 1, scale=scaling
    )
    return out.transpose(1, 2)


def _gather(x: torch.Tensor, index) -> torch.Tensor:
    return x[index] if isinstance(index, slice) else x.index_select(0, index)


#: ``prefill_attention(query [1, H_q, T, D], key [1, H, T, D], value, scaling) -> [1, T, H_q, D]``
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class _Step:
    rows: tuple[StepRow, ...]
    offsets: tuple[int, ...]  # first packed token of each row
    decode: tuple[int, ...]  # row indices
    prefill: tuple[int, ...]
    extend: tuple[int, ...]
    num_tokens: int  # the rows' tokens
    packed_tokens: int  # the forward's tokens (padding included)
    planned: DecodeStep | None = None  # the decode rows' step, planned by begin_step
    indices: dict = field(default_factory=dict)  # packed-token indices, made at the first layer

    @property
    def decode_only(self) -> bool:
        return len(self.decode) == len(self.rows)


class PagedKV:
    """A serving engine's KV storage in one :class:`foscar.QuantizedKVCache` (module docstring).

    Parameters
    ----------
    fmt : KVFormat or sequence of KVFormat (one per layer; :func:`foscar.layer_formats`)
    num_layers, num_kv_heads, head_dim : int
        The model's (``num_kv_heads``: this process's share under tensor parallelism).
    num_blocks : int
        Pool pages; with engine block ids, more than the largest block id.
    block_size : int
        Tokens per page and per engine block (a power of two from 16 to 256).
    max_requests : int
        Window slots: requests alive at once.
    device : torch.device or str
    rotations : foscar.oscar.OscarRotations, optional
        OSCAR rotations (and fitted clips, with ``clip_bits``) set on every layer before any
        token is stored (:func:`foscar.oscar.apply_to_cache`); their heads must be this
        process's (:func:`foscar.serving.tp.rank_rotations`).
    clip_bits : as :func:`foscar.oscar.apply_to_cache`
    backend : ``decode_attention``'s backend
    decode_write : ``QuantizedKVCache``'s decode write path (``"auto"``: fused on a GPU)
    window_dtype : torch.dtype
        Storage of the sink and tail windows (BF16).
    max_step_tokens : int, optional
        Most packed tokens of a forward pass (the engine's batch budget). With ``cuda_graphs``
        (where it is required) the storage of the planned decode steps is reserved for as many
        rows, at a fixed address, and a larger step is refused; without, that storage grows as
        steps need and a step of any size is taken.
    cuda_graphs : bool
        Make decode-only steps capturable in a CUDA graph (module docstring): their decode
        batch covers every packed token (padding rows included), the kernels plan their split
        count for the longest history the pool holds, and decode steps take the fused write
        (``decode_write="fused"``; refused where a layer cannot: channel-wise groups, a device
        Triton cannot run on).

    Example
    -------
    >>> kv = PagedKV(fmt, num_layers=2, num_kv_heads=4, head_dim=64, num_blocks=32,
    ...              block_size=16, max_requests=4)
    >>> kv.begin_step([StepRow("a", 0, 5, (3,)), StepRow("b", 7, 1, (0,))])
    >>> out = kv.attend(0, q, k, v, scaling=0.125)   # q: [6, H_q, D], k, v: [6, H, D]
    >>> out = kv.attend(1, q, k, v, scaling=0.125)   # every layer, once per step
    """

    #: released requests remembered to recognise a restart, and restarts logged
    RESTART_LOG = 1024

    def __init__(
        self,
        fmt: KVFormat | Sequence[KVFormat],
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        max_requests: int,
        device: torch.device | str = "cpu",
        rotations=None,
        clip_bits=None,
        backend: str = "auto",
        decode_write: str = "auto",
        window_dtype: torch.dtype = torch.bfloat16,
        max_step_tokens: int | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        if max_step_tokens is not None and (
            isinstance(max_step_tokens, bool) or not isinstance(max_step_tokens, int)
            or max_step_tokens < 1
        ):
            raise ValueError(f"max_step_tokens must be a positive int, got {max_step_tokens!r}")
        if cuda_graphs and max_step_tokens is None:
            raise ValueError(
                "cuda_graphs=True needs max_step_tokens (the storage a captured step reads must "
                "be reserved before the first step)"
            )
        if cuda_graphs and decode_write == "torch":
            raise ValueError(
                "cuda_graphs=True needs the fused decode write; decode_write='torch' was given"
            )
        self.cache = QuantizedKVCache(
            fmt,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_pages=num_blocks,
            max_seqs=max_requests,
            num_layers=num_layers,
            page_size=block_size,
            device=device,
            window_dtype=window_dtype,
            # a finiteness check syncs the host with the device at every layer and step
            check_finite=False,
            # with cuda_graphs: "fused" once every layer was found to take it (below)
            decode_write="torch" if cuda_graphs else decode_write,
        )
        if rotations is not None:
            from ..oscar import apply_to_cache

            apply_to_cache(rotations, self.cache, clip_bits=clip_bits)
        if cuda_graphs:
            for layer in range(num_layers):
                reason = self.cache.fused_write_reason(layer)
                if reason is not None:
                    raise ValueError(
                        f"cuda_graphs=True: layer {layer} cannot take the fused decode write a "
                        f"captured step needs ({reason})"
                    )
            # a captured step cannot fall back to the host-planned torch write
            self.cache.decode_write = "fused"
        if max_step_tokens is not None and cuda_graphs:
            self.cache.reserve_decode_rows(max_step_tokens)
        self.cuda_graphs = cuda_graphs
        self.max_step_tokens = max_step_tokens
        #: the attention step over the cache (foscar.attention), shared with FoscarCache
        self.attention = CacheAttention(self.cache, backend)
        self.block_size = block_size
        self.max_requests = max_requests
        self._step: _Step | None = None
        self._lengths: dict[Hashable, int] = {}  # live request -> tokens it holds
        self._released: OrderedDict[Hashable, int] = OrderedDict()  # recently released ones
        self.peak_requests = 0
        #: the most pool pages held at once (a page several requests share counts once)
        self.peak_pages = 0
        #: requests started as a copy of another (:meth:`fork`)
        self.forks = 0
        #: ``(request_id, tokens it held)`` each time a request was started again (preempted and
        #: prefilled from scratch); the last ``RESTART_LOG`` only
        self.restarts: list[tuple[Hashable, int]] = []

    @property
    def backend(self) -> str:
        """The decode backend (:func:`foscar.decode_attention`'s)."""
        return self.attention.backend

    # ------------------------------------------------------------------ requests
    @property
    def live_requests(self) -> tuple:
        return tuple(self._lengths)

    @property
    def num_free_slots(self) -> int:
        return self.max_requests - len(self._lengths)

    def release(self, request_id: Hashable) -> None:
        """End a request (finished, cancelled or preempted): its pages and window slot return to
        the pool. Releasing an unknown or released request does nothing."""
        if request_id in self._lengths:
            self._released[request_id] = self._lengths.pop(request_id)
            while len(self._released) > self.RESTART_LOG:
                self._released.popitem(last=False)
            self.cache.free(request_id)

    def release_all(self) -> None:
        for request_id in list(self._lengths):
            self.release(request_id)

    def adopt_prefix(self, request_id: Hashable, donor_id: Hashable, common_tokens: int,
                     prompt_length: int) -> int:
        """Start request ``request_id`` (of ``prompt_length`` prompt tokens, whose first
        ``common_tokens`` equal those of live request ``donor_id``) on the donor's full quantized
        pages that lie before its own recent window, shared by reference count
        (:meth:`foscar.QuantizedKVCache.adopt_prefix`). Returns the tokens the request now holds
        (0: nothing to share, the request starts empty at its first step as usual); its next
        step's row has that ``past_length`` and lists ``pages_of`` the shared pages first in its
        blocks. A request that was live is released first."""
        if donor_id not in self._lengths:
            raise ValueError(f"donor_id {donor_id!r} is not a live request")
        if request_id == donor_id:
            raise ValueError(f"donor_id {donor_id!r} is request_id itself")
        self.release(request_id)
        pages = self.cache.shareable_pages(donor_id, common_tokens, prompt_length)
        if not pages:
            return 0
        if not self.num_free_slots:
            raise ValueError(f"all {self.max_requests} window slots are held (max_requests)")
        held = self._released.pop(request_id, None)
        if held:  # started again after a preemption, as in begin_step
            self.restarts.append((request_id, held))
            del self.restarts[: -self.RESTART_LOG]
        self.cache.add_sequence(request_id)
        length = self.cache.adopt_prefix(request_id, donor_id, pages)
        self._lengths[request_id] = length
        self.peak_requests = max(self.peak_requests, len(self._lengths))
        return length

    def fork(self, parent_id: Hashable, request_id: Hashable, block_ids: Sequence[int],
             shared_pages: int = 0) -> None:
        """Start request ``request_id`` as a copy of live request ``parent_id`` on the engine
        blocks ``block_ids`` (as many as the parent holds): parallel samples of one prompt,
        prefilled once (:meth:`foscar.QuantizedKVCache.fork`). The first ``shared_pages`` blocks
        are the parent's own, shared (full quantized pages: at most :meth:`shareable_pages`), the
        rest fresh. Its next step's row has the parent's ``past_length`` and lists ``block_ids``
        first in its blocks."""
        if parent_id not in self._lengths:
            raise ValueError(f"parent_id {parent_id!r} is not a live request")
        if request_id in self._lengths:
            raise ValueError(f"request_id {request_id!r} is already a live request")
        if not self.num_free_slots:
            raise ValueError(f"all {self.max_requests} window slots are held (max_requests)")
        block_ids = list(block_ids)
        if block_ids[:shared_pages] != self.cache.pages_of(parent_id)[:shared_pages]:
            raise ValueError(
                f"block_ids must begin with the parent's {shared_pages} shared pages, got "
                f"{block_ids[:shared_pages]}"
            )
        self.cache.add_sequence(request_id, pages=block_ids[shared_pages:])
        try:
            self.cache.fork(request_id, parent_id, shared_pages)
        except ValueError:
            self.cache.free(request_id)
            raise
        self._released.pop(request_id, None)
        self._lengths[request_id] = self._lengths[parent_id]
        self.forks += 1
        self.peak_requests = max(self.peak_requests, len(self._lengths))
        self.peak_pages = max(self.peak_pages, self.cache.num_pages - self.cache.num_free_pages)

    def shareable_pages(self, parent_id: Hashable) -> int:
        """Full pages live request ``parent_id`` has quantized in every layer, which a fork of
        it may share (:meth:`fork`)."""
        length = self._lengths[parent_id]
        return self.cache.shareable_pages(parent_id, length, length)

    def _new_blocks(self, row: StepRow, held: list[int]) -> list[int]:
        """The blocks of ``row`` its sequence does not hold yet (``held`` must be a prefix)."""
        if row.block_ids is None:
            return []
        blocks = list(row.block_ids)
        if blocks[: len(held)] != held:
            raise ValueError(
                f"request {row.request_id!r}: the engine's blocks {blocks} do not continue the "
                f"pages it holds {held} (blocks must only be appended)"
            )
        return blocks[len(held) :]

    def _hand_pages(self, request_id: Hashable, pages: list[int]) -> None:
        """Give a live request more pool pages (free ones, checked by the caller)."""
        self.cache.add_pages(request_id, pages)

    # ------------------------------------------------------------------ steps
    def begin_step(self, rows: Sequence[StepRow], *, num_tokens: int | None = None) -> None:
        """Take the layout of the next forward pass and plan its decode rows (host work, and one
        copy of the decode rows' plan to the device).

        Rows with ``past_length == 0`` start their request (again, after a preemption: what it
        held is released first); every other row's request must be live and hold exactly
        ``past_length`` tokens. The decode rows' step is planned for every layer here
        (:meth:`foscar.QuantizedKVCache.plan_decode_step`): their lengths count the new token
        from now on, and each layer's :meth:`attend` writes it. A rejected step changes nothing
        but those releases.

        ``num_tokens``: the forward's packed tokens, padding after the rows' included (default:
        the rows' tokens); with ``cuda_graphs``, a decode-only step plans a row for each (the
        padding rows write nothing), and ``num_tokens`` may not exceed ``max_step_tokens``.
        """
        rows = tuple(rows)
        self._step = None  # a rejected step leaves no earlier one for attend to replay
        if not rows:
            raise ValueError("rows must name at least one request")
        total = sum(r.query_length for r in rows)
        packed = total if num_tokens is None else num_tokens
        if isinstance(packed, bool) or not isinstance(packed, int) or packed < total:
            raise ValueError(
                f"num_tokens must be an int >= the rows' {total} tokens, got {num_tokens!r}"
            )
        if self.cuda_graphs and packed > self.max_step_tokens:
            raise ValueError(
                f"the step packs {packed} tokens, more than max_step_tokens={self.max_step_tokens}"
            )
        ids = [r.request_id for r in rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a step names a request twice: {ids}")
        for i, r in enumerate(rows):
            if r.query_length < 1 or r.past_length < 0:
                raise ValueError(
                    f"rows[{i}]: query_length must be >= 1 and past_length >= 0, got "
                    f"{r.query_length} and {r.past_length}"
                )
            if r.past_length and self._lengths.get(r.request_id) != r.past_length:
                raise ValueError(
                    f"rows[{i}]: request {r.request_id!r} holds "
                    f"{self._lengths.get(r.request_id, 'no')} tokens, the engine says "
                    f"{r.past_length}"
                )
        starts = [r for r in rows if r.past_length == 0]
        for r in starts:
            self.release(r.request_id)  # an engine may restart a request without releasing it
        if len(starts) > self.num_free_slots:
            raise ValueError(
                f"{len(starts)} requests start but {self.num_free_slots} of the "
                f"{self.max_requests} window slots are free (max_requests)"
            )
        new_pages = {
            r.request_id: self._new_blocks(r, [] if not r.past_length
                                           else self.cache.pages_of(r.request_id))
            for r in rows
        }
        num_free = self.cache.num_free_pages
        wanted = [p for pages in new_pages.values() for p in pages]
        bad = [p for p in wanted if not self.cache.page_is_free(p)]
        if bad or len(set(wanted)) != len(wanted):
            raise ValueError(
                f"engine blocks {bad or wanted} are not free pool pages (held by another "
                "request, given twice, or outside the pool)"
            )
        decode = tuple(i for i, r in enumerate(rows) if r.past_length and r.query_length == 1)
        # pages the decode rows take beyond their blocks (a pool without engine blocks), checked
        # before anything changes: their step is planned below
        ps = self.block_size
        short = sum(
            max(0, -(-self.cache.quantized_tokens(rows[i].request_id, rows[i].past_length + 1)
                     // ps)
                - len(self.cache.pages_of(rows[i].request_id)) - len(new_pages[rows[i].request_id]))
            for i in decode
        )
        if short > num_free - len(wanted):
            raise ValueError(
                f"page pool exhausted: the decode rows need {short} more pages, "
                f"{num_free - len(wanted)} are free"
            )
        # ---- nothing below can fail
        for r in starts:
            held = self._released.pop(r.request_id, None)
            if held:
                self.restarts.append((r.request_id, held))
                del self.restarts[: -self.RESTART_LOG]
            self.cache.add_sequence(r.request_id)
        for r in rows:
            self._hand_pages(r.request_id, new_pages[r.request_id])
            self._lengths[r.request_id] = r.past_length + r.query_length
        self.peak_requests = max(self.peak_requests, len(self._lengths))
        self.peak_pages = max(self.peak_pages, self.cache.num_pages - self.cache.num_free_pages)
        offsets, total = [], 0
        for r in rows:
            offsets.append(total)
            total += r.query_length
        prefill = tuple(i for i, r in enumerate(rows) if not r.past_length)
        extend = tuple(i for i, r in enumerate(rows) if r.past_length and r.query_length > 1)
        step = _Step(rows, tuple(offsets), decode, prefill, extend, total, packed)
        if decode:
            padding = packed - total if self.cuda_graphs and step.decode_only else 0
            step.planned = self.cache.plan_decode_step(
                [rows[i].request_id for i in decode],
                padding_rows=padding,
                # one captured launch serves every later step: splits for the longest history
                split_history=self.cache.num_pages * ps if self.cuda_graphs else None,
            )
        self._step = step

    def end_step(self, *, graphed: bool) -> None:
        """End the begun step's forward. ``graphed``: it ran as a CUDA graph (captured or
        replayed), whose layer writes ran without their host code: the planned decode step is
        recorded as written in every layer (a forward that ran eagerly wrote each itself)."""
        step = self._step
        if graphed and step is not None and step.planned is not None:
            self.cache.record_replayed_step(step.planned)

    @property
    def step_capturable(self) -> bool:
        """Whether the begun step's forward may be captured in a CUDA graph and replayed for
        later steps of as many packed tokens: ``cuda_graphs`` is on and every row decodes (its
        per-layer work is then kernel launches over buffers :meth:`begin_step` refills)."""
        step = self._step
        return self.cuda_graphs and step is not None and step.decode_only

    @property
    def planned_step(self) -> DecodeStep | None:
        """The begun step's decode rows as one :class:`foscar.cache.DecodeStep` planned for
        every layer (None before a step, or where the step has no decode rows)."""
        return None if self._step is None else self._step.planned

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scaling: float,
        prefill_attention: PrefillAttention | None = None,
    ) -> torch.Tensor:
        """Store layer ``layer``'s new K/V of the step and attend.

        Parameters
        ----------
        q : [T', H_q, D]; k, v : [T', H, D] (post-RoPE), ``T'`` at least the step's packed tokens
            (rows past the requests' tokens: padding)
        scaling : the logit scale
        prefill_attention : causal attention of a prefill row (default: torch SDPA)

        Returns
        -------
        ``[T', H_q, D]`` in ``q``'s dtype (padding rows zero, or meaningless where the decode
        batch covers them: a capturable step).

        The decode rows' work is one fused write and a :class:`foscar.DecodePlan` run over the
        step :meth:`begin_step` planned: no host bookkeeping, nothing copied to the device, so a
        capturable step's call can be captured in a CUDA graph.
        """
        step = self._step
        if step is None:
            raise RuntimeError("attend() before begin_step()")
        need = step.packed_tokens if step.planned and step.planned.padding_rows else (
            step.num_tokens
        )
        if q.shape[0] < need or k.shape[0] < need or v.shape[0] < need:
            raise ValueError(
                f"the step packs {need} tokens, q, k and v hold {q.shape[0]}, {k.shape[0]} and "
                f"{v.shape[0]}"
            )
        prefill_attention = prefill_attention or _prefill_sdpa
        rows = step.rows

        def tokens(i):
            return slice(step.offsets[i], step.offsets[i] + rows[i].query_length)

        # chunks on stored history: read the history before the chunk joins it
        extended = {}
        for i in step.extend:
            t = tokens(i)
            extended[i] = self._attend_extend(layer, rows[i], q[t], k[t], v[t], scaling)
        written = step.prefill + step.extend
        if written:
            idx = self._token_index(step, "written", written, k.device)
            self.attention.store(
                layer,
                [rows[i].request_id for i in written],
                _gather(k, idx),
                _gather(v, idx),
                [rows[i].query_length for i in written],
            )
        planned = step.planned
        if planned is not None:
            idx = self._token_index(step, "decode", step.decode, k.device)
            o = self.attention.decode_step(
                layer, _gather(q, idx).contiguous(), _gather(k, idx), _gather(v, idx), planned,
                scaling,
            ).to(q.dtype)
            if not extended and not step.prefill and isinstance(idx, slice) and (
                idx.stop == q.shape[0]
            ):
                return o  # the decode batch is every packed token
        out = torch.zeros_like(q)
        for i, o_ext in extended.items():
            out[tokens(i)] = o_ext
        for i in step.prefill:
            t = tokens(i)
            o_pre = prefill_attention(
                q[t].transpose(0, 1).unsqueeze(0),
                k[t].transpose(0, 1).unsqueeze(0),
                v[t].transpose(0, 1).unsqueeze(0),
                scaling,
            )
            out[t] = o_pre[0].to(q.dtype)
        if planned is not None:
            if isinstance(idx, slice):
                out[idx] = o
            else:
                out.index_copy_(0, idx, o)
        return out

    @staticmethod
    def _token_index(step: _Step, name: str, group: tuple[int, ...], device):
        """The packed tokens of the rows ``group`` (for the decode rows, then the padding rows
        of their step): a slice when they lead the batch in order, else a device index, made
        once per step (a copy from pinned memory, no sync)."""
        if name not in step.indices:
            tokens = [
                t
                for i in group
                for t in range(step.offsets[i], step.offsets[i] + step.rows[i].query_length)
            ]
            if name == "decode":
                tokens += range(step.num_tokens, step.num_tokens + step.planned.padding_rows)
            if tokens == list(range(len(tokens))):
                step.indices[name] = slice(0, len(tokens))
            else:
                index = torch.tensor(tokens, dtype=torch.long)
                if torch.device(device).type == "cuda":
                    index = index.pin_memory().to(device, non_blocking=True)
                step.indices[name] = index.to(device)
        return step.indices[name]

    def _attend_extend(self, layer, row: StepRow, q, k, v, scaling) -> torch.Tensor:
        """``q: [t, H_q, D]``, ``k, v: [t, H, D]`` of a chunk on ``row``'s stored tokens ->
        ``[t, H_q, D]``: fp32 attention over the dequantized history and the chunk."""
        o = self.attention.extend(
            layer, row.request_id, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            scaling,
        )  # [H_q, t, D]
        return o.transpose(0, 1).to(q.dtype)

    # ------------------------------------------------------------------ accounting
    def stored_length(self, request_id: Hashable) -> int:
        """Tokens a live request holds (its decode token of the begun step included: the step
        counts it in every layer when it is planned)."""
        return self.cache.seq_len(request_id, self.cache.num_layers - 1)

    def pool_bytes(self) -> int:
        """Bytes of the pool and the window buffers."""
        return self.cache.pool_bytes()
