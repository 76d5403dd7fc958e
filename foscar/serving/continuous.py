"""foscar in transformers' continuous-batching engine (checked on transformers 5.25 and 5.17; the
differences between them are detected, not assumed).

The engine (``ContinuousBatchingManager``) keeps its request queue, scheduler (FIFO: decoding
requests first, then chunks of new prompts within ``max_batch_tokens``), request states,
preemption (a request that cannot get blocks is prefilled again later) and generation loop. Two
things change:

* **the cache.** The engine builds its ``PagedAttentionCache`` when the loop starts; the manager
  has it build :class:`FoscarPagedCache` instead, a subclass that keeps the engine's block
  manager (the engine's block accounting and block ids) but stores K/V in a
  :class:`~foscar.serving.PagedKV` whose pages are those block ids. The engine's own K/V tensors
  are built one channel wide (the engine never reads them: writes and reads go through foscar),
  so they take a few percent of the memory. The cache also admits a request only while a window
  slot is free, and frees the request's pages and slot when the engine frees its blocks
  (finished, cancelled, preempted);
* **the attention** (``"foscar_paged"``, :func:`foscar_paged_attention`): the engine packs a
  step's new tokens ``[1, H, T, D]``; the attention function hands them to
  :meth:`PagedKV.attend`, which stores them and attends (decode rows through
  :func:`foscar.decode_attention`, prefill rows through transformers' SDPA, chunks on stored
  history over the dequantized history).

How the cache learns a step's layout: the engine calls ``extend_read_and_write_indices(request_id,
past_length, query_length, ...)`` for every request of the next batch, in batch order, before the
forward pass; the cache records them and starts the step when the manager's model runner calls
:meth:`FoscarPagedCache.begin_step` (or, for a forward the manager did not announce, at the first
attention call).
transformers >= 5.24 calls ``cache.update(k, v, layer, kwargs)`` from the model before the
attention function (the cache returns the new K/V and marks them with itself); 5.17 passes the
cache to the attention function as ``kwargs["cache"]``.

How a step runs: the manager's model runner calls :meth:`FoscarPagedCache.begin_step` before
each forward (and before any CUDA-graph replay), on the stream the forward runs on; it starts the
step in :class:`~foscar.serving.PagedKV`, which plans the decode rows once for every layer and
copies that plan into device buffers (:mod:`foscar.serving.core`).

CUDA graphs (``build_manager(..., cuda_graphs=True)``, off by default for foscar caches): every
step takes the engine's varlen path (the decode fast path is off, below), padded to the engine's
token buckets. A decode-only step's forward is captured once per bucket and replayed: its
attention is the fused write and the decode kernels over the buffers ``begin_step`` refills,
its padding rows write nothing. A step with prefill or chunk rows runs eagerly (the model runner
is told so), its per-row work depends on the rows. Only token-wise history formats (the default
``int4``/``int2`` and OSCAR files) on a CUDA device with a bfloat16 model qualify; others are
refused by :func:`build_manager`, naming why.

Prefix sharing (``build_manager(..., prefix_sharing=True)``): foscar answers the scheduler's
prefix search itself. A new request adopts the full quantized pages of the live request whose
prompt shares its longest prefix (:meth:`PagedKV.adopt_prefix`), and the engine prefills the rest;
the engine's own block hashing stays off (its blocks line up with tokens, foscar's pages with
history after the sink). Only live requests donate: a request that ended leaves nothing to
reuse. Checked on transformers 5.25 (its block ledger counts the shared blocks' holders).

Parallel samples (``add_request(..., num_children=k)``, or the manager-wide
``num_return_sequences``): the engine prefills the prompt once, then forks the request into ``k``
children named ``<request_id>__child#<i>``; a foscar cache copies the parent's pages and windows
into each child's fresh blocks (:meth:`FoscarPagedCache.prepare_fork_request`; with prefix
sharing the parent's full quantized pages are shared instead), and each child draws with
``seed + i + 1`` (:mod:`foscar.serving.sampling`). A request is admitted once window slots are
free for it and its children.

Switched off for foscar caches: the engine's own block sharing, the flash decode fast path (it
writes the engine's K/V tensors), CPU offloading (it copies them) and asynchronous batching (a
step's layout must be known before its forward).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import queue
import threading
import uuid
from functools import partial

import torch

try:
    from transformers import AttentionInterface, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "foscar.serving needs transformers>=5.17 with continuous batching: pip install 'foscar[hf]'"
    ) from e

from ..attention import attach, attached
from .core import PagedKV, StepRow
from .flashinfer_kv import (
    FlashInferPagedKV,
    attention_description,
    flashinfer_unavailable,
)
from .kv_spec import ResolvedKV, resolve_kv
from .pool_sizes import (
    DEFAULT_BLOCK_SIZE,
    PoolSizes,
    check_block_size,
    check_sizes,
    head_dim_of,
    num_kv_heads_of,
    size_pool,
)
from .sampling import child_request_ids, is_child_request_id
from .tp import rank_rotations, tp_size_of

__all__ = [
    "ATTENTION_NAME",
    "DEFAULT_BLOCK_SIZE",
    "FoscarBatchingManager",
    "FoscarPagedCache",
    "build_manager",
    "foscar_paged_attention",
]

#: the attention implementation the manager selects for a foscar cache
ATTENTION_NAME = "foscar_paged"


# ---------------------------------------------------------------------------- attention
def foscar_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for the engine (``AttentionInterface`` signature).

    ``query: [1, H_q, T, D]``, ``key, value: [1, H, T, D]`` (a step's packed new tokens) ->
    ``([1, T, H_q, D], None)``. Outside a :class:`FoscarPagedCache` forward (a plain
    ``model(...)`` call while the name is selected) this is transformers' SDPA attention.
    """
    cache = kwargs.get("cache")
    if not isinstance(cache, FoscarPagedCache):
        cache = attached(key)
    if not isinstance(cache, FoscarPagedCache):
        kwargs.pop("cache", None)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scaling = module.scaling if scaling is None else scaling
    return cache.attend(module, query, key, value, scaling), None


