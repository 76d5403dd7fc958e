"""Paged quantized KV cache with BF16 sink and recent windows.

Logical layout of one sequence (oscar.md Sec. 4)::

    [ sink: first S tokens, BF16 | quantized history: Lq tokens, paged | tail: BF16 ]

* The **quantized history** holds tokens ``S .. S+Lq-1`` in pages of ``page_size`` tokens from a
  fixed pool shared by all sequences; a sequence's pages are listed in FlashInfer's CSR
  convention (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, int32). Pages are shared by
  all layers (one page table per sequence); each layer has its own pool tensors.
* The **tail** holds the last ``L - S - Lq`` tokens in BF16: the recent window (``W`` tokens)
  plus, for channel-wise groups, the tokens of the not-yet-complete group. It is a ring of
  ``W + quantum`` slots per sequence (position ``p`` lives in slot ``(p - S) % (W + quantum)``).
  Tokens are demoted into the history ``quantum`` at a time (1 for token-wise K and V; the
  channel-wise group size otherwise), so ``Lq = max(0, floor((L - S - W) / quantum)) * quantum``.

Pool tensors of one layer (``H`` KV heads, ``D`` head_dim, ``P`` pages of ``ps`` tokens)::

    k_words:  [P, H, ps, D * bits_k // 32] int32    packed codes (layout and channel order:
                                                    foscar.formats, role "key")
    k_scales: [P, H, ps * D // g_k, 2] float32      folded (s', z') pairs, interleaved so that
                                                    one load brings both
    (v_* likewise, channel order of role "value")
    k_sink:   [max_seqs, H, S, D] bfloat16          first S tokens
    k_tail:   [max_seqs, H, W + quantum, D] bfloat16 ring of the last tokens

Scale layout: a sequence's scales, flattened in group order (token-wise: ``[Lq, D/g]``
row-major; channel-wise: ``[Lq/g, D]`` row-major), are cut into chunks of ``E = ps * D / g``
entries, chunk ``i`` stored in the sequence's ``i``-th page. Both axes store ``D/g`` entries per
token, so no space is wasted; for token-wise groups chunk ``i`` belongs exactly to the tokens of
page ``i``, and a channel-wise group with ``g > ps`` spreads its ``D`` scales over its ``g/ps``
pages.

Bad input raises ``ValueError``/``TypeError`` naming the argument; every check runs before the
first write, so a rejected call leaves pages, tables and counters exactly as they were.
Values are rounded to ``window_dtype`` (BF16) on entry, so a token quantizes to the same bits
whether it is demoted from the tail or written straight into the history by a prefill.

OSCAR transforms (:meth:`QuantizedKVCache.set_transform`): a layer may rotate what it stores,
``k R_K`` and ``v R_V`` with orthogonal ``R`` (one per layer or per KV head), in every segment
(sink, history, tail); :func:`foscar.decode_attention` then rotates the queries by ``R_K`` and
the output by ``R_V^T``, so attention is unchanged in exact arithmetic. A layer may also replace
the format's clip ratios of K and V with its own.

NaN/Inf rule: K and V must be finite; a call with a non-finite value is rejected (one
device-to-host sync per call; pass ``check_finite=False`` to the cache to skip it, and then a
non-finite value poisons its whole group, as it would a BF16 attention).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .formats import (
    GroupAxis,
    KVFormat,
    QuantFormat,
    Role,
    _bit_offsets,
    channel_order,
    fold_scale_offset,
    pack_codes,
    words_per_row,
)
from .quantize import quantize, quantize_gptq

__all__ = [
    "QuantizedKVCache",
    "LayerStorage",
    "LayerTransform",
    "DecodeBatch",
    "effective_bits",
    "layer_formats",
    "rotate_rows",
]

_ALLOWED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
DECODE_WRITE_PATHS = ("auto", "fused", "torch")


def check_decode_write(decode_write: str) -> None:
    """Raise ``ValueError`` unless ``decode_write`` names a decode-step write path."""
    if decode_write not in DECODE_WRITE_PATHS:
        raise ValueError(f"decode_write must be one of {DECODE_WRITE_PATHS}, got {decode_write!r}")


@dataclass
class LayerStorage:
    """The pool tensors of one layer (shapes in the module docstring)."""

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


@dataclass(frozen=True)
class LayerTransform:
    """OSCAR's transform of one layer (:meth:`QuantizedKVCache.set_transform`).

    ``key_rotation, value_rotation``: ``[H, D, D]`` float64 orthogonal (one per KV head) or None;
    ``key_clip, value_clip``: clip ratio replacing the format's for this layer's history, or None;
    ``key_gptq``: ``[H, D, D]`` float32 upper-triangular GPTQ factor of the keys' metric (the
    queries' covariance in the stored basis; :func:`foscar.quantize.gptq_factor`), or None for
    round-to-nearest.
    """

    key_rotation: torch.Tensor | None = None
    value_rotation: torch.Tensor | None = None
    key_clip: float | None = None
    value_clip: float | None = None
    key_gptq: torch.Tensor | None = None
    # what is derived from the fields once, not per call: the rotations in float32 (a decode
    # step rotates K, V, Q and the output of every layer) and the clipped history formats
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def rotate(self, x: torch.Tensor, role: str, *, inverse: bool = False) -> torch.Tensor:
        """:func:`rotate_rows` of ``x`` by this layer's ``role`` ("key" or "value") rotation
        (float32 ``x`` and narrower with the rotation's float32 copy, made once)."""
        r = getattr(self, f"{role}_rotation")
        if x.dtype != torch.float64:
            key = ("float32", role)
            if key not in self._derived:
                self._derived[key] = r.to(torch.float32)
            r = self._derived[key]
        return rotate_rows(x, r, inverse=inverse)


def rotate_rows(x: torch.Tensor, r: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``x R_h`` (or ``x R_h^T`` with ``inverse``) for rows ``x: [..., Hx, D]`` of heads ``Hx``.

    ``r: [H, D, D]``; head ``j`` of ``x`` uses ``R_{j // (Hx / H)}`` (query heads share their
    KV head's rotation). Computed in float64 for float64 ``x``, else float32; returned in that
    dtype (the cache rounds to its window dtype afterwards). One matrix product (batched over
    the heads when there are several rotations): ``einsum`` spent ~80 us of host time per call
    planning the same product (NOTES 24).
    """
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    rr = r.to(device=x.device, dtype=dt)  # no copy when it already is
    if inverse:
        rr = rr.transpose(-1, -2)
    h, (hx, d) = rr.shape[0], x.shape[-2:]
    if hx % h or rr.shape[-2:] != (d, d):
        raise ValueError(
            f"rotate_rows: x has {hx} heads of {d} channels, r is {list(r.shape)} (the heads "
            "must be a multiple of its rotations, each D x D)"
        )
    xg = x.to(dt).reshape(-1, h, hx // h, d)  # [N, H, g, D]
    if h == 1:
        return (xg.reshape(-1, d) @ rr[0]).reshape(x.shape)
    y = torch.bmm(xg.transpose(0, 1).reshape(h, -1, d), rr)  # [H, N * g, D]
    return y.unflatten(1, (-1, hx // h)).transpose(0, 1).reshape(x.shape)


@dataclass
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

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

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
class _Sequence:
    slot: int
    pages: list[int]
    lengths: list[int]  # total tokens per layer


def _host_to(device: torch.device, values, dtype=torch.long) -> torch.Tensor:
    """A host list or CPU tensor on ``device`` without a stream sync: CUDA copies go through
    pinned memory, non-blocking (a plain ``torch.tensor(..., device="cuda")`` waits for every
    kernel queued before it, which serialised each layer's append with the GPU)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _num_quantized(length: int, fmt: KVFormat) -> int:
    """Tokens of a length-``length`` sequence that live in the quantized history."""
    past_window = length - fmt.sink_tokens - fmt.recent_tokens
    if past_window <= 0:
        return 0
    quantum = fmt.demotion_quantum
    return past_window // quantum * quantum


def effective_bits(
    num_tokens: int,
    fmt: KVFormat | Sequence[KVFormat],
    *,
    scale_bits: int = 32,
) -> float:
    """Stored bits per K/V element of one sequence, scales, offsets and BF16 windows included.

    ``(bf16_tokens * 16 + Lq * (bits + 2 * scale_bits / g)) / num_tokens``, averaged over K and
    V. With ``scale_bits=16``, INT2, g=128, L=131072 and S+W=320 this is oscar.md's 2.2836.
    ``fmt`` may be one format per layer (:func:`layer_formats`): then the mean over layers.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    if isinstance(fmt, KVFormat):
        formats = [fmt]
    elif isinstance(fmt, Sequence) and not isinstance(fmt, (str, bytes)) and len(fmt):
        formats = layer_formats(fmt, len(fmt))
    else:
        raise TypeError(f"fmt must be a KVFormat or a non-empty sequence of them, got {fmt!r}")
    per_tensor = []
    for f_layer in formats:
        lq = _num_quantized(num_tokens, f_layer)
        bf16 = num_tokens - lq
        per_tensor += [
            (bf16 * 16 + lq * (f.bits + 2 * scale_bits / f.group_size)) / num_tokens
            for f in (f_layer.key, f_layer.value)
        ]
    return sum(per_tensor) / len(per_tensor)


def layer_formats(fmt: KVFormat | Sequence[KVFormat], num_layers: int) -> tuple[KVFormat, ...]:
    """``fmt`` as one format per layer: a KVFormat serves every layer; a sequence gives one per
    layer, and its formats may differ in K and V (width, axis, group, clip) but must share the
    operand mapping, the BF16 windows and the demotion quantum (one page table and one window
    layout serve all layers: a layer with channel-wise groups of ``g`` tokens needs every layer
    to demote ``g`` tokens at a time, so it cannot sit beside an all-token-wise layer). Raises
    naming ``fmt[i]`` and what differs."""
    _check_int(num_layers, "num_layers", low=1)
    if isinstance(fmt, KVFormat):
        return (fmt,) * num_layers
    if isinstance(fmt, (str, bytes)) or not isinstance(fmt, Sequence):
        raise TypeError(
            f"fmt must be a KVFormat or a sequence of one per layer, got {type(fmt).__name__}"
        )
    formats = tuple(fmt)
    if len(formats) != num_layers:
        raise ValueError(
            f"fmt holds {len(formats)} formats, expected one per layer (num_layers={num_layers})"
        )
    for i, f in enumerate(formats):
        if not isinstance(f, KVFormat):
            raise TypeError(f"fmt[{i}] must be a KVFormat, got {type(f).__name__}")
        for attr in ("mapping", "sink_tokens", "recent_tokens", "demotion_quantum"):
            a, b = getattr(formats[0], attr), getattr(f, attr)
            if a != b:
                raise ValueError(
                    f"fmt[{i}].{attr} is {b!r} but fmt[0].{attr} is {a!r}: every layer's format "
                    "must share the operand mapping and the BF16 windows (and the channel-wise "
                    "group that sets the demotion quantum)"
                )
    return formats


def _check_int(value, name: str, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class QuantizedKVCache:
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
        Reject K/V containing NaN or Inf (default True; see the module docstring).
    decode_write : {"auto", "fused", "torch"}
        How a decode step (one new token per sequence) is written: "fused" is one Triton launch
        per role (foscar.kernels.cache_write; token-wise history formats, clipped and
        GPTQ-rounded ones included, a CUDA device or the Triton interpreter), "torch" the tensor
        operations of a prefill's path, "auto" fused wherever it applies on a CUDA device. Both
        store the same bits.

    Example
    -------
    >>> fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    >>> cache = QuantizedKVCache(fmt, num_kv_heads=8, head_dim=128, num_pages=64, max_seqs=4)
    >>> sid = cache.add_sequence()
    >>> k = v = torch.randn(300, 8, 128, dtype=torch.bfloat16)
    >>> cache.append([sid], k, v)                 # prefill 300 tokens into layer 0
    >>> batch = cache.plan([sid])                 # page tables for decode_attention
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
        _check_int(num_kv_heads, "num_kv_heads", low=1)
        _check_int(head_dim, "head_dim", low=1)
        _check_int(num_pages, "num_pages", low=1)
        _check_int(max_seqs, "max_seqs", low=1)
        _check_int(num_layers, "num_layers", low=1)
        _check_int(page_size, "page_size", low=1)
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
        if window_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise TypeError(f"window_dtype must be a floating dtype, got {window_dtype}")
        #: one KVFormat per layer (all the same unless ``fmt`` gave one per layer)
        self.formats = formats
        #: the mapping and windows every layer shares (``layer_formats``)
        self._windows = formats[0]
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.max_seqs = max_seqs
        self.num_layers = num_layers
        self.page_size = page_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" and "cuda:0" must compare equal to the tensors' devices
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.window_dtype = window_dtype
        self.check_finite = check_finite
        check_decode_write(decode_write)
        self.decode_write = decode_write
        self._desc_memo: tuple | None = None  # (descriptor rows, their device tensor)
        self._fused_failure: str | None = None  # why "auto" stopped taking the fused write
        self.layers = [self._allocate_layer(f) for f in formats]
        self.transforms = [LayerTransform() for _ in range(num_layers)]
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives 0 first
        self._free_slots: list[int] = list(range(max_seqs - 1, -1, -1))
        self._seqs: dict[object, _Sequence] = {}
        self._next_id = 0
        if decode_write == "fused":
            self._fused_write(0)  # raises if the fused write cannot serve this cache

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
        return self._windows

    @property
    def mixed_formats(self) -> bool:
        """Whether the layers' formats differ."""
        return any(f != self._windows for f in self.formats)

    def layer_format(self, layer: int) -> KVFormat:
        """The KVFormat of ``layer`` (the cache's format unless it was given one per layer)."""
        return self.formats[self._check_layer(layer)]

    def role_format(self, layer: int, name: str) -> QuantFormat:
        """The QuantFormat of ``"k"`` or ``"v"`` in ``layer``, before the layer's own clip."""
        if name not in ("k", "v"):
            raise ValueError(f"name must be 'k' or 'v', got {name!r}")
        f = self.formats[self._check_layer(layer)]
        return f.key if name == "k" else f.value

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
            order = channel_order(role, bits, self.head_dim, self._windows.mapping)
            orders[(name, bits)] = order.to(self.device)
        return orders[(name, bits)]

    def packing_tables(self, name: str, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(order [D], bit offsets [32 // bits])`` int32 on the device, for the fused write."""
        bits = self.role_format(layer, name).bits
        tables = self.__dict__.setdefault("_packing_tables", {})
        if (name, bits) not in tables:
            order = self.channel_order(name, layer).to(torch.int32)
            shifts = _bit_offsets(bits, self._windows.mapping, self.device).to(torch.int32)
            tables[(name, bits)] = (order, shifts)
        return tables[(name, bits)]

    def fused_write_reason(self, layer: int = 0) -> str | None:
        """``None`` if a decode step of ``layer`` can take the fused write, else why not."""
        for name in ("k", "v"):
            f = self._history_format(layer, name)
            if f.axis is not GroupAxis.TOKEN:
                return f"{name} history groups run along tokens (channel-wise)"
        d = self.head_dim
        if d & (d - 1) or d < 16:
            return f"head_dim must be a power of two >= 16, got {d}"
        if self.window_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"window dtype {self.window_dtype} (the kernel loads 16- or 32-bit floats)"
        from .backends import triton as triton_backend

        if not triton_backend.available(self.device):
            return f"Triton cannot run on {self.device}"
        return None

    def _fused_write(self, layer: int) -> bool:
        if self.decode_write == "torch" or (
            self.decode_write == "auto" and (self.device.type != "cuda" or self._fused_failure)
        ):
            return False
        reason = self.fused_write_reason(layer)
        if reason is not None and self.decode_write == "fused":
            raise ValueError(f"decode_write='fused' cannot write this cache: {reason}")
        return reason is None

    def _allocate_layer(self, fmt: KVFormat) -> LayerStorage:
        p, h, d, ps = self.num_pages, self.num_kv_heads, self.head_dim, self.page_size
        fk, fv = fmt.key, fmt.value
        dev = self.device

        def words(f):
            return torch.zeros(p, h, ps, words_per_row(d, f.bits), dtype=torch.int32, device=dev)

        def scales(f):
            e = self.scale_entries_per_page(f)
            return torch.zeros(p, h, e, 2, dtype=torch.float32, device=dev)

        s, r = fmt.sink_tokens, fmt.tail_capacity
        wd = self.window_dtype
        return LayerStorage(
            k_words=words(fk),
            k_scales=scales(fk),
            v_words=words(fv),
            v_scales=scales(fv),
            k_sink=torch.zeros(self.max_seqs, h, s, d, dtype=wd, device=dev),
            v_sink=torch.zeros(self.max_seqs, h, s, d, dtype=wd, device=dev),
            k_tail=torch.zeros(self.max_seqs, h, r, d, dtype=wd, device=dev),
            v_tail=torch.zeros(self.max_seqs, h, r, d, dtype=wd, device=dev),
        )

    # ------------------------------------------------------------------ sequences
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

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
        self._free_pages = [p for p in self._free_pages if p not in set(pages)]
        slot = self._free_slots.pop()
        self._seqs[seq_id] = _Sequence(slot=slot, pages=list(pages), lengths=[0] * self.num_layers)
        return seq_id

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
        free = set(self._free_pages)
        for i, p in enumerate(pages):
            if p not in free:
                owner = next((s for s, q in self._seqs.items() if p in q.pages), None)
                raise ValueError(f"pages[{i}] = {p} overlaps the pages of sequence {owner!r}")
        return pages

    def free(self, seq_id) -> None:
        """End a sequence: its pages and window slot return to the pool for reuse."""
        seq = self._lookup(seq_id, "seq_id")
        del self._seqs[seq_id]
        self._free_pages.extend(reversed(seq.pages))
        self._free_slots.append(seq.slot)

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
            :func:`foscar.reference.dequantize_sequence` returns the model's coordinates.
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
        d = self.head_dim
        rotations = []
        for name, r in (("key_rotation", key_rotation), ("value_rotation", value_rotation)):
            if r is None:
                rotations.append(None)
                continue
            r = self._per_head_matrices(name, r, torch.float64)
            eye = torch.eye(d, dtype=torch.float64, device=self.device)
            err = float((r.transpose(1, 2) @ r - eye).abs().max())
            if not err < 1e-6:
                raise ValueError(f"{name} must be orthogonal (max |R^T R - I| = {err:.2e})")
            rotations.append(r)
        clips = []
        for name, c in (("key_clip", key_clip), ("value_clip", value_clip)):
            if c is not None:
                # QuantFormat checks the ratio and names it; report our argument's name
                try:
                    c = QuantFormat(clip=c).clip
                except (TypeError, ValueError) as e:
                    raise type(e)(str(e).replace("clip", name, 1)) from None
            clips.append(c)
        if key_gptq is not None:
            fk = self.formats[layer].key
            if fk.axis is not GroupAxis.TOKEN:
                raise ValueError(
                    f"key_gptq: GPTQ rounding covers token-wise keys; layer {layer}'s keys are "
                    f"{fk.short()}"
                )
            key_gptq = self._per_head_matrices("key_gptq", key_gptq, torch.float32)
            diag = torch.diagonal(key_gptq, dim1=-2, dim2=-1)
            if not bool(torch.equal(key_gptq, key_gptq.triu())) or not bool((diag > 0).all()):
                raise ValueError("key_gptq must be upper triangular with a positive diagonal")
        self.transforms[layer] = LayerTransform(*rotations, *clips, key_gptq)

    def _per_head_matrices(self, name: str, m, dtype: torch.dtype) -> torch.Tensor:
        """``m`` as ``[num_kv_heads, D, D]`` on the cache's device in ``dtype``, from a floating
        ``[D, D]``, ``[1, D, D]`` (shared by the KV heads) or ``[H, D, D]`` tensor; raises naming
        the argument ``name`` otherwise."""
        h, d = self.num_kv_heads, self.head_dim
        if not isinstance(m, torch.Tensor) or not m.is_floating_point():
            raise TypeError(f"{name} must be a floating torch.Tensor, got {type(m).__name__}")
        if tuple(m.shape) in ((d, d), (1, d, d)):
            m = m.expand(h, d, d)
        if tuple(m.shape) != (h, d, d):
            raise ValueError(
                f"{name} must be [head_dim={d}, {d}] or [num_kv_heads={h}, {d}, {d}], "
                f"got {list(m.shape)}"
            )
        return m.to(device=self.device, dtype=dtype).contiguous()

    def _history_format(self, layer: int, name: str) -> QuantFormat:
        tr = self.transforms[layer]
        f = self.role_format(layer, name)
        clip = tr.key_clip if name == "k" else tr.value_clip
        if clip is None:
            return f
        # a decode step asks ~4 times per layer; replace() validates the format each time.
        # (The memo lives on the transform: only this cache's set_transform makes its transforms,
        # and the cache's format never changes; keyed by the format too, to stay right if not.)
        key = ("format", name, f)
        if key not in tr._derived:
            tr._derived[key] = replace(f, clip=clip)
        return tr._derived[key]

    def _lookup(self, seq_id, name: str) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise ValueError(
                f"{name} {seq_id!r} is not a live sequence (unknown or already freed)"
            ) from None

    def _check_layer(self, layer) -> int:
        _check_int(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return layer

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
        num_new_tokens : tokens per sequence (default: one each, a decode step).
        layer : which layer's pool to write.
        """
        layer = self._check_layer(layer)
        seq_ids = list(seq_ids)
        seqs = [self._lookup(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
        if num_new_tokens is None:
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
            _check_int(n, f"num_new_tokens[{i}]", low=1)
        total = sum(num_new_tokens)
        h, d = self.num_kv_heads, self.head_dim
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
            if tuple(t.shape) != (total, h, d):
                raise ValueError(
                    f"{name} must have shape [num_tokens={total}, num_kv_heads={h}, "
                    f"head_dim={d}], got {list(t.shape)}"
                )
        if self.check_finite:
            for name, t in (("k", k), ("v", v)):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name} contains NaN or Inf (the cache stores finite values)")
        # Pages this call needs, checked before anything is written.
        new_lengths = [s.lengths[layer] + n for s, n in zip(seqs, num_new_tokens)]
        need = [
            max(0, math.ceil(_num_quantized(n, self._windows) / self.page_size) - len(s.pages))
            for s, n in zip(seqs, new_lengths)
        ]
        if sum(need) > len(self._free_pages):
            raise ValueError(
                f"page pool exhausted: this append needs {sum(need)} more pages, "
                f"{len(self._free_pages)} of {self.num_pages} are free"
            )
        decode_step = all(n == 1 for n in num_new_tokens)
        fused = decode_step and self._fused_write(layer)  # may raise: before any write
        tr = self.transforms[layer]
        if tr.key_rotation is not None:
            k = tr.rotate(k, "key")
        if tr.value_rotation is not None:
            v = tr.rotate(v, "value")
        # ---- nothing below can fail for a reason of the caller's
        for s, n in zip(seqs, need):
            for _ in range(n):
                s.pages.append(self._free_pages.pop())
        if decode_step:
            self._write_decode(layer, seqs, new_lengths, k, v, fused)
        else:
            self._write(layer, seqs, new_lengths, num_new_tokens, k, v)
        for s, n in zip(seqs, new_lengths):
            s.lengths[layer] = n

    def _write(self, layer, seqs, new_lengths, counts, k, v) -> None:
        """Scatter new tokens to the sink, the history (quantized) and the tail ring.

        Index tensors are built per sequence with ``arange`` (no per-token Python), so a
        100K-token prefill costs a few tensor ops.
        """
        fmt = self._windows
        st = self.layers[layer]
        sink, cap, ps = fmt.sink_tokens, fmt.tail_capacity, self.page_size
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
            lq0, lq1 = _num_quantized(l0, fmt), _num_quantized(l1, fmt)
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

        dev = self.device

        def cat(parts):
            return (
                _host_to(dev, torch.cat(parts))
                if parts
                else torch.empty(0, dtype=torch.long, device=dev)
            )

        if n_demoted:
            self._write_demoted(
                layer,
                k,
                v,
                (cat(old_slot), cat(old_ring), cat(old_dst)),
                (cat(new_src), cat(new_dst)),
                segments,
                cat(hist_page),
                cat(hist_row),
            )
        wd = self.window_dtype
        if sink_src:
            src, slot, pos = cat(sink_src), cat(sink_slot), cat(sink_pos)
            st.k_sink[slot, :, pos] = k[src].to(wd)
            st.v_sink[slot, :, pos] = v[src].to(wd)
        src, slot, pos = cat(tail_src), cat(tail_slot), cat(tail_pos)
        if src.numel():
            st.k_tail[slot, :, pos] = k[src].to(wd)
            st.v_tail[slot, :, pos] = v[src].to(wd)

    def _write_decode(self, layer, seqs, new_lengths, k, v, fused: bool = False) -> None:
        """:meth:`_write` for one new token per sequence (a decode step), bit for bit.

        The same scatter, with index lists built in Python: per sequence that is a few integer
        operations, where :meth:`_write` spends a dozen tensor operations (27 ms for 32
        sequences on 2 CPU cores against 2 ms here; ``tests/test_cache_decode.py`` checks both
        paths leave identical caches). ``fused``: quantize, pack and scatter in one Triton
        launch per role instead (foscar.kernels.cache_write; ``tests/test_cache_write.py``).
        """
        st = self.layers[layer]
        if fused:
            try:
                self._write_decode_fused(layer, seqs, new_lengths, k, v)
                return
            except Exception as e:  # e.g. Triton cannot compile here
                if self.decode_write == "fused":
                    raise
                # "auto": the torch path below writes the same destinations with the same bits
                # (a K written before a failed V launch is overwritten identically)
                self._fused_failure = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"foscar: the fused decode write failed ({self._fused_failure}); this cache "
                    "writes decode steps with torch operations from now on",
                    RuntimeWarning,
                    stacklevel=3,
                )
        sink_src, sink_slot, sink_pos = [], [], []
        tail_src, tail_slot, tail_pos = [], [], []
        old_slot, old_ring, old_dst, new_src, new_dst = [], [], [], [], []
        hist_page, hist_row, segments = [], [], []
        for i, (seq, l1) in enumerate(zip(seqs, new_lengths)):
            at_sink, at_tail, demoted = self._decode_step_places(seq, l1)
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
                lq0 = _num_quantized(l1 - 1, self._windows)
                segments.append((seq.pages, lq0, len(demoted)))
            if at_tail is not None:
                tail_src.append(i)
                tail_slot.append(seq.slot)
                tail_pos.append(at_tail)
        dev = self.device

        def idx(values):
            return _host_to(dev, values)

        if hist_page:
            self._write_demoted(
                layer,
                k,
                v,
                (idx(old_slot), idx(old_ring), idx(old_dst)),
                (idx(new_src), idx(new_dst)),
                segments,
                idx(hist_page),
                idx(hist_row),
            )
        wd = self.window_dtype
        if sink_src:
            src, slot, pos = idx(sink_src), idx(sink_slot), idx(sink_pos)
            st.k_sink[slot, :, pos] = k[src].to(wd)
            st.v_sink[slot, :, pos] = v[src].to(wd)
        if tail_src:
            src, slot, pos = idx(tail_src), idx(tail_slot), idx(tail_pos)
            st.k_tail[slot, :, pos] = k[src].to(wd)
            st.v_tail[slot, :, pos] = v[src].to(wd)

    def _decode_step_places(self, seq, l1: int) -> tuple:
        """Where a decode step puts the token that makes ``seq`` ``l1`` tokens long:
        ``(sink position or None, tail ring position or None, demoted)`` with ``demoted`` the
        history tokens this step quantizes, each ``(ring position or None for the new token
        itself, page, row)`` (one per step for token-wise K and V; a group for channel-wise)."""
        fmt = self._windows
        sink, cap, ps = fmt.sink_tokens, fmt.tail_capacity, self.page_size
        l0 = l1 - 1
        lq0, lq1 = _num_quantized(l0, fmt), _num_quantized(l1, fmt)
        demoted = [
            (None if t == l0 - sink else t % cap, seq.pages[t // ps], t % ps)
            for t in range(lq0, lq1)
        ]
        at_sink = l0 if l0 < sink else None
        at_tail = (l0 - sink) % cap if l0 >= sink + lq1 else None
        return at_sink, at_tail, demoted

    def _write_decode_fused(self, layer, seqs, new_lengths, k, v) -> None:
        """The fused decode write: per sequence the six integers of the kernel's descriptor
        (token-wise history: at most one token is demoted per step), one launch per role."""
        from .backends.triton import write_decode_tokens

        rows = []
        for seq, l1 in zip(seqs, new_lengths):
            at_sink, at_tail, demoted = self._decode_step_places(seq, l1)
            ring, page, row = demoted[0] if demoted else (-1, -1, -1)
            rows.append(
                (
                    seq.slot,
                    -1 if at_sink is None else at_sink,
                    -1 if at_tail is None else at_tail,
                    -1 if ring is None else ring,
                    page,
                    row,
                )
            )
        rows = tuple(rows)
        # every layer of a step has the same descriptor: one host-to-device copy per step
        if self._desc_memo is None or self._desc_memo[0] != rows:
            self._desc_memo = (rows, _host_to(self.device, list(rows), torch.int32))
        desc = self._desc_memo[1]
        wd = self.window_dtype
        for name, x in (("k", k), ("v", v)):
            x = x if x.dtype == wd else x.to(wd)
            if x.stride(-1) != 1:
                x = x.contiguous()
            write_decode_tokens(self, layer, name, x, desc)

    def _write_demoted(self, layer, k, v, old, new, segments, hist_page, hist_row) -> None:
        """Quantize the demoted tokens of K and V into the history, in demotion order.

        old: ``(slot, ring position, destination)`` of the tokens leaving the tail rings;
        new: ``(source row, destination)`` of the tokens taken straight from this call's K/V;
        hist_page, hist_row: where each demoted token lands (``[n]`` device indices).
        """
        st = self.layers[layer]
        (old_slot, old_ring, old_dst), (new_src, new_dst) = old, new
        for name, src in (("k", k), ("v", v)):
            # Every token is rounded to the window dtype on entry, so the quantizer sees the
            # same values whether a token is demoted from the tail or arrives in a prefill.
            tail = getattr(st, f"{name}_tail")
            demoted = torch.empty(
                len(hist_page),
                self.num_kv_heads,
                self.head_dim,
                dtype=tail.dtype,
                device=tail.device,
            )
            demoted[old_dst] = tail[old_slot, :, old_ring]
            demoted[new_dst] = src[new_src].to(tail.dtype)
            self._write_history(layer, name, demoted, segments, hist_page, hist_row)

    def _write_history(self, layer: int, name, demoted, segments, hist_page, hist_row):
        """Quantize the demoted tokens ``[n, H, D]`` of K or V; store codes, s' and z'."""
        st = self.layers[layer]
        f = self._history_format(layer, name)
        mapping = self._windows.mapping
        x = demoted.transpose(0, 1)  # [H, n, D]: channel-wise groups run along tokens
        gptq = self.transforms[layer].key_gptq if name == "k" else None
        codes, scale, offset = quantize(x, f) if gptq is None else quantize_gptq(x, f, gptq)
        scale, offset = fold_scale_offset(scale, offset, f.bits, mapping)
        words = pack_codes(codes, f.bits, mapping, self.channel_order(name, layer))  # [H, n, W]
        getattr(st, f"{name}_words")[hist_page, :, hist_row] = words.transpose(0, 1)
        # Scales in flat group order per sequence (see the module docstring) -> (page, entry).
        per_page = self.scale_entries_per_page(f)
        d, g = self.head_dim, f.group_size
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
        fp = _host_to(self.device, torch.cat(flat_page))
        fe = _host_to(self.device, torch.cat(flat_entry))
        # token-wise scale [H, n, D/g], channel-wise [H, n/g, D]: both flatten to flat order.
        h = self.num_kv_heads
        pairs = torch.stack([scale.reshape(h, -1), offset.reshape(h, -1)], dim=-1)  # [H, n_e, 2]
        getattr(st, f"{name}_scales")[fp, :, fe] = pairs.transpose(0, 1)

    def _assume_appended(self, seq_id, length: int) -> None:
        """Benchmarks only: mark ``length`` tokens of every layer present without writing them.

        Pages are taken as an append would take them, but the pool keeps whatever bits it
        holds (decode cost does not depend on the values). Tests and serving never call this.
        """
        seq = self._lookup(seq_id, "seq_id")
        need = math.ceil(_num_quantized(length, self._windows) / self.page_size) - len(seq.pages)
        if need > len(self._free_pages):
            raise ValueError(
                f"page pool exhausted: {need} more pages needed, {len(self._free_pages)} free"
            )
        for _ in range(max(0, need)):
            seq.pages.append(self._free_pages.pop())
        seq.lengths = [length] * self.num_layers

    # ------------------------------------------------------------------ planning
    def plan(self, seq_ids: Sequence, layer: int = 0) -> DecodeBatch:
        """Page tables and window descriptors of ``seq_ids`` (in that order) for decoding."""
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
            q = _num_quantized(n, self._windows)
            lens.append(n)
            nq.append(q)
            pages.append(s.pages[: math.ceil(q / self.page_size)])
        indptr = [0]
        for p in pages:
            indptr.append(indptr[-1] + len(p))
        last = [(q - 1) % self.page_size + 1 if q else 0 for q in nq]
        dev = self.device

        def i32(values):
            return _host_to(dev, values, torch.int32)

        return DecodeBatch(
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
            sink_tokens=self._windows.sink_tokens,
            tail_capacity=self._windows.tail_capacity,
            layer=layer,
        )

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
                q = _num_quantized(n, self._windows)
                used += q * bytes_per_quant_token[layer] + (n - q) * window_bytes_per_token
                quant_tokens += q
                window_tokens += n - q
                tokens += n
        page_bytes = (
            sum(len(s.pages) for s in self._seqs.values())
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
        }
