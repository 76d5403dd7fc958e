"""The paged quantized KV cache: one pool per layer behind one page table (layout and rules in
the foscar.cache docstring)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..formats import KVFormat, QuantFormat, Role, bit_offsets, channel_order
from . import decode_step, fused_write, write
from .decode_step import DecodeStep
from .layout import check_int, layer_formats, num_quantized
from .pages import DecodeBatch, PageTable
from .transforms import LayerTransform, history_format, make_transform

__all__ = ["QuantizedKVCache"]

_ALLOWED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class QuantizedKVCache(PageTable):
    """A fixed pool of quantized KV pages for ``num_layers`` layers, with BF16 windows.

    Parameters
    ----------
    fmt : KVFormat or sequence of KVFormat
        K/V quantization, operand mapping and BF16 windows; or one format per layer, which may
        differ in K and V (e.g. INT4 keys in the layers that need them) but share the mapping,
        the windows and the demotion quantum (:func:`layer_formats`);
        ``cache.layer_format(layer)`` is a layer's.
    num_kv_heads, head_dim : int
    num_pages : int
        Pages in the pool (shared by all sequences; one page holds ``page_size`` tokens of every
        layer).
    max_seqs : int
        Sequences alive at once (rows of the BF16 window buffers).
    num_layers : int
    page_size : int
        A power of two from 16 to 256 (default 64).
    device : torch.device or str
    window_dtype : torch.dtype
        Storage of the BF16 sink/tail (default ``torch.bfloat16``).
    check_finite : bool
        Reject K/V containing NaN or Inf (default True; see the foscar.cache docstring).
    decode_write : {"auto", "fused", "torch"}
        How a decode step (one new token per sequence) is written: "fused" is one Triton launch
        per role (foscar.cache.fused_write; token-wise history formats, clipped and
        GPTQ-rounded ones included, a CUDA device or the Triton interpreter), "torch" the tensor
        operations of a prefill's path, "auto" fused wherever it applies on a CUDA device. Both
        store the same bits.

    Example
    -------
    >>> fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    >>> cache = QuantizedKVCache(fmt, num_kv_heads=8, head_dim=128, num_pages=64, max_seqs=4)
    >>> sid = cache.add_sequence()
    >>> k = v = torch.randn(300, 8, 128, dtype=torch.bfloat16)
    >>> cache.append([sid], k, v, num_new_tokens=[300])  # prefill 300 tokens into layer 0
    >>> batch = cache.plan([sid])                         # page tables for decode_attention
    >>> step = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    >>> cache.append([sid], step, step)                   # a decode step: one token each
    >>> batch = cache.plan([sid])                         # plan after each step's appends
    """

    def __init__(
        self,
        fmt: KVFormat | Sequence[KVFormat],
        *,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        max_seqs: int,
        num_layers: int = 1,
        page_size: int = 64,
        device: torch.device | str = "cpu",
        window_dtype: torch.dtype = torch.bfloat16,
        check_finite: bool = True,
        decode_write: str = "auto",
    ) -> None:
        check_int(num_pages, "num_pages", low=1)
        check_int(max_seqs, "max_seqs", low=1)
        formats = self.check_layout(
            fmt,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            page_size=page_size,
        )
        if window_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise TypeError(f"window_dtype must be a floating dtype, got {window_dtype}")
        write.check_decode_write(decode_write)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # "cuda" and "cuda:0" must compare equal to the tensors' devices
            device = torch.device("cuda", torch.cuda.current_device())
        # the mapping and windows every layer shares (``layer_formats``) set the page table
        super().__init__(
            num_pages=num_pages,
            max_seqs=max_seqs,
            num_layers=num_layers,
            page_size=page_size,
            windows=formats[0],
            device=device,
        )
        #: one KVFormat per layer (all the same unless ``fmt`` gave one per layer)
        self.formats = formats
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window_dtype = window_dtype
        self.check_finite = check_finite
        self.decode_write = decode_write
        #: the fused decode write's memo and, once it failed under "auto", why
        self.fused_write_state = write.FusedWriteState()
        self._fused_reasons: list = [None] * num_layers  # per layer: (reason or None,) once known
        self._step_buffer: decode_step.StepBuffer | None = None  # planned steps' device storage
        self._latest_step: decode_step.DecodeStep | None = None
        self.layers = [write.allocate_layer(self, f) for f in formats]
        self.transforms = [LayerTransform() for _ in range(num_layers)]
        if decode_write == "fused":
            self._fused_write(0)  # raises if the fused write cannot serve this cache

    @staticmethod
    def check_layout(
        fmt: KVFormat | Sequence[KVFormat],
        *,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        page_size: int = 64,
    ) -> tuple[KVFormat, ...]:
        """Raise as the constructor does unless a cache of ``fmt`` (one format, or one per
        layer) can hold ``num_layers`` layers of ``num_kv_heads`` heads of ``head_dim`` in pages
        of ``page_size`` tokens; returns the format of each layer. Allocates nothing: callers
        that build the cache later (``FoscarCache``) check their arguments with it up front."""
        check_int(num_kv_heads, "num_kv_heads", low=1)
        check_int(head_dim, "head_dim", low=1)
        check_int(num_layers, "num_layers", low=1)
        check_int(page_size, "page_size", low=1)
        if page_size < 16 or page_size > 256 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two from 16 to 256, got {page_size}")
        formats = layer_formats(fmt, num_layers)
        if isinstance(fmt, KVFormat):
            fmt.check_head_dim(head_dim)
        else:
            for i, f in enumerate(formats):
                try:
                    f.check_head_dim(head_dim)
                except ValueError as e:
                    raise ValueError(f"fmt[{i}]: {e}") from None
        return formats

    # ------------------------------------------------------------------ formats
    @property
    def fmt(self) -> KVFormat:
        """The format of every layer; a cache built with one format per layer that differ has
        none (ask :meth:`layer_format`)."""
        if self.mixed_formats:
            raise ValueError(
                "this cache's layers have different formats (cache.formats); ask "
                "cache.layer_format(layer)"
            )
        return self.windows

    @property
    def mixed_formats(self) -> bool:
        """Whether the layers' formats differ."""
        return any(f != self.windows for f in self.formats)

    def layer_format(self, layer: int) -> KVFormat:
        """The KVFormat of ``layer`` (the cache's format unless it was given one per layer)."""
        return self.formats[self._check_layer(layer)]

    def role_format(self, layer: int, name: str) -> QuantFormat:
        """The QuantFormat of ``"k"`` or ``"v"`` in ``layer``, before the layer's own clip."""
        if name not in ("k", "v"):
            raise ValueError(f"name must be 'k' or 'v', got {name!r}")
        f = self.formats[self._check_layer(layer)]
        return f.key if name == "k" else f.value

    def stored_format(self, layer: int, name: str) -> QuantFormat:
        """:meth:`role_format` with the layer's clip ratio, if its transform sets one."""
        return history_format(self.transforms[layer], self.role_format(layer, name), name)

    # ------------------------------------------------------------------ storage
    def scale_entries_per_page(self, f: QuantFormat) -> int:
        return self.page_size * self.head_dim // f.group_size

    def channel_order(self, name: str, layer: int = 0) -> torch.Tensor:
        """Channel order of the packed rows of ``"k"`` or ``"v"`` in ``layer``
        (foscar.formats; it depends on the role and its width)."""
        bits = self.role_format(layer, name).bits
        orders = self.__dict__.setdefault("_channel_orders", {})
        if (name, bits) not in orders:  # kept on the cache's device: packing then copies nothing
            role = Role.KEY if name == "k" else Role.VALUE
            order = channel_order(role, bits, self.head_dim, self.windows.mapping)
            orders[(name, bits)] = order.to(self.device)
        return orders[(name, bits)]

    def packing_tables(self, name: str, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(order [D], bit offsets [32 // bits])`` int32 on the device, for the fused write."""
        bits = self.role_format(layer, name).bits
        tables = self.__dict__.setdefault("_packing_tables", {})
        if (name, bits) not in tables:
            order = self.channel_order(name, layer).to(torch.int32)
            shifts = bit_offsets(bits, self.windows.mapping, self.device).to(torch.int32)
            tables[(name, bits)] = (order, shifts)
        return tables[(name, bits)]

    def check_query(self, q: torch.Tensor, batch: DecodeBatch) -> int:
        """Raise unless ``q`` is ``[batch.batch_size, num_q_heads, head_dim]`` with
        ``num_q_heads`` a multiple of the cache's KV heads; returns the query heads per KV
        head."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 3 or q.shape[0] != batch.batch_size or q.shape[2] != self.head_dim:
            raise ValueError(
                f"q must have shape [batch={batch.batch_size}, num_q_heads, head_dim="
                f"{self.head_dim}], got {list(q.shape)}"
            )
        if q.shape[1] % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        return q.shape[1] // self.num_kv_heads

    def fused_write_reason(self, layer: int = 0) -> str | None:
        """``None`` if a decode step of ``layer`` can take the fused write, else why not."""
        return fused_write.fused_write_reason(self, layer)

    def _fused_write(self, layer: int) -> bool:
        """Whether a decode step of ``layer`` takes the fused write; raises (before any write)
        where ``decode_write="fused"`` cannot."""
        failed = self.fused_write_state.failure is not None
        if self.decode_write == "torch" or (
            self.decode_write == "auto" and (self.device.type != "cuda" or failed)
        ):
            return False
        known = self._fused_reasons[layer]
        if known is None:  # the reason depends on the layer's format and transform only
            known = self._fused_reasons[layer] = (self.fused_write_reason(layer),)
        reason = known[0]
        if reason is not None and self.decode_write == "fused":
            raise ValueError(f"decode_write='fused' cannot write this cache: {reason}")
        return reason is None

    # ------------------------------------------------------------------ OSCAR transforms
    def set_transform(
        self,
        layer: int,
        *,
        key_rotation: torch.Tensor | None = None,
        value_rotation: torch.Tensor | None = None,
        key_clip: float | None = None,
        value_clip: float | None = None,
        key_gptq: torch.Tensor | None = None,
    ) -> None:
        """Rotate and/or re-clip what ``layer`` stores (OSCAR, oscar.md Sec. 2-3).

        Parameters
        ----------
        key_rotation, value_rotation : ``[D, D]`` or ``[1, D, D]`` (shared by the KV heads) or
            ``[H, D, D]``
            orthogonal matrices, or None for none. Appended tokens are stored as ``k R_K`` and
            ``v R_V`` (rows; every segment), :func:`foscar.decode_attention` rotates queries by
            ``R_K`` and the output by ``R_V^T``, and
            :func:`foscar.cache.read.dequantize_sequence` returns the model's coordinates.
        key_clip, value_clip : per-token clip ratio in ``(0, 1]`` of this layer's quantized K / V
            (replacing the format's; 1 clips nothing), or None for the format's.
        key_gptq : ``[D, D]`` or ``[H, D, D]`` upper-triangular factor with a positive diagonal
            (:func:`foscar.quantize.gptq_factor` of the keys' metric in the stored basis): the
            keys' codes are chosen by GPTQ's rounding (:func:`foscar.quantize.quantize_gptq`)
            instead of to nearest; token-wise keys only. The stored format, the decode kernels
            and the reference are unchanged; the fused decode-step write covers it.

        The layer must hold no tokens (a rotation cannot apply to tokens stored before it).
        Each call replaces the layer's whole transform.
        """
        layer = self._check_layer(layer)
        busy = [s for s, seq in self._seqs.items() if seq.lengths[layer]]
        if busy:
            raise ValueError(
                f"layer {layer} already stores tokens of sequences {busy}: set its transform "
                "before appending"
            )
        self.transforms[layer] = make_transform(
            self.formats[layer],
            layer,
            self.num_kv_heads,
            self.head_dim,
            self.device,
            key_rotation=key_rotation,
            value_rotation=value_rotation,
            key_clip=key_clip,
            value_clip=value_clip,
            key_gptq=key_gptq,
        )
        self._fused_reasons[layer] = None

    # ------------------------------------------------------------------ append
    def append(
        self,
        seq_ids: Sequence,
        k: torch.Tensor,
        v: torch.Tensor,
        num_new_tokens: Sequence[int] | None = None,
        *,
        layer: int = 0,
    ) -> None:
        """Append tokens to sequences of one layer: a prefill (many each) or a decode step (one).

        Parameters
        ----------
        seq_ids : live sequence ids, distinct.
        k, v : [num_tokens, num_kv_heads, head_dim], floating, on the cache's device; the tokens
            of ``seq_ids[0]`` first, then ``seq_ids[1]``'s, ... (a ragged batch).
        num_new_tokens : tokens per sequence (default: one each, a decode step); required for
            any other count, e.g. ``[300]`` to prefill 300 tokens of one sequence.
        layer : which layer's pool to write.

        Plans of the appended sequences made for ``layer`` before this call go stale
        (:meth:`plan`).
        """
        layer = self._check_layer(layer)
        seq_ids = list(seq_ids)
        seqs = [self._lookup(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if num_new_tokens is None:
            if k.dim() == 3 and k.shape[0] != len(seq_ids):
                raise ValueError(
                    f"k holds {k.shape[0]} tokens, not one per sequence ({len(seq_ids)}): "
                    "without num_new_tokens, append writes one token per sequence (a decode "
                    "step); pass num_new_tokens, the tokens of each sequence (e.g. "
                    f"num_new_tokens=[{k.shape[0]}] for one sequence)"
                )
            num_new_tokens = [1] * len(seq_ids)
        if isinstance(num_new_tokens, torch.Tensor):
            num_new_tokens = num_new_tokens.tolist()
        num_new_tokens = list(num_new_tokens)
        if len(num_new_tokens) != len(seq_ids):
            raise ValueError(
                f"num_new_tokens has {len(num_new_tokens)} entries, expected one per sequence "
                f"({len(seq_ids)})"
            )
        for i, n in enumerate(num_new_tokens):
            check_int(n, f"num_new_tokens[{i}]", low=1)
        total = sum(num_new_tokens)
        self._check_kv(k, v, total, axis="num_tokens")
        self._check_finite(k, v)
        new_lengths = [s.lengths[layer] + n for s, n in zip(seqs, num_new_tokens)]
        need = self._pages_needed(seqs, new_lengths)  # raises before anything is written
        decode_step = all(n == 1 for n in num_new_tokens)
        fused = decode_step and self._fused_write(layer)  # may raise: before any write
        tr = self.transforms[layer]
        if tr.key_rotation is not None:
            k = tr.rotate(k, "key")
        if tr.value_rotation is not None:
            v = tr.rotate(v, "value")
        # ---- nothing below can fail for a reason of the caller's
        self._take_pages(seqs, need)
        self._touch((layer,))
        if decode_step:
            write.write_decode_step(self, layer, seqs, new_lengths, k, v, fused)
        else:
            write.write_tokens(self, layer, seqs, new_lengths, num_new_tokens, k, v)
        for s, n in zip(seqs, new_lengths):
            s.lengths[layer] = n

    def _check_kv(self, k, v, rows: int, axis: str = "rows") -> None:
        """Raise unless ``k, v`` are floating ``[rows, num_kv_heads, head_dim]`` tensors on the
        cache's device (the first axis named ``axis`` in the error)."""
        shape = (rows, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _ALLOWED_INPUT_DTYPES:
                raise TypeError(
                    f"{name} must be bfloat16, float16, float32 or float64, got {t.dtype}"
                )
            if t.device != self.device:
                raise ValueError(
                    f"{name} is on {t.device}, expected the cache's device {self.device}"
                )
            if t.shape != shape:
                raise ValueError(
                    f"{name} must have shape [{axis}={rows}, num_kv_heads={shape[1]}, "
                    f"head_dim={shape[2]}], got {list(t.shape)}"
                )

    def _check_finite(self, k, v) -> None:
        """With ``check_finite``, raise if ``k`` or ``v`` holds NaN or Inf (a device sync)."""
        if self.check_finite:
            for name, t in (("k", k), ("v", v)):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name} contains NaN or Inf (the cache stores finite values)")

    # ------------------------------------------------------------------ planned decode steps
    def shareable_pages(self, donor_id, common_tokens: int, prompt_length: int) -> int:
        """History pages of live sequence ``donor_id`` a new sequence may adopt
        (:meth:`adopt_prefix`) when its first ``common_tokens`` tokens equal the donor's and its
        prompt is ``prompt_length`` tokens: the full pages inside the common tokens that the
        donor has quantized in every layer, that end before the new sequence's own recent window
        at its prompt's end, and that end on a demotion quantum (Note [shared prefixes] in
        foscar.cache.pages). 0 where none qualify."""
        donor = self._lookup(donor_id, "donor_id")
        check_int(common_tokens, "common_tokens", low=0)
        check_int(prompt_length, "prompt_length", low=0)
        fmt, ps = self.windows, self.page_size
        history = min(
            common_tokens - fmt.sink_tokens,
            num_quantized(prompt_length, fmt),
            min(donor.quantized(n, fmt) for n in donor.lengths),
        )
        pages = max(0, history // ps)
        quantum = fmt.demotion_quantum
        while pages and pages * ps % quantum:
            pages -= 1
        return min(pages, len(donor.pages))

    def adopt_prefix(self, seq_id, donor_id, num_pages: int) -> int:
        """Start empty sequence ``seq_id`` on the first ``sink_tokens + num_pages * page_size``
        tokens of live sequence ``donor_id``, equal tokens by the caller's word: the donor's
        first ``num_pages`` history pages are shared, counted, not copied (a page is freed with
        its last holder), and its BF16 sink rows are copied into ``seq_id``'s slot in every
        layer. ``num_pages`` must be at most :meth:`shareable_pages`'s count for the donor
        (pages it has quantized in every layer, ending on a demotion quantum). Returns the new
        length of ``seq_id`` in every layer; its next tokens are appended after it.

        Plans and steps of ``seq_id`` made before go stale."""
        seq = self._lookup(seq_id, "seq_id")
        donor = self._lookup(donor_id, "donor_id")
        check_int(num_pages, "num_pages", low=1)
        fmt, ps = self.windows, self.page_size
        if num_pages * ps % fmt.demotion_quantum:
            raise ValueError(
                f"num_pages * page_size must be a multiple of the demotion quantum "
                f"({fmt.demotion_quantum}), got {num_pages} * {ps}"
            )
        quantized = min(donor.quantized(n, fmt) for n in donor.lengths)
        if num_pages * ps > quantized:
            raise ValueError(
                f"num_pages must be <= {quantized // ps} (the full pages donor {donor_id!r} has "
                f"quantized in every layer), got {num_pages}"
            )
        self.share_pages(seq_id, donor_id, num_pages)  # checks seq_id is empty
        sink = fmt.sink_tokens
        if sink:
            for st in self.layers:
                st.k_sink[seq.slot] = st.k_sink[donor.slot]
                st.v_sink[seq.slot] = st.v_sink[donor.slot]
        length = sink + num_pages * ps
        seq.lengths = [length] * self.num_layers
        self._touch(range(self.num_layers))
        self._step_serial += 1
        return length

    def history_pages(self, seq_id) -> int:
        """Pages live sequence ``seq_id``'s quantized history fills, in its longest layer (the
        last one may be partly filled)."""
        seq = self._lookup(seq_id, "seq_id")
        return max(-(-seq.quantized(n, self.windows) // self.page_size) for n in seq.lengths)

    def fork(self, seq_id, parent_id, shared_pages: int = 0) -> None:
        """Have empty live sequence ``seq_id`` continue from where live sequence ``parent_id``
        stands, a copy that from now on goes its own way (parallel samples of one prompt,
        prefilled once): the parent's first ``shared_pages`` history pages are shared, counted,
        not copied (full pages it has quantized in every layer, at most
        :meth:`shareable_pages` of its own length), and the rest of its :meth:`history_pages`
        are copied into the pages ``seq_id`` holds (:meth:`add_sequence`'s ``pages``: a serving
        engine hands a fork fresh blocks), which then follow the shared ones; its BF16 sink and
        tail rows are copied into ``seq_id``'s slot, and its lengths and history floor taken
        over, in every layer. Afterwards both decode as the parent would have; neither writes a
        page the other reads. Checked before anything changes; plans of ``seq_id`` made before
        go stale."""
        seq = self._lookup(seq_id, "seq_id")
        parent = self._lookup(parent_id, "parent_id")
        if seq is parent:
            raise ValueError(f"parent_id {parent_id!r} is seq_id itself")
        if any(seq.lengths):
            raise ValueError(f"seq_id {seq_id!r} must be empty (no tokens) to fork into")
        check_int(shared_pages, "shared_pages", low=0)
        length = min(parent.lengths)
        shareable = self.shareable_pages(parent_id, length, length)
        if shared_pages > shareable:
            raise ValueError(
                f"shared_pages must be <= {shareable} (the full pages parent {parent_id!r} has "
                f"quantized in every layer), got {shared_pages}"
            )
        copied = self.history_pages(parent_id) - shared_pages
        if len(seq.pages) < copied:
            raise ValueError(
                f"seq_id {seq_id!r} holds {len(seq.pages)} pages; the fork copies {copied} "
                f"(parent {parent_id!r}'s quantized history beyond {shared_pages} shared "
                "pages): hand it at least that many"
            )
        if copied:
            src = torch.tensor(parent.pages[shared_pages:shared_pages + copied],
                               device=self.device)
            dst = torch.tensor(seq.pages[:copied], device=self.device)
        for st in self.layers:
            if copied:
                for pool in (st.k_words, st.k_scales, st.v_words, st.v_scales):
                    pool[dst] = pool[src]
            for window in (st.k_sink, st.v_sink, st.k_tail, st.v_tail):
                window[seq.slot] = window[parent.slot]
        shared = parent.pages[:shared_pages]
        self.count_holder(shared)
        seq.pages = shared + seq.pages
        seq.lengths = list(parent.lengths)
        seq.history_floor = max(parent.history_floor, shared_pages * self.page_size)
        self._touch(range(self.num_layers))
        self._step_serial += 1

    def reserve_decode_rows(self, rows: int) -> None:
        """Allocate the storage of planned decode steps (:meth:`plan_decode_step`) for up to
        ``rows`` rows (sequences plus padding) now, at an address that never changes: a CUDA
        graph captured over a step's layers keeps reading it. Without a reservation the storage
        is allocated at the first planned step and replaced by a larger one when a step needs
        more rows. Call it before any step is planned."""
        check_int(rows, "rows", low=1)
        if self._step_buffer is not None:
            raise ValueError(
                "reserve_decode_rows must come before the first plan_decode_step (graphs "
                "captured over the old storage would read a freed tensor)"
            )
        self._step_buffer = decode_step.StepBuffer(rows, self.num_pages, self.device, True)

    def plan_decode_step(
        self,
        seq_ids: Sequence,
        *,
        padding_rows: int = 0,
        split_history: int | None = None,
    ) -> DecodeStep:
        """Plan a decode step of ``seq_ids`` (one new token each) for every layer at once.

        What :meth:`append` of one token and :meth:`plan` do at each layer, done once
        (foscar.cache.decode_step): each sequence's pages are taken and its length advances by
        one in every layer, the fused write's descriptors and the step's :class:`DecodeBatch`
        go to the device in one copy, into tensors that every step of as many rows reuses.
        Then, per layer, :meth:`write_decode_step` stores the layer's new K/V and
        :func:`foscar.decode_attention` reads ``step.batches[layer]`` after that layer's write;
        every layer must be written before the next step is planned (the lengths already count
        its token; checked while the step's sequences live).

        Parameters
        ----------
        seq_ids : live sequence ids, distinct, each holding the same number of tokens in every
            layer.
        padding_rows : rows after the sequences that write nothing and read one stored token
            (a batch padded to a fixed size, e.g. for a CUDA graph; their outputs mean nothing).
        split_history : history tokens the decode kernels plan their split count for (default:
            the step's longest), e.g. the longest a sequence can hold, so that one captured
            launch serves every later step.

        Returns
        -------
        DecodeStep, valid until the next planned step, a :meth:`free`, or an :meth:`append` to
        one of its sequences in the layer being written. Raises before any
        change where :meth:`append` would (unknown or repeated ids, a full pool), where a
        sequence's layers hold different counts, where the rows exceed
        :meth:`reserve_decode_rows`, or where the latest step is unwritten in some layer.

        Example
        -------
        >>> step = cache.plan_decode_step(seq_ids)
        >>> for layer in range(cache.num_layers):
        ...     cache.write_decode_step(layer, k[layer], v[layer], step)
        ...     o = foscar.decode_attention(q[layer], cache, step.batches[layer])
        """
        seq_ids = tuple(seq_ids)
        if not seq_ids:
            raise ValueError("seq_ids must name at least one sequence")
        last = self._latest_step
        if last is not None and last.serial == self._step_serial:
            missing = sorted(set(range(self.num_layers)) - last.written)
            if missing:
                raise ValueError(
                    f"the latest planned step is unwritten in layers {missing} (its lengths "
                    "already count the token): write_decode_step them, or free its sequences, "
                    "before planning another step"
                )
        seqs = [self._lookup(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError(f"seq_ids must be distinct, got {list(seq_ids)}")
        check_int(padding_rows, "padding_rows", low=0)
        if split_history is not None:
            check_int(split_history, "split_history", low=1)
        for i, s in enumerate(seqs):
            lengths = s.lengths
            if lengths.count(lengths[0]) != len(lengths):
                raise ValueError(
                    f"seq_ids[{i}] = {seq_ids[i]!r} holds {lengths} tokens per layer: a planned "
                    "step appends to every layer, so they must agree (append per layer instead)"
                )
        rows = len(seqs) + padding_rows
        buffer = self._step_buffer
        if buffer is not None and buffer.fixed and rows > buffer.rows:
            raise ValueError(
                f"the step has {rows} rows ({len(seqs)} sequences + {padding_rows} padding) but "
                f"reserve_decode_rows reserved {buffer.rows}"
            )
        new_lengths = [s.lengths[0] + 1 for s in seqs]
        need = self._pages_needed(seqs, new_lengths)  # raises before anything changes
        # ---- nothing below can fail for a reason of the caller's
        self._take_pages(seqs, need)
        layers = self.num_layers
        for s, n in zip(seqs, new_lengths):
            s.lengths[:] = [n] * layers
        self._touch(range(layers))
        self._step_serial += 1
        self._latest_step = decode_step.plan(
            self, seq_ids, seqs, new_lengths, padding_rows, split_history
        )
        return self._latest_step

    def write_decode_step(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, step: DecodeStep
    ) -> None:
        """Store layer ``layer``'s new tokens of a planned step (:meth:`plan_decode_step`).

        Parameters
        ----------
        layer : the layer to write.
        k, v : ``[step.rows, num_kv_heads, head_dim]``, floating, on the cache's device: row
            ``i`` is ``step.seq_ids[i]``'s new token; padding rows are written nowhere.
        step : the cache's latest planned step.

        The same bits as :meth:`append` of one token per sequence; no host-side bookkeeping
        (the step did it), and with the fused write one launch per role reading the step's
        descriptors, so the call can be captured in a CUDA graph.
        """
        layer = self._check_layer(layer)
        self._check_latest_step(step)
        self._check_plan_at(step.batches[layer], layer)  # an append to a planned sequence since
        self._check_kv(k, v, step.rows)
        n = len(step.seq_ids)  # (padding rows are stored nowhere)
        self._check_finite(k[:n], v[:n])
        fused = step.desc is not None and self._fused_write(layer)  # may raise: before any write
        tr = self.transforms[layer]
        if tr.key_rotation is not None:
            k = tr.rotate(k, "key")
        if tr.value_rotation is not None:
            v = tr.rotate(v, "value")
        write.write_planned_step(self, layer, k, v, step, fused)
        step.written.add(layer)

    def record_replayed_step(self, step: DecodeStep) -> None:
        """Record that a CUDA graph replay wrote every layer of ``step``: the captured
        :meth:`write_decode_step` calls ran on the device without their host code, which counts
        the layers written (:meth:`plan_decode_step` plans no further step until all are).
        Raises unless ``step`` is the latest planned step."""
        self._check_latest_step(step)
        step.written.update(range(self.num_layers))

    def _check_latest_step(self, step) -> None:
        """Raise unless ``step`` is the DecodeStep this cache planned last, still current (no
        step planned and no sequence freed since)."""
        if not isinstance(step, DecodeStep):
            raise TypeError(
                f"step must be a DecodeStep (from plan_decode_step), got {type(step).__name__}"
            )
        if step.serial != self._step_serial or step.batches is not self._step_view(step.rows):
            raise ValueError(
                "step is not this cache's latest planned step (another step was planned, or a "
                "sequence freed, since): plan_decode_step again"
            )

    def _step_view(self, rows: int):
        """The per-layer DecodeBatches the step buffer holds for ``rows`` rows (None if none)."""
        views = None if self._step_buffer is None else self._step_buffer.made_views(rows)
        return None if views is None else views[0]

    def step_buffer(self, rows: int) -> decode_step.StepBuffer:
        """The storage of a planned decode step of ``rows`` rows: the reserved one
        (:meth:`reserve_decode_rows`), else one allocated at the first step and replaced by one
        twice as large when a step needs more rows."""
        buffer = self._step_buffer
        if buffer is None or rows > buffer.rows:
            grown = max(rows, self.max_seqs) if buffer is None else max(rows, 2 * buffer.rows)
            buffer = self._step_buffer = decode_step.StepBuffer(
                grown, self.num_pages, self.device, False
            )
        return buffer

    # ------------------------------------------------------------------ accounting
    def pool_bytes(self) -> int:
        """Bytes allocated by every layer's pool and window buffers."""
        return sum(
            t.numel() * t.element_size() for st in self.layers for t in st.tensors().values()
        )

    def memory_stats(self) -> dict:
        """Bytes the live sequences occupy and their effective bits per K/V element.

        ``used_bytes`` counts what the live tokens need (codes, scales and offsets of the
        quantized history, BF16 sink and tail tokens) over all layers; ``page_bytes`` counts
        whole pages held (the last page of a sequence is partly empty); ``bf16_bytes`` is the
        same tokens in a BF16 cache.
        """
        h, d = self.num_kv_heads, self.head_dim
        bytes_per_quant_token = [  # per layer: codes, and an fp32 (s', z') pair per group
            h * sum(d * f.bits / 8 + 8 * d / f.group_size for f in (fmt.key, fmt.value))
            for fmt in self.formats
        ]
        bf16_bytes_per_token = 2 * h * d * 2
        window_bytes_per_token = (
            2 * h * d * torch.tensor([], dtype=self.window_dtype).element_size()
        )
        used = quant_tokens = window_tokens = tokens = 0
        for s in self._seqs.values():
            for layer, n in enumerate(s.lengths):
                q = s.quantized(n, self.windows)
                used += q * bytes_per_quant_token[layer] + (n - q) * window_bytes_per_token
                quant_tokens += q
                window_tokens += n - q
                tokens += n
        page_bytes = (
            (self.num_pages - len(self._free_pages))  # a shared page counts once
            * self.page_size
            * sum(bytes_per_quant_token)
        )
        return {
            "tokens": tokens,
            "quantized_tokens": quant_tokens,
            "window_tokens": window_tokens,
            "used_bytes": int(used),
            "page_bytes": int(page_bytes),
            "bf16_bytes": tokens * bf16_bytes_per_token,
            "effective_bits": (used * 8 / (tokens * 2 * h * d)) if tokens else float("nan"),
            "pool_bytes": self.pool_bytes(),
            "free_pages": len(self._free_pages),
            "shared_pages": self.num_shared_pages,
        }