def register(name: str = ATTENTION_NAME) -> None:
    """Register :func:`foscar_paged_attention` under ``name`` (idempotent). No mask function is
    registered: the engine's packed batch needs none (each row's tokens are known)."""
    AttentionInterface.register(name, foscar_paged_attention)


def _prefill(module, query, key, value, scaling):
    out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling)
    return out


# ---------------------------------------------------------------------------- caches
def _allocators(cache: PagedAttentionCache) -> list:
    """The engine's block allocators: one per attention type (transformers >= 5.24:
    ``cache_allocators``; 5.17: ``group_cache_managers``)."""
    found = getattr(cache, "cache_allocators", None)
    if found is not None:
        return list(found.values())
    return list(cache.group_cache_managers)


class _TrackedCache:
    """Counts the requests holding blocks (live) and their peak, for the engine's BF16 cache and
    the foscar one alike."""

    def _track_init(self) -> None:
        self.live_request_ids: set = set()
        self.peak_requests = 0

    def extend_read_and_write_indices(self, request_id, past_length, query_length, *args, **kw):
        self.live_request_ids.add(request_id)
        self.peak_requests = max(self.peak_requests, len(self.live_request_ids))
        return super().extend_read_and_write_indices(
            request_id, past_length, query_length, *args, **kw
        )

    def free_blocks(self, request_id, *args, **kwargs):
        self.live_request_ids.discard(request_id)
        return super().free_blocks(request_id, *args, **kwargs)


class TrackedPagedCache(_TrackedCache, PagedAttentionCache):
    """The engine's own BF16 paged cache, unchanged, with the live-request count."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._track_init()


@dataclasses.dataclass(frozen=True)
class _FoscarSettings:
    kv: ResolvedKV
    max_requests: int
    num_kv_heads: int  # the model's, before any tensor-parallel split
    backend: str
    window_dtype: torch.dtype
    cuda_graphs: bool = False
    prefix_sharing: bool = False


class _OneChannelConfig:
    """The model config as the engine's cache reads it, with one channel per head: the engine
    sizes and builds its K/V tensors from it (which foscar never uses), everything else reads
    through to the model's config."""

    def __init__(self, config) -> None:
        self._config = config
        self.head_dim = 1

    def __getattr__(self, name):
        if name == "_config":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self._config, name)


class FoscarPagedCache(_TrackedCache, PagedAttentionCache):
    """The engine's paged cache with foscar storage (module docstring). Built by the engine with
    the engine's arguments; ``settings`` come from :func:`build_manager`."""

    _settings: _FoscarSettings  # bound per manager (:meth:`bind`)

    @classmethod
    def bind(cls, settings: _FoscarSettings) -> type:
        return type(cls.__name__, (cls,), {"_settings": settings})

    def __init__(self, *args, **kwargs) -> None:
        settings = self._settings
        config = kwargs.get("config", args[0] if args else None)
        if "config" in kwargs:
            kwargs["config"] = _OneChannelConfig(config)
        else:
            args = (_OneChannelConfig(config), *args[1:])
        super().__init__(*args, **kwargs)
        self._track_init()
        allocators = _allocators(self)
        if len(allocators) != 1:
            raise ValueError(
                "foscar serves full-attention models only; this model mixes attention types"
            )
        self._allocator = allocators[0]
        # the engine's K/V heads on this process (its share under tensor parallelism)
        local_heads = getattr(self, "num_key_value_heads", None)
        if local_heads is None:
            local_heads = self._allocator.num_key_value_heads
        block_size = self._allocator_block_size()
        kv = settings.kv
        rotations = kv.rotations
        tp = settings.num_kv_heads // local_heads
        if rotations is not None and tp > 1:
            helper = kwargs.get("distributed_helper")
            rotations = rank_rotations(
                rotations,
                rank=helper.tp_local_rank,
                tp_size=tp,
                num_kv_heads=settings.num_kv_heads,
            )
        self.paged = PagedKV(
            kv.formats,
            num_layers=len(kv.formats),
            num_kv_heads=local_heads,
            head_dim=head_dim_of(config),
            num_blocks=self._physical_blocks(),
            block_size=block_size,
            max_requests=settings.max_requests,
            device=self.device,
            rotations=rotations,
            clip_bits=kv.clip_bits,
            backend=settings.backend,
            window_dtype=settings.window_dtype,
            # a step's packed tokens, padding included, never exceed the engine's batch budget
            max_step_tokens=getattr(self, "max_batch_tokens", None),
            cuda_graphs=settings.cuda_graphs,
        ) if kv.flashinfer is None else _flashinfer_storage(settings, config, local_heads, self,
                                                             block_size)
        self._slots: set = set()  # requests admitted: each holds a window slot
        #: the slots reserved for the children of a request not forked yet
        self._reserved: dict = {}
        #: (request, slots it needs): the oldest request with children refused for slots
        self._slot_waiter: tuple | None = None
        self._scheduler = None  # watch_scheduler
        #: prefix sharing: the prompt of each request admitted since, to find a donor by
        self._prompts: dict = {}
        #: tokens requests started on by adopting another's pages (prefix sharing)
        self.shared_tokens = 0
        if settings.prefix_sharing:
            ledger = getattr(self._allocator, "ledger", None)
            if kv.flashinfer is not None or not hasattr(ledger, "acquire") or not isinstance(
                getattr(self._allocator, "block_table", None), dict
            ):
                raise ValueError(
                    "prefix_sharing=True needs a foscar kv and transformers' block ledger "
                    "(the engine of transformers 5.25 has it)"
                )
            # the scheduler asks search_prefix_match for new requests; the engine's own block
            # hashing stays off (allow_block_sharing=False): foscar picks what is shared
            self.use_prefix_sharing = True
        self._rows: list[StepRow] | None = None  # the next forward's layout, in batch order
        #: (parent, children, pages they share) forked in the engine's blocks, their storage not
        #: yet copied
        self._pending_forks: list[tuple] = []
        #: steps run through a CUDA graph (captured, or replayed)
        self.graph_steps = 0

    # ------------------------------------------------------------------ engine geometry
    def _allocator_block_size(self) -> int:
        return getattr(self._allocator, "tokens_per_page", None) or self.block_size

    def _physical_blocks(self) -> int:
        """Blocks of the engine's K/V storage, trash blocks included: more than any block id."""
        tensor = getattr(self, "cache_tensor", None)
        if tensor is not None:
            return tensor.numel() // self._allocator.bytes_per_block
        return self.key_cache[0].shape[0] // self.block_size

    def _block_ids(self, request_id) -> tuple[int, ...]:
        return tuple(self._allocator.block_table.get(request_id, ()))

    # ------------------------------------------------------------------ admission and release
    # A request is admitted while a window slot is free for it, and, until it forks, for each of
    # its children (the engine forks it once its prompt is prefilled: without a reserved slot a
    # child would be prefilled again on its own whenever the slots are full).
    def watch_scheduler(self, scheduler) -> None:
        """The engine's scheduler of this cache's loop: the requests' states (their children)."""
        self._scheduler = scheduler

    def _children(self, request_id, state=None) -> list:
        """The children of ``request_id`` that take a slot with it: those it will fork into
        (none once it has forked), as many as the slots beside its own."""
        if state is None and self._scheduler is not None:
            state = self._scheduler.active_requests.get(request_id) or \
                self._scheduler.waiting_requests.get(request_id)
        count = min(getattr(state, "num_children", 0) or 0, self.paged.max_requests - 1)
        return child_request_ids(request_id, count)

    def _has_slot(self, request_id, state=None, *, dry_run: bool = False) -> bool:
        """Whether ``request_id`` may be admitted: it holds a slot, or slots are free for it and
        its children. The oldest request with children that found too few free slots goes
        first: newer ones are admitted only beside the slots it waits for (else, as slots free
        one by one, single requests behind it would take each and it would never start)."""
        if request_id in self._slots:
            return True
        wanted = 1 + sum(c not in self._slots for c in self._children(request_id, state))
        free = self.paged.max_requests - len(self._slots)
        waiter = self._slot_waiter
        if waiter is not None and waiter[0] != request_id:
            return wanted + waiter[1] <= free
        if wanted > free and wanted > 1 and not dry_run:
            self._slot_waiter = (request_id, wanted)
        return wanted <= free

    def _take_slot(self, request_id, state=None) -> None:
        if self._slot_waiter is not None and self._slot_waiter[0] == request_id:
            self._slot_waiter = None
        if request_id not in self._slots:
            self._slots.add(request_id)
            children = [c for c in self._children(request_id, state) if c not in self._slots]
            if children:
                self._slots.update(children)
                self._reserved[request_id] = children

    def can_store_request_tokens(self, state, request_len, *args, **kwargs) -> bool:
        dry_run = kwargs.get("dry_run", args[0] if args else False)
        if not self._has_slot(state.request_id, state, dry_run=dry_run):
            return False
        ok = super().can_store_request_tokens(state, request_len, *args, **kwargs)
        if ok and not dry_run:
            self._take_slot(state.request_id, state)
        return ok

    def allocate_blocks(self, n_blocks, request_id, *args, **kwargs):
        if not self._has_slot(request_id):
            return None
        allocated = super().allocate_blocks(n_blocks, request_id, *args, **kwargs)
        if allocated is not None:
            self._take_slot(request_id)
        return allocated

    def free_blocks(self, request_id, *args, **kwargs):
        if self._slot_waiter is not None and self._slot_waiter[0] == request_id:
            self._slot_waiter = None  # cancelled while it waited for slots
        self._slots.discard(request_id)
        # a request that ends (or is preempted) before it forks gives its children's slots back
        self._slots.difference_update(self._reserved.pop(request_id, ()))
        self._prompts.pop(request_id, None)
        self.paged.release(request_id)
        return super().free_blocks(request_id, *args, **kwargs)

    def free_all_requests(self, *args, **kwargs):
        result = super().free_all_requests(*args, **kwargs)
        self._rows = None
        self._pending_forks = []
        self._slots.clear()
        self._reserved.clear()
        self._slot_waiter = None
        self._prompts.clear()
        self.live_request_ids.clear()
        self.paged.release_all()
        return result

    def search_prefix_match(self, request_id, prompt_ids) -> int:
        """Prefix sharing: start a new request on the full quantized pages of the live request
        whose prompt shares the longest prefix with ``prompt_ids``
        (:meth:`PagedKV.adopt_prefix`); returns the tokens it holds then (0: none). The shared
        blocks head the request's block table and count one more holder in the engine's
        ledger, as foscar's pages do."""
        if not self._settings.prefix_sharing or not self._has_slot(request_id):
            return 0
        prompt = list(prompt_ids)
        self._prompts[request_id] = prompt
        donor, common = None, 0
        for rid in self.paged.live_requests:
            other = self._prompts.get(rid)
            if other is not None and rid != request_id:
                n = len(os.path.commonprefix([prompt, other]))
                if n > common:
                    donor, common = rid, n
        if donor is None:
            return 0
        # the engine needs one prompt token left to prefill, and a request it forks two (it forks
        # once all but the last are prefilled)
        length = self.paged.adopt_prefix(request_id, donor, min(common, len(prompt) - 2),
                                         len(prompt))
        if length:
            pages = self.paged.cache.pages_of(request_id)
            self._allocator.block_table[request_id] = list(pages)
            for block in pages:
                self._allocator.ledger.acquire(block)
            self._take_slot(request_id)
            self.shared_tokens += length
        return length

    # ------------------------------------------------------------------ forks
    # The engine forks a request with children once its prompt but the last token is prefilled
    # (parallel samples of one prompt): its block accounting gives each child fresh blocks, as
    # many as the parent holds (foscar turns the engine's block sharing off), then it copies the
    # blocks on its compute stream. There, foscar copies the parent's storage into the child's
    # blocks instead (the engine's K/V tensors are one channel wide and never read).
    def _fork_room(self, parent_id) -> int:
        """How many children of ``parent_id`` have a window slot, the first ones in order:
        those reserved at its admission, then free ones. The reservation ends here: the engine
        forks them or queues them as requests of their own (which keep the reserved slots)."""
        reserved = self._reserved.pop(parent_id, ())
        return len(reserved) + max(0, self.paged.max_requests - len(self._slots))

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst):
        """transformers 5.25: fork ``src_state`` into as many of ``dst_req_ids`` as the blocks
        and window slots hold; returns those ids (the engine prefills the others). Their storage
        is copied in :meth:`perform_cache_copy`."""
        parent = src_state.request_id
        ids = list(dst_req_ids)[: self._fork_room(parent)]
        shared = self._shared_fork_pages(parent)
        if shared:
            # the engine's block sharing is off (foscar picks what is shared): for this fork its
            # allocator shares the parent's full quantized pages, counted in its ledger
            self._allocator.count_shareable_blocks = lambda *args: shared
        try:
            forked = super().prepare_fork_request(src_state, ids, copy_src_and_dst)
        finally:
            vars(self._allocator).pop("count_shareable_blocks", None)
        self._take_fork(parent, forked, shared)
        return forked

    def _shared_fork_pages(self, parent_id) -> int:
        """Pages a fork of ``parent_id`` shares: with prefix sharing, its full quantized pages
        (:meth:`PagedKV.shareable_pages`); otherwise none (each child holds copies)."""
        if not self._settings.prefix_sharing or not isinstance(self.paged, PagedKV):
            return 0
        return self.paged.shareable_pages(parent_id)

    def perform_cache_copy(self, copy_src_and_dst) -> None:
        """transformers 5.25, on the engine's compute stream: the forks' storage."""
        self._run_forks()

    def compute_max_num_forks(self, source_request_id) -> int:
        """transformers 5.17: the children the blocks and the window slots hold (the engine
        forks the first ones, in order)."""
        return min(super().compute_max_num_forks(source_request_id),
                   self._fork_room(source_request_id))

    def fork_request(self, source_request_id, destination_request_ids):
        """transformers 5.17: fork the request's blocks; its storage is copied in
        :meth:`copy_cache`."""
        copies = super().fork_request(source_request_id, destination_request_ids)
        self._take_fork(source_request_id, destination_request_ids, 0)
        return copies

    def copy_cache(self, source_blocks, forked_blocks) -> None:
        """transformers 5.17, on the engine's compute stream: the forks' storage."""
        self._run_forks()

    def _take_fork(self, parent_id, children, shared: int) -> None:
        """Children that now hold blocks (the first ``shared`` the parent's) and a window slot;
        their storage is copied next. Reserved children left out (the blocks did not hold them)
        keep their slots: the engine prefills them as requests of their own."""
        self._slots.update(children)
        self._pending_forks.append((parent_id, list(children), shared))

    def _run_forks(self) -> None:
        pending, self._pending_forks = self._pending_forks, []
        for parent_id, children, shared in pending:
            source = list(self._block_ids(parent_id))
            for child in children:
                blocks = list(self._block_ids(child))
                if isinstance(self.paged, FlashInferPagedKV):
                    self.paged.fork(parent_id, child, source, blocks)
                else:
                    self.paged.fork(parent_id, child, blocks, shared)
                if parent_id in self._prompts:
                    self._prompts[child] = self._prompts[parent_id]

    # ------------------------------------------------------------------ a step
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index,
                                      write_index):
        if self._rows is None:
            self._rows = []
        self._rows.append(
            StepRow(request_id, past_length, query_length, self._block_ids(request_id))
        )
        # no read indices: foscar attends from its own pages, and the engine would list one
        # per context token of every row, in Python, at every step
        return super().extend_read_and_write_indices(
            request_id, past_length, query_length, None, write_index
        )

    def update(self, key_states, value_states, *args, **kwargs):
        # transformers >= 5.24's model calls this before the attention function; the attention
        # function writes (it sees the queries too)
        attach(key_states, self)
        return key_states, value_states

    def begin_step(self, num_tokens: int) -> None:
        """Start the step whose rows the engine named (``extend_read_and_write_indices``) for a
        forward of ``num_tokens`` packed tokens: the manager calls it before each forward, outside
        what a CUDA graph captures."""
        self._run_forks()  # (an engine that forked without copying)
        if self._rows is not None:
            rows, self._rows = self._rows, None
            self.paged.begin_step(rows, num_tokens=num_tokens)

    def attend(self, module, query, key, value, scaling) -> torch.Tensor:
        self.begin_step(query.shape[2])  # (a forward the manager did not announce)
        out = self.paged.attend(
            module.layer_idx,
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            scaling=scaling,
            prefill_attention=partial(_prefill, module),
        )
        return out.unsqueeze(0)


def _flashinfer_storage(settings: _FoscarSettings, config, local_heads: int, cache,
                        block_size: int) -> FlashInferPagedKV:
    """The FlashInfer cache (:mod:`foscar.serving.flashinfer_kv`) in place of foscar's pool:
    the engine's block ids are its pages; backend ``"reference"`` attends in torch."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tp = settings.num_kv_heads // local_heads
    return FlashInferPagedKV(
        settings.kv.flashinfer,
        num_layers=text.num_hidden_layers,
        num_kv_heads=local_heads,
        num_q_heads=text.num_attention_heads // tp,
        head_dim=head_dim_of(text),
        num_blocks=cache._physical_blocks(),
        block_size=block_size,
        device=cache.device,
        attention="torch" if settings.backend == "reference" else "flashinfer",
        max_step_tokens=getattr(cache, "max_batch_tokens", None),
        cuda_graphs=settings.cuda_graphs,
    )


_ENGINE_CACHE_LOCK = threading.Lock()


@contextlib.contextmanager
def _engine_cache_class(cls: type):
    """Have the engine build ``cls`` where it builds its ``PagedAttentionCache``."""
    with _ENGINE_CACHE_LOCK:
        saved = continuous_api.PagedAttentionCache
        continuous_api.PagedAttentionCache = cls
        try:
            yield
        finally:
            continuous_api.PagedAttentionCache = saved


def _hook_model_runner(runner, cache: FoscarPagedCache) -> None:
    """Have the engine's model runner start each step of ``cache`` before its forward (and
    before any CUDA graph replay), on the stream the forward runs on, and capture or replay a
    graph only for the steps foscar can capture (decode-only ones; others run eagerly)."""
    if getattr(runner, "_foscar_cache", None) is cache:
        return  # a batch processor the engine reuses
    compute_batch = getattr(runner, "compute_batch", None)
    get_forward_fn = getattr(runner, "_get_forward_fn", None)
    if compute_batch is None or get_forward_fn is None:
        # (transformers 5.17 and 5.25 have both) without them a step starts at its first
        # attention call, inside the forward: eager steps only
        if cache.paged.cuda_graphs:
            raise RuntimeError(
                "cuda_graphs=True: this transformers' model runner has no compute_batch and "
                "_get_forward_fn to start a foscar step before a captured forward"
            )
        return

    def foscar_compute_batch(model, batch_data, *args, **kwargs):
        stream = getattr(runner.inputs_and_outputs, "compute_stream", None)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            cache.begin_step(batch_data["input_ids"].shape[-1])
        runner._foscar_graphed = False
        out = compute_batch(model, batch_data, *args, **kwargs)
        # a replayed graph wrote every layer without running write_decode_step's host code (a
        # forward that raised leaves its step unwritten: the next is refused, as it must be)
        cache.paged.end_step(graphed=runner._foscar_graphed)
        return out

    def foscar_get_forward_fn(*args, **kwargs):
        forward_fn, use_cuda_graph = get_forward_fn(*args, **kwargs)
        use_cuda_graph = bool(use_cuda_graph) and cache.paged.step_capturable
        cache.graph_steps += use_cuda_graph
        runner._foscar_graphed = use_cuda_graph
        return forward_fn, use_cuda_graph

    runner.compute_batch = foscar_compute_batch
    runner._get_forward_fn = foscar_get_forward_fn
    runner._foscar_cache = cache


# ---------------------------------------------------------------------------- manager
class _ChildrenQueue(queue.Queue):
    """The engine's queue of new requests; a request put in it takes the children that
    :meth:`FoscarBatchingManager.add_request` was asked for (the engine's ``add_request`` sets
    the manager-wide ``num_return_sequences - 1``)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        #: request id -> its children, while its add_request runs
        self.children: dict[str, int] = {}

    def put(self, item, *args, **kwargs) -> None:
        children = self.children.get(getattr(item, "request_id", None))
        if children is not None:
            item.num_children = children
        super().put(item, *args, **kwargs)


class FoscarBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` with a foscar (or the engine's BF16) cache.

    Built by :func:`build_manager`; the API is the engine's (``start``, ``stop``,
    ``add_request``, ``request_id_iter``, ``cancel_request``, ``get_result``), plus
    :meth:`kv_stats`, and :meth:`add_request` refuses a request the pool can never hold.
    """

    def __init__(self, model, generation_config, continuous_batching_config, *, plan: PoolSizes,
                 backend: str = "auto", window_dtype: torch.dtype = torch.bfloat16,
                 cuda_graphs: bool = False, prefix_sharing: bool = False) -> None:
        self._plan = plan
        self._last_cache = None
        self._foscar_backend = backend
        super().__init__(model, generation_config, continuous_batching_config)
        self.input_queue = _ChildrenQueue(self.input_queue.maxsize)
        kv = plan.kv
        if kv.is_bf16:
            self._cache_class = TrackedPagedCache
        else:
            text = model.config.get_text_config()
            self._cache_class = FoscarPagedCache.bind(
                _FoscarSettings(
                    kv, plan.max_requests, num_kv_heads_of(text), backend, window_dtype,
                    cuda_graphs, prefix_sharing,
                )
            )

    # ------------------------------------------------------------------ engine hooks
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs) -> None:
        # the engine switches at construction; a foscar manager switches at start() (and the
        # engine's stop() switches back), so that one built and never started leaves the model
        # as it was
        if self._plan.kv.is_bf16:
            return super().switch_to_cb_friendly_attn(model, *args, **kwargs)

    def start(self) -> None:
        if not self._plan.kv.is_bf16 and not self.is_running():
            original = self.model.config._attn_implementation
            if original != ATTENTION_NAME:
                register()
                self.model.set_attn_implementation(ATTENTION_NAME)
                self._original_attn_impl = original
        super().start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the generation loop ends. Under tensor parallelism every process builds
        the manager and calls :meth:`start`; process 0 (the engine's driver) adds requests and
        reads results, the others call this: the driver's :meth:`stop` ends every loop."""
        thread = self._generation_thread
        if thread is not None:
            thread.join(timeout)

    def _create_batch_processor(self):
        with _engine_cache_class(self._cache_class):
            processor = super()._create_batch_processor()
        self._last_cache = processor.cache
        if isinstance(processor.cache, FoscarPagedCache):
            _hook_model_runner(processor.model_runner, processor.cache)
            processor.cache.watch_scheduler(processor.scheduler)
        return processor

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise ``ValueError`` (with what fits) unless a request of ``prompt_tokens`` plus
        ``max_new_tokens`` can ever be held by the pool."""
        need = prompt_tokens + max_new_tokens
        plan = self._plan
        capacity = plan.num_blocks * plan.block_size
        if prompt_tokens < 1:
            raise ValueError("input_ids must hold at least one token")
        if need > capacity:
            raise ValueError(
                f"the request needs {need} tokens ({prompt_tokens} prompt + {max_new_tokens} new) "
                f"but the KV cache holds at most {capacity} ({plan.num_blocks} blocks of "
                f"{plan.block_size}); shorten the prompt or max_new_tokens, or give the cache "
                "more memory"
            )
        if plan.max_position is not None and need > plan.max_position:
            raise ValueError(
                f"the request needs {need} tokens ({prompt_tokens} prompt + {max_new_tokens} new) "
                f"but the model takes at most {plan.max_position} positions"
            )

    def add_request(self, input_ids, request_id=None, max_new_tokens=None, *args,
                    num_children: int | None = None, **kwargs):
        """The engine's ``add_request``; raises ``ValueError`` first for a request the pool can
        never hold (prompt plus ``max_new_tokens`` over the cache's tokens or the model's
        positions). ``num_children``: this request's forks in place of the manager-wide
        ``num_return_sequences - 1`` (parallel samples of its prompt, prefilled once; child
        ``i``'s outputs come as :func:`foscar.serving.sampling.child_request_id`, so no
        ``request_id`` may end as those do)."""
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.reshape(-1).tolist()
        new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.check_request(len(input_ids), new)
        if isinstance(request_id, str) and is_child_request_id(request_id):
            raise ValueError(f"request_id {request_id!r} ends as the engine names a forked "
                             "request's children (<request_id>__child#<i>); choose another")
        if num_children is None:
            num_children = max(0, (getattr(self, "num_return_sequences", 1) or 1) - 1)
        if isinstance(num_children, bool) or not isinstance(num_children, int) or \
                num_children < 0:
            raise ValueError(f"num_children must be an int >= 0, got {num_children!r}")
        if num_children and request_id is None:
            request_id = f"req_{uuid.uuid4().hex}"  # its children are named after it
        # the engine forks once all of a prompt but its last token is prefilled, which a
        # one-token prompt does not have: its children are requests of their own, named (and so
        # seeded) as forks are
        alone = num_children if len(input_ids) < 2 else 0
        children = self.input_queue.children
        ids = [request_id, *child_request_ids(request_id, alone)]
        for i, rid in enumerate(ids):
            children[rid] = num_children - alone if i == 0 else 0
        try:
            accepted = super().add_request(input_ids, request_id, max_new_tokens, *args,
                                           **kwargs)
            for rid in ids[1:] if accepted is not None else ():
                super().add_request(input_ids, rid, max_new_tokens, *args, **kwargs)
            return accepted
        finally:
            for rid in ids:
                children.pop(rid, None)

    # ------------------------------------------------------------------ accounting
    @property
    def pool_sizes(self) -> PoolSizes:
        """The sizes :func:`build_manager` chose for the pool (read-only)."""
        return self._plan

    def attention_description(self) -> str:
        """What attends the cache: the engine's own path (its attention implementation), foscar's
        decode kernels, or FlashInfer's wrappers (:mod:`foscar.serving.flashinfer_kv`)."""
        kv = self._plan.kv
        if kv.flashinfer is not None:
            return attention_description(
                kv.flashinfer, "torch" if self._foscar_backend == "reference" else "flashinfer")
        if kv.is_bf16:
            impl = getattr(self.model.config, "_attn_implementation", None)
            return f"the engine's BF16 paged cache, its {impl} attention"
        return (f"foscar {kv.label} pages, foscar.decode_attention (backend "
                f"{self._foscar_backend}) for decode rows, torch SDPA for prefill rows")

    def concurrent_requests(self, request_tokens: int) -> dict:
        """Requests of ``request_tokens`` tokens the pool holds at once, and a BF16 cache in the
        same memory: ``{"kv": n, "bf16": m}`` (the engine's accounting: a request holds a block
        for every ``block_size`` of its tokens, and for foscar a window slot)."""
        plan = self._plan
        blocks = math.ceil(request_tokens / plan.block_size)
        fit = plan.num_blocks // blocks
        if plan.max_requests is not None:
            fit = min(fit, plan.max_requests)
        bf16_blocks = plan.memory_bytes // (plan.bf16_bytes_per_token * plan.block_size)
        return {"kv": fit, "bf16": bf16_blocks // blocks}

    @property
    def cache(self):
        """The engine's cache of the running (or last) loop, or None before :meth:`start`."""
        return self._last_cache

    def kv_stats(self) -> dict:
        """Sizes of the KV cache (per process).

        ``num_blocks``, ``block_size``: the engine's blocks; ``max_tokens``: tokens they hold;
        ``bytes_per_token``: stored bytes of one token over all layers (for foscar, of a token
        in the quantized history; the BF16 windows are ``window_bytes`` per request, 0 for
        the engine's cache);
        ``memory_bytes``: the pool (and windows); ``bf16_equivalent_tokens``: tokens a BF16
        cache holds in ``memory_bytes``; ``max_requests``: window slots (foscar);
        ``peak_concurrent_requests``: most requests holding blocks at once so far; foscar:
        ``peak_pages``, the most pool pages held at once (a shared page counts once), and
        ``shared_tokens``, the prompt tokens requests started on from another's pages, and
        ``forks``, the requests started as a copy of another (parallel samples).
        """
        plan = self._plan
        cache = self.cache
        stats = {
            "kv": plan.kv.label,
            "num_blocks": plan.num_blocks,
            "block_size": plan.block_size,
            "bytes_per_token": plan.bytes_per_token,
            "max_tokens": plan.num_blocks * plan.block_size,
            "memory_bytes": plan.memory_bytes,
            "bf16_equivalent_tokens": plan.memory_bytes // plan.bf16_bytes_per_token,
            "max_requests": plan.max_requests,
            "window_bytes": plan.window_bytes,
            "peak_concurrent_requests": 0 if cache is None else cache.peak_requests,
            "attention": self.attention_description(),
        }
        if isinstance(cache, FoscarPagedCache):
            stats["memory_bytes"] = cache.paged.pool_bytes()
            stats["bf16_equivalent_tokens"] = stats["memory_bytes"] // plan.bf16_bytes_per_token
            stats["restarts"] = len(cache.paged.restarts)
            stats["peak_pages"] = cache.paged.peak_pages
            stats["shared_tokens"] = cache.shared_tokens
            stats["forks"] = cache.paged.forks
        return stats


def _config_fields(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def build_manager(
    model,
    kv,
    *,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    block_size: int | None = None,
    max_batch_tokens: int | None = None,
    max_new_tokens: int = 128,
    cuda_graphs: bool | None = None,
    max_requests: int | None = None,
    request_tokens: int | None = None,
    backend: str = "auto",
    scheduler: str = "fifo",
    window_dtype: torch.dtype = torch.bfloat16,
    prefix_sharing: bool = False,
    **generation_kwargs,
) -> FoscarBatchingManager:
    """A continuous-batching manager serving ``model`` with the KV cache ``kv``.

    Parameters
    ----------
    model : a transformers causal LM (full attention in every layer for foscar caches)
    kv : ``"bf16"``, ``"int4"``, ``"int2"``, a KVFormat, a list of one per layer, or the path
        of an OSCAR calibration file (:mod:`foscar.serving.kv_spec`)
    memory_bytes : int, optional
        Bytes for the cache (per process): BF16 blocks, or foscar pages plus the window slots.
    num_blocks : int, optional
        Engine blocks instead of a byte budget (then ``memory_bytes`` is what they cost).
        Without either: 256 MiB on a CPU, half the free memory on a GPU.
    block_size : int, optional
        Tokens per block (default 64; a power of two from 16 to 256 for foscar).
    max_batch_tokens : int, optional
        Tokens per forward pass (new prompts are cut into chunks of it); the engine's default
        if None.
    max_new_tokens : int
        Default tokens to generate per request.
    cuda_graphs : bool, optional
        The engine's CUDA graphs (None: the engine decides for BF16, off for foscar caches).
        For a foscar cache, True captures each decode-only step's forward once per padded
        token count and replays it (steps with prefill rows run eagerly); refused, naming why,
        unless the model is a bfloat16 model on a CUDA device and every layer's K and V are
        token-wise (the fused decode write) in a format the decode kernels cover.
    max_requests : int, optional
        foscar: window slots, i.e. requests holding cache at once (default: as many requests
        of ``request_tokens`` as ``memory_bytes`` holds; without ``request_tokens``, 32 or
        ``max_requests_per_batch`` when given, fewer if the windows would take over half of
        ``memory_bytes``).
    request_tokens : int, optional
        foscar: the typical tokens of a request (prompt and output) to split ``memory_bytes``
        between window slots and blocks for (:meth:`FoscarBatchingManager.concurrent_requests`).
    backend : :func:`foscar.decode_attention`'s backend.
    scheduler : the engine's scheduler (``"fifo"`` or ``"prefill_first"``).
    window_dtype : storage of foscar's sink and recent windows (BF16; float32 keeps an fp32
        model's window tokens exact).
    prefix_sharing : foscar: a new request whose prompt starts like a live request's starts on
        that request's full quantized pages before its own recent window, stored once and
        counted (:meth:`FoscarPagedCache.search_prefix_match`); BF16 caches keep the engine's
        own setting.
    generation_kwargs : GenerationConfig fields (default greedy: ``do_sample=False``), and
        ``max_requests_per_batch`` for the engine.

    Returns
    -------
    FoscarBatchingManager (not started).

    Raises ``ValueError`` for a ``kv`` that does not fit the model or sizes that hold no request.
    """
    text = model.config.get_text_config()
    resolved = resolve_kv(
        kv, num_layers=text.num_hidden_layers, head_dim=head_dim_of(text),
        num_kv_heads=num_kv_heads_of(text),
    )
    if not resolved.is_bf16:
        _check_foscar_model(text, resolved)
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    check_block_size(block_size, resolved)
    if resolved.flashinfer is not None:
        reason = _flashinfer_refusal(model, backend)
        if reason is not None:
            raise ValueError(f"kv={resolved.label!r}: {reason}")
    elif cuda_graphs and not resolved.is_bf16:
        reason = _graph_refusal(model, resolved, backend, window_dtype, block_size)
        if reason is not None:
            raise ValueError(f"cuda_graphs=True with kv={resolved.label!r}: {reason}")
    check_sizes(memory_bytes=memory_bytes, num_blocks=num_blocks,
                 max_batch_tokens=max_batch_tokens, max_requests=max_requests,
                 request_tokens=request_tokens)
    if prefix_sharing and not resolved.is_bf16:
        if resolved.flashinfer is not None:
            raise ValueError(f"prefix_sharing=True: kv={resolved.label!r} is not a foscar cache")
        if not hasattr(PagedAttentionCache, "count_new_complete_blocks"):
            raise ValueError(
                "prefix_sharing=True needs the block ledger of transformers' engine (5.25 has it; "
                f"this is {_transformers_version()})"
            )
    requests_per_batch = generation_kwargs.pop("max_requests_per_batch", None)
    plan = size_pool(
        model, resolved, memory_bytes=memory_bytes, num_blocks=num_blocks,
        block_size=block_size, max_requests=max_requests, request_tokens=request_tokens,
        requests_per_batch=requests_per_batch, window_dtype=window_dtype,
    )
    return FoscarBatchingManager(
        model,
        _generation_config(model, max_new_tokens, generation_kwargs),
        _engine_config(plan, max_batch_tokens=max_batch_tokens, scheduler=scheduler,
                       requests_per_batch=requests_per_batch, cuda_graphs=cuda_graphs),
        plan=plan, backend=backend, window_dtype=window_dtype,
        cuda_graphs=bool(cuda_graphs) and not resolved.is_bf16,
        prefix_sharing=bool(prefix_sharing) and not resolved.is_bf16,
    )


def _transformers_version() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


def _check_foscar_model(text, resolved: ResolvedKV) -> None:
    """Raise ``ValueError`` unless a foscar cache can serve the model of text config ``text``:
    full attention in every layer."""
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(text, "sliding_window", None):
        raise ValueError(
            f"kv={resolved.label!r}: foscar caches serve full-attention models only; this "
            f"model has {sorted(layer_types)} layers"
            + (f" and a sliding window of {text.sliding_window}" if text.sliding_window else "")
        )


def _generation_config(model, max_new_tokens: int, generation_kwargs: dict) -> GenerationConfig:
    """The model's generation config, greedy unless ``generation_kwargs`` say otherwise."""
    gen = model.generation_config
    gen = GenerationConfig() if gen is None else copy.deepcopy(gen)
    gen.max_new_tokens = max_new_tokens
    gen.do_sample = False
    for name, value in generation_kwargs.items():
        setattr(gen, name, value)
    if gen.eos_token_id is None:
        gen.eos_token_id = getattr(model.config.get_text_config(), "eos_token_id", None)
    return gen


def _engine_config(
    plan: PoolSizes, *, max_batch_tokens: int | None, scheduler: str,
    requests_per_batch: int | None, cuda_graphs: bool | None,
) -> ContinuousBatchingConfig:
    """The engine's config for ``plan`` (the fields this transformers version has); a foscar
    cache switches off what writes or shares the engine's own K/V."""
    fields = _config_fields(ContinuousBatchingConfig)
    cb = {
        "num_blocks": plan.num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "scheduler_type": scheduler,
        "max_requests_per_batch": requests_per_batch,
        # named page_size after 5.17 (block_size there, and deprecated after)
        ("page_size" if "page_size" in fields else "block_size"): plan.block_size,
    }
    if cuda_graphs is not None:
        cb["use_cuda_graph"] = cuda_graphs
    if not plan.kv.is_bf16:
        cb.update(
            allow_block_sharing=False,
            max_blocks_per_request=0,
            cpu_offload_space=0.0,
            use_async_batching=False,
            # captured: decode-only steps (the manager's model runner runs the others eagerly)
            use_cuda_graph=bool(cuda_graphs),
            auto_switch_to_flash=False,
        )
    return ContinuousBatchingConfig(**{k: v for k, v in cb.items() if k in fields})


def _flashinfer_refusal(model, backend: str) -> str | None:
    """Why a FlashInfer cache cannot serve ``model`` with ``backend``, or None (``"reference"``
    attends in torch on any device)."""
    if backend == "reference":
        return None
    reason = flashinfer_unavailable(model.device)
    if reason is None and model.dtype != torch.bfloat16:
        reason = f"FlashInfer's caches take bfloat16 queries; the model computes in {model.dtype}"
    return reason


def _graph_refusal(
    model, resolved: ResolvedKV, backend: str, window_dtype, block_size: int
) -> str | None:
    """Why the engine cannot capture foscar's decode steps of ``model`` in CUDA graphs, or None:
    a captured step's per-layer work must be kernel launches over device buffers, i.e. the fused
    decode write (token-wise history formats) and a decode kernel (a GPU, bfloat16 queries, a
    format the kernels cover)."""
    from ..cache import CacheLayout

    if model.device.type != "cuda":
        return f"the model is on {model.device}; CUDA graphs need it on a CUDA device"
    if backend == "reference":
        return "backend 'reference' reads the page tables on the host; pass a kernel backend"
    if model.dtype != torch.bfloat16:
        return f"the decode kernels take bfloat16 queries; the model computes in {model.dtype}"
    text = model.config.get_text_config()
    layout = CacheLayout(
        formats=tuple(resolved.formats),
        num_kv_heads=num_kv_heads_of(text) // tp_size_of(model),
        head_dim=head_dim_of(text),
        page_size=block_size,
        window_dtype=window_dtype,
        device=model.device,
    )
    return layout_graph_refusal(layout, backend, text.num_attention_heads // tp_size_of(model))


def layout_graph_refusal(layout, backend: str, num_q_heads: int) -> str | None:
    """Why decode steps over a cache of ``layout`` (a :class:`foscar.cache.CacheLayout`) with
    ``num_q_heads`` query heads cannot be captured in CUDA graphs with ``backend``, or None:
    every layer must take the fused decode write, and the decode kernel must cover the layout."""
    from .. import backends
    from ..cache import fused_write_reason

    for layer in range(len(layout.formats)):
        reason = fused_write_reason(layout, layer)
        if reason is not None:
            return (
                f"layer {layer} cannot write a decode step in one captured launch ({reason}); "
                "token-wise K and V can"
            )
    name = "triton" if backend == "auto" else backend  # ("auto" takes Triton where Gluon won't)
    kernel = backends.get(name)
    if not kernel.available(layout.device):
        return f"backend {name!r} needs {kernel.requirement}"
    reason = kernel.supports(layout, num_q_heads)
    if reason is not None:
        return f"the {name} decode kernel does not cover this cache ({reason})"
    return None
