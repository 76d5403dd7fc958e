"""foscar as a Hugging Face transformers KV cache (transformers 5.17 to 5.25, the tested range).

::

    from foscar.integrations.transformers import FoscarCache, cache_kwarg, use_foscar_attention

    use_foscar_attention(model)                    # registers and selects the "foscar" attention
    cache = FoscarCache(fmt, model.config)         # every layer in one foscar.QuantizedKVCache
    out = model.generate(**inputs, **{cache_kwarg(model): cache})

How a forward pass flows
------------------------
A transformers attention layer calls ``cache.update(k, v, layer_idx)`` and then the attention
function, which is never handed the cache. ``FoscarCache.update`` therefore only parks the new
K/V (``[B, H_kv, T, D]``, post-RoPE) and returns them tagged with the cache
(:func:`foscar.attention.attach`); the ``"foscar"`` attention function finds the cache on its
``key`` argument and the layer through ``module.layer_idx``. The writes happen there, because
only the attention function sees the attention mask, i.e. which tokens are padding. Per layer,
through the attention step the serving engine shares (:class:`foscar.attention.CacheAttention`):

* **prefill** (the layer holds nothing yet): each row's real tokens are stored in the
  quantized cache (rounded to BF16, then quantized or kept in the BF16 windows by the format),
  and attention runs in SDPA over the K/V passed in, at the model's precision;
* **decode** (query length 1): the step is planned once, at the first layer, for every layer
  (:meth:`foscar.QuantizedKVCache.plan_decode_step`); each layer writes its token and a
  :class:`foscar.DecodePlan` reads the quantized pages through the layer's batch
  (``step.batches[layer]``; the GPU kernels); where it would run its torch reference (a CPU),
  the default ``decode="auto"`` attends instead over each history token dequantized once (the
  same values to fp32 rounding, in less time per token: docs/tuning.md, Cache write and host
  path, row ``FoscarCache(decode="dequantized")``);
* **extend** (query length > 1 on a non-empty cache: a continued conversation): the stored
  tokens are dequantized (:func:`foscar.cache.read.dequantize_sequence`) and attended together
  with the new ones in torch (:meth:`foscar.attention.CacheAttention.extend`); then the new
  tokens are stored.

Padding: pads are not stored
----------------------------
Each row of the batch is its own foscar sequence, and only its real tokens are written (ragged).
Storing pads and masking them would cost pages and bandwidth for every pad on every decode
step, would need a dense mask inside a kernel whose input is page tables, and would change the
numbers: a pad token inside a channel-wise group of ``g`` tokens enters that group's min-max
range, so a padded row would quantize differently from the same prompt alone. With pads left
out, a row's cache is the one its prompt gets alone (``tests/test_transformers.py`` checks
that). The mask is read at prefill (the last query row marks the real tokens; they must be a
suffix of the row, i.e. left padding) and checked once per decode step (at the first layer:
each row's visible columns must be exactly its stored tokens). ``get_seq_length`` counts
positions with the pads, as transformers expects for positions and mask sizes; row ``b`` holds
``get_seq_length() - pads_b`` tokens.

transformers pitfalls handled here (checked on 5.17, 5.24 and 5.25)
-------------------------------------------------------------
* A mask function is registered under the attention name with the classmethod
  ``AttentionMaskInterface.register``: an attention name without one gets no mask at all, and
  left-padded batches would silently attend to pads during prefill.
* ``get_mask_sizes`` is called before this forward's ``update`` and returns
  ``(seen + query_length, 0)``.
* 5.24 renamed ``generate(past_key_values=...)`` to ``cache=`` (5.17 rejects ``cache=``, and its
  ``forward`` silently ignores it): use :func:`cache_kwarg`. 5.24 also passes ``kwargs=`` into
  ``Cache.update``.
* Full attention only: configs with sliding-window or linear-attention layers are rejected.
  Beam search, ``crop`` (assisted / prompt-lookup decoding) and batch reshuffling are not
  supported (quantized pages are append-only) and raise ``NotImplementedError``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Sequence

import torch

try:
    from transformers import AttentionInterface, Cache
    from transformers.cache_utils import CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "foscar.integrations.transformers needs transformers>=5: pip install 'foscar[hf]'"
    ) from e

from ..attention import CacheAttention, attach, attached
from ..cache import DecodeBatch, DecodeStep, QuantizedKVCache, check_decode_write, layer_formats
from ..cache.read import history_operands
from ..decode import BACKENDS, default_backend
from ..formats import GroupAxis, KVFormat
from ..quantize import dequantize

__all__ = [
    "ATTENTION_NAME",
    "DECODE_PATHS",
    "FoscarCache",
    "cache_kwarg",
    "foscar_attention",
    "register",
    "use_foscar_attention",
]

#: the name the attention function and its mask function are registered under
ATTENTION_NAME = "foscar"
#: how :class:`FoscarCache` attends at a decode step (its ``decode`` argument)
DECODE_PATHS = ("auto", "kernel", "dequantized")


# ---------------------------------------------------------------------------- registration
def foscar_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature).

    Parameters
    ----------
    module : the attention module (its ``layer_idx`` names the cache layer).
    query : [B, H_q, T, D]
    key, value : [B, H_kv, T, D], what ``cache.update`` returned (the new tokens).
    attention_mask : bool [B, 1, T, kv_length] (True = attend) or None (causal, no padding).

    Returns
    -------
    ``(out [B, T, H_q, D], None)``. Without a :class:`FoscarCache` in the forward pass (e.g.
    ``use_cache=False``) this is transformers' SDPA attention.
    """
    cache = attached(key)
    if not isinstance(cache, FoscarCache):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return cache._attend(module, query, key, value, attention_mask, dropout, scaling, kwargs)


#: FoscarCache accepts any attention function carrying this mark (e.g. one wrapping this one)
foscar_attention.uses_foscar_cache = True


def register(name: str = ATTENTION_NAME) -> None:
    """Register :func:`foscar_attention` and SDPA's mask function under ``name`` (idempotent).

    The mask must be registered through the classmethod: transformers' mask builder reads the
    global mapping, and without an entry it hands the attention function no mask at all.
    """
    AttentionInterface.register(name, foscar_attention)
    AttentionMaskInterface.register(name, sdpa_mask)


def use_foscar_attention(model, name: str = ATTENTION_NAME):
    """Register the ``"foscar"`` attention and select it on ``model`` (returns the model)."""
    register(name)
    model.set_attn_implementation(name)
    return model


def cache_kwarg(model) -> str:
    """The keyword ``generate``/``forward`` take a cache under: ``"cache"`` (transformers >= 5.24)
    or ``"past_key_values"`` (earlier 5.x), read from the model's ``forward`` signature."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# ---------------------------------------------------------------------------- the cache
class _LayerView(CacheLayerMixin):
    """What transformers asks a layer for; the data lives in the parent's one QuantizedKVCache.

    Do not set ``_layer_type`` here: it would register this class in transformers' global layer
    mappings.
    """

    is_compileable = False  # keeps generate from building static 4D masks or compiling
    is_croppable = False
    is_sliding = False

    def __init__(self, parent: FoscarCache, layer_idx: int) -> None:
        super().__init__()
        # a weak reference: a strong one would make every FoscarCache a reference cycle, whose
        # GPU pool outlives `del cache` until the garbage collector runs
        self._parent_ref = weakref.ref(parent)
        self._layer_idx = layer_idx

    @property
    def _parent(self) -> FoscarCache:
        parent = self._parent_ref()
        if parent is None:
            raise RuntimeError("this layer's FoscarCache no longer exists")
        return parent

    # deepcopy and pickle see a strong reference (they memoize the cache, so a copied view
    # points at the copied cache); a weakref itself would be copied as is, or not pickle at all
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_parent_ref"] = self._parent
        return state

    def __setstate__(self, state: dict) -> None:
        parent = state.pop("_parent_ref")
        self.__dict__.update(state)
        self._parent_ref = weakref.ref(parent)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._parent.update(key_states, value_states, self._layer_idx)

    def get_seq_length(self) -> int:
        return self._parent._seen[self._layer_idx]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # called before this forward's update: past tokens (pads included) plus the new ones
        return self._parent._seen[self._layer_idx] + query_length, 0

    def get_max_length(self) -> int:
        return self._parent._max_cache_len

    def get_max_cache_shape(self) -> int:  # transformers < 5.20 name of get_max_length
        return self._parent._max_cache_len

    def reset(self) -> None:
        self._parent.reset()

    def offload(self) -> None:
        raise NotImplementedError("FoscarCache does not offload layers")

    def prefetch(self) -> None:
        raise NotImplementedError("FoscarCache does not offload layers")

    def reorder_cache(self, beam_idx) -> None:
        self._parent.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self._parent.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._parent.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self._parent.batch_select_indices(indices)


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


class FoscarCache(Cache):
    """A transformers ``Cache`` storing every layer in one :class:`foscar.QuantizedKVCache`.

    Parameters
    ----------
    fmt : KVFormat or sequence of KVFormat
        K/V quantization and BF16 windows, the same for every layer; or one format per layer
        (their K and V may differ, the windows not: :func:`foscar.layer_formats`).
    config : transformers config, optional
        The model's config: gives ``num_layers``, ``num_kv_heads``, ``head_dim`` and the default
        ``max_cache_len`` (``max_position_embeddings``); sliding-window or linear-attention
        layers are rejected. Without it, pass those four explicitly.
    num_layers, num_kv_heads, head_dim : int, optional
        Override or replace the config's values.
    max_cache_len : int, optional
        Tokens one sequence may reach (prompt without its pads, plus generated tokens); sizes
        the page pool as ``max_batch_size * ceil(max_cache_len / page_size)`` pages.
    max_batch_size : int, optional
        Rows the pool is sized for (default: the batch of the first forward pass).
    page_size : int
        Tokens per page (a power of two from 16 to 256).
    backend : str
        ``decode_attention``'s backend (``"auto"``: the Triton kernel on a GPU when it covers
        the format, else the folded torch reference).
    check_finite : bool
        Reject NaN/Inf K/V (one device-to-host sync per layer and step; see foscar.cache).
    check_mask : bool
        At each decode step, check (at the first layer) that the attention mask shows each row
        exactly its stored tokens (one sync per step).
    decode : ``"auto"``, ``"kernel"`` or ``"dequantized"``
        How a decode step attends. ``"kernel"``: :func:`foscar.decode_attention` with
        ``backend``. ``"dequantized"``: every history token is dequantized once, when it
        enters the quantized history (read from the pages as the decode path reads them, kept
        in fp32 per layer and row), and each step attends in fp32 over the BF16 sink, that
        history and the BF16 tail; the same values as ``decode_attention``'s torch reference,
        to fp32 rounding, without unpacking the whole history at every step (docs/tuning.md,
        Cache write and host path, row ``FoscarCache(decode="dequantized")``), at the cost of
        an fp32 copy of the cache.
        ``"auto"`` (default): ``"dequantized"`` where ``decode_attention`` would run its torch
        reference (a CPU cache, or ``backend="reference"``), ``"kernel"`` otherwise (the GPU
        kernels); :attr:`decode_path` tells which, once the first forward pass has placed the
        cache.
    decode_write : ``"auto"``, ``"fused"`` or ``"torch"``
        How a decode step's K/V are written (:class:`foscar.QuantizedKVCache`): ``"auto"`` takes
        the fused Triton write on a GPU where it applies.

    The pool is allocated at the first forward pass, on the device of its K/V. Every check of
    the format against the model's shapes runs here, at construction.

    Example
    -------
    >>> fmt = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64))
    >>> cache = FoscarCache(fmt, model.config, max_cache_len=4096)
    >>> use_foscar_attention(model)
    >>> model.generate(**enc, max_new_tokens=64, **{cache_kwarg(model): cache})
    """

    def __init__(
        self,
        fmt: KVFormat | Sequence[KVFormat],
        config=None,
        *,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        max_cache_len: int | None = None,
        max_batch_size: int | None = None,
        page_size: int = 64,
        backend: str = "auto",
        check_finite: bool = True,
        check_mask: bool = True,
        decode: str = "auto",
        decode_write: str = "auto",
    ) -> None:
        if not isinstance(fmt, KVFormat) and (
            isinstance(fmt, (str, bytes)) or not isinstance(fmt, Sequence)
        ):
            raise TypeError(
                f"fmt must be a foscar.KVFormat or a sequence of one per layer, got "
                f"{type(fmt).__name__}"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if decode not in DECODE_PATHS:
            raise ValueError(f"decode must be one of {DECODE_PATHS}, got {decode!r}")
        check_decode_write(decode_write)  # the pool is built later, at the first forward
        cfg = _text_config(config) if config is not None else None
        if cfg is not None:
            self._check_attention_layers(cfg)
            heads = cfg.num_attention_heads
            num_layers = num_layers if num_layers is not None else cfg.num_hidden_layers
            num_kv_heads = (
                num_kv_heads
                if num_kv_heads is not None
                else getattr(cfg, "num_key_value_heads", None) or heads
            )
            head_dim = (
                head_dim
                if head_dim is not None
                else getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            )
            if max_cache_len is None:
                max_cache_len = getattr(cfg, "max_position_embeddings", None)
        for name, val in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_cache_len", max_cache_len),
        ):
            if val is None:
                raise ValueError(f"{name} is needed (pass it, or pass the model's config)")
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if max_batch_size is not None and (
            isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int)
        ):
            raise TypeError(f"max_batch_size must be an int or None, got {max_batch_size!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        # Every format/shape check of the core, now rather than at the first forward pass.
        try:
            QuantizedKVCache.check_layout(
                fmt,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                num_layers=num_layers,
                page_size=page_size,
            )
        except (ValueError, TypeError) as e:
            raise type(e)(
                f"fmt does not fit this model (num_kv_heads={num_kv_heads}, head_dim={head_dim}, "
                f"page_size={page_size}): {e}"
            ) from None
        super().__init__(layers=[_LayerView(self, i) for i in range(num_layers)])
        #: the format, or the checked tuple of one per layer
        self.fmt = fmt if isinstance(fmt, KVFormat) else layer_formats(fmt, num_layers)
        self.config = config
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._max_cache_len = max_cache_len
        self._max_batch_size = max_batch_size
        self.page_size = page_size
        #: the attention step over ``kv`` (foscar.attention), shared with the serving engine
        self._attention: CacheAttention | None = None
        self.backend = backend
        self.check_finite = check_finite
        self.check_mask = check_mask
        self.decode = decode
        self.decode_write = decode_write
        #: the one foscar cache holding every layer (allocated at the first forward pass)
        self.kv: QuantizedKVCache | None = None
        self.seq_ids: list | None = None  # one foscar sequence per batch row
        self._seen = [0] * num_layers  # positions seen per layer, pads included
        self._stored: list[list[int] | None] = [None] * num_layers  # tokens stored per row
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step: DecodeStep | None = None  # the decode step the layers are writing
        # decode="dequantized": per layer, each row's history dequantized so far (fp32)
        self._history: list[DequantizedHistory | None] = [None] * num_layers
        # decode="auto" resolved per layer at its first decode step
        self._decode_paths: list[str | None] = [None] * num_layers

    # ------------------------------------------------------------------ configuration
    @property
    def backend(self) -> str:
        """``decode_attention``'s backend for the decode steps (may be changed between
        passes)."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = name
        if self._attention is not None:
            self._attention.backend = name

    @property
    def decode_path(self) -> str | None:
        """``"kernel"`` or ``"dequantized"``: how the first layer's decode steps attend
        (``decode`` resolved; None while ``decode="auto"`` has not decoded yet)."""
        return self.decode if self.decode != "auto" else self._decode_paths[0]

    def dequantized_history(self, layer: int) -> DequantizedHistory | None:
        """``layer``'s fp32 copy of the dequantized history that ``decode="dequantized"`` attends
        over (None until that path's first decode step of the layer, or after :meth:`reset`)."""
        return self._history[layer]

    def _decode_path(self, layer: int, q: torch.Tensor) -> str:
        """``decode`` resolved for ``layer`` and queries ``q: [B, H_q, D]``: "auto" takes the
        dequantized path where ``decode_attention`` would run its torch reference."""
        if self.decode != "auto":
            return self.decode
        if self._decode_paths[layer] is None:
            backend = self.backend
            if backend == "auto":
                backend = default_backend(self.kv, q, layer)
            self._decode_paths[layer] = "dequantized" if backend == "reference" else "kernel"
        return self._decode_paths[layer]

    @staticmethod
    def _check_attention_layers(cfg) -> None:
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types:
            other = sorted(set(layer_types) - {"full_attention"})
            if other:
                raise ValueError(
                    f"FoscarCache supports full-attention layers only; the config has {other}"
                )
        elif getattr(cfg, "sliding_window", None) is not None and getattr(
            cfg, "use_sliding_window", True
        ):
            raise ValueError(
                f"FoscarCache supports full-attention layers only; the config sets "
                f"sliding_window={cfg.sliding_window}"
            )

    def _check_attention_selected(self) -> None:
        if self.config is None:
            return
        impl = getattr(self.config, "_attn_implementation", None)
        fn = AttentionInterface._global_mapping.get(impl)
        if not getattr(fn, "uses_foscar_cache", False):
            raise ValueError(
                f"FoscarCache needs the model to use foscar's attention function, but the "
                f"config selects {impl!r}: call "
                "foscar.integrations.transformers.use_foscar_attention(model) first"
            )

    # ------------------------------------------------------------------ storage
    def _allocate(self, batch_size: int, device: torch.device) -> None:
        if self._max_batch_size is not None and batch_size > self._max_batch_size:
            raise ValueError(
                f"batch of {batch_size} rows exceeds max_batch_size={self._max_batch_size}"
            )
        rows = self._max_batch_size or batch_size
        if self.kv is None or self.kv.device != torch.device(device) or self.kv.max_seqs < rows:
            pages = rows * math.ceil(self._max_cache_len / self.page_size)
            self.kv = QuantizedKVCache(
                self.fmt,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                num_pages=pages,
                max_seqs=rows,
                num_layers=self.num_layers,
                page_size=self.page_size,
                device=device,
                check_finite=self.check_finite,
                decode_write=self.decode_write,
            )
            self._attention = CacheAttention(self.kv, self.backend)
        self.seq_ids = [self.kv.add_sequence() for _ in range(batch_size)]

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int]) -> None:
        """Append ``k, v: [N, H_kv, D]`` (row 0's tokens first) with ``counts[b]`` per row."""
        with self._pool_hint():
            self._attention.store(layer, self.seq_ids, k, v, counts)
        stored = self._stored[layer] or [0] * len(counts)
        self._stored[layer] = [s + n for s, n in zip(stored, counts)]

    @contextlib.contextmanager
    def _pool_hint(self):
        """Say how to grow the pool when it is exhausted."""
        try:
            yield
        except ValueError as e:
            if "exhausted" in str(e):
                raise ValueError(
                    f"{e}; the pool holds max_cache_len={self._max_cache_len} tokens per row: "
                    "construct FoscarCache with a larger max_cache_len"
                ) from None
            raise

    # ------------------------------------------------------------------ transformers API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Park this step's K/V (``[B, H_kv, T, D]``) for the attention function; return them.

        The attention function writes them (it sees the mask) and attends; the returned tensors
        carry the cache so that it can find it.
        """
        if layer_idx in self._pending:
            raise RuntimeError(
                f"layer {layer_idx} updated twice without an attention call: the model does not "
                "use foscar's attention function (use_foscar_attention(model))"
            )
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.num_layers}), got {layer_idx}")
        if layer_idx == 0:
            self._check_attention_selected()
        b, h, t, d = key_states.shape
        if (h, d) != (self.num_kv_heads, self.head_dim) or value_states.shape != key_states.shape:
            raise ValueError(
                f"key/value states must be [batch, {self.num_kv_heads}, tokens, {self.head_dim}], "
                f"got {list(key_states.shape)} and {list(value_states.shape)}"
            )
        if self.seq_ids is not None and b != len(self.seq_ids):
            raise ValueError(
                f"batch of {b} rows, but the cache holds {len(self.seq_ids)} sequences "
                "(beam search and batch changes are not supported; reset() the cache)"
            )
        self._pending[layer_idx] = (key_states, value_states)
        self._seen[layer_idx] += t
        attach(key_states, self)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen[layer_idx] if layer_idx < self.num_layers else 0

    def reset(self) -> None:
        """Free every sequence (the pool stays allocated) and forget all positions."""
        if self.kv is not None and self.seq_ids is not None:
            for sid in self.seq_ids:
                self.kv.free(sid)
        self.seq_ids = None
        self._seen = [0] * self.num_layers
        self._stored = [None] * self.num_layers
        self._pending.clear()
        self._step = None
        self._history = [None] * self.num_layers
        self._decode_paths = [None] * self.num_layers

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "FoscarCache cannot remove tokens (quantized pages are append-only): assisted and "
            "prompt-lookup decoding are not supported"
        )

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("FoscarCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("FoscarCache does not support batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("FoscarCache does not support batch_select_indices")

    def memory_stats(self) -> dict:
        """:meth:`foscar.QuantizedKVCache.memory_stats` of the pool ({} before the first pass)."""
        return self.kv.memory_stats() if self.kv is not None else {}

    def stored_lengths(self, layer_idx: int = 0) -> list[int]:
        """Tokens stored per batch row (pads excluded) in layer ``layer_idx``."""
        return list(self._stored[layer_idx] or [])

    # ------------------------------------------------------------------ direct writes
    def load_prompt(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Write a prompt's K/V straight into an empty cache, every layer (evaluation, benchmarks).

        Parameters
        ----------
        keys, values : one ``[B, H_kv, T, D]`` tensor per layer (post-RoPE, as the model's
            ``update`` would pass them, e.g. a ``DynamicCache``'s ``layers[i].keys``).
        attention_mask : ``[B, T]`` 1 for real tokens, 0 for left padding (default: all real).

        Afterwards the cache is as if the model had prefilled the prompt through it.
        """
        if self.seq_ids is not None:
            raise ValueError("load_prompt needs an empty cache (call reset() first)")
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(
                f"keys and values need one tensor per layer ({self.num_layers}), got "
                f"{len(keys)} and {len(values)}"
            )
        b, h, t, d = keys[0].shape
        if attention_mask is None:
            vis = torch.ones(b, t, dtype=torch.bool, device=keys[0].device)
        else:
            if tuple(attention_mask.shape) != (b, t):
                raise ValueError(
                    f"attention_mask must be [batch={b}, tokens={t}], "
                    f"got {list(attention_mask.shape)}"
                )
            vis = attention_mask.to(keys[0].device).bool()
        counts = self._real_counts(vis, require_left_padding=True)
        self._allocate(b, keys[0].device)
        for layer, (k, v) in enumerate(zip(keys, values)):
            if tuple(k.shape) != (b, h, t, d) or tuple(v.shape) != (b, h, t, d):
                raise ValueError(
                    f"keys[{layer}] and values[{layer}] must be [{b}, {h}, {t}, {d}], got "
                    f"{list(k.shape)} and {list(v.shape)}"
                )
            self._append(layer, k.transpose(1, 2)[vis], v.transpose(1, 2)[vis], counts)
            self._seen[layer] = t

    def assume_prompt(self, batch_size: int, length: int, device) -> None:
        """Benchmarks only: ``batch_size`` rows of ``length`` tokens in every layer, not written.

        Decode cost does not depend on the cached values, so the pool keeps whatever it holds
        (see ``QuantizedKVCache.assume_appended``).
        """
        if self.seq_ids is not None:
            raise ValueError("assume_prompt needs an empty cache (call reset() first)")
        self._allocate(batch_size, torch.device(device))
        for sid in self.seq_ids:
            self.kv.assume_appended(sid, length)
        self._seen = [length] * self.num_layers
        self._stored = [[length] * batch_size for _ in range(self.num_layers)]

    # ------------------------------------------------------------------ attention
    @staticmethod
    def _real_counts(vis: torch.Tensor, *, require_left_padding: bool) -> list[int]:
        """Real tokens per row of ``vis: [B, T]`` bool; checks the padding is on the left."""
        if require_left_padding and vis.shape[1] > 1 and bool((vis[:, 1:] < vis[:, :-1]).any()):
            raise ValueError(
                "FoscarCache supports left padding only: the attention mask of a prefill must "
                "mark each row's real tokens as a suffix (tokenizer.padding_side = 'left')"
            )
        counts = vis.sum(dim=1).tolist()
        empty = [i for i, n in enumerate(counts) if n == 0]
        if empty:
            raise ValueError(f"rows {empty} of the batch hold no real token (all padding)")
        return counts

    @staticmethod
    def _new_token_mask(attention_mask, batch: int, t: int, device) -> torch.Tensor:
        """``[B, T]`` bool: which of this step's tokens are real, read off the mask's last query."""
        if attention_mask is None:
            return torch.ones(batch, t, dtype=torch.bool, device=device)
        last = attention_mask[:, 0, -1, -t:]
        if last.dtype != torch.bool:  # an additive float mask: 0 where attended
            last = last > torch.finfo(last.dtype).min / 2
        return last.expand(batch, t)

    def _attend(self, module, query, key, value, attention_mask, dropout, scaling, kwargs):
        layer = module.layer_idx
        if self._pending.get(layer) is None or self._pending[layer][0] is not key:
            raise RuntimeError(
                f"foscar attention for layer {layer} got K/V that FoscarCache.update did not "
                "return for it"
            )
        k, v = self._pending.pop(layer)
        bsz, _, t, _ = query.shape
        past = self._seen[layer] - t
        scaling = module.scaling if scaling is None else scaling
        if past == 0:  # prefill
            if self.seq_ids is None:
                self._allocate(bsz, k.device)
            vis = self._new_token_mask(attention_mask, bsz, t, k.device)
            counts = self._real_counts(vis, require_left_padding=True)
            self._append(layer, k.transpose(1, 2)[vis], v.transpose(1, 2)[vis], counts)
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                **kwargs,
            )
        if t == 1:
            return self._decode(layer, query, k, v, attention_mask, scaling), None
        return self._extend(layer, query, k, v, attention_mask, scaling), None

    def _decode(self, layer, query, k, v, attention_mask, scaling) -> torch.Tensor:
        step = self._step
        if step is None or layer in step.written:  # the first layer of a decode step
            if self.check_mask and attention_mask is not None:
                visible = self._visible_counts(attention_mask)
                stored = [n + 1 for n in self._stored[layer]]
                if visible != stored:
                    raise ValueError(
                        f"the attention mask shows rows {visible} tokens but the cache stores "
                        f"{stored}: FoscarCache honours left padding only, not masked tokens "
                        "inside a sequence"
                    )
            with self._pool_hint():  # every layer's lengths count the step's token from here
                step = self._step = self.kv.plan_decode_step(self.seq_ids)
        q = query[:, :, 0]
        if self._decode_path(layer, q) == "dequantized":
            self.kv.write_decode_step(layer, k[:, :, 0], v[:, :, 0], step)
            if self._history[layer] is None:
                self._history[layer] = DequantizedHistory(self._max_cache_len)
            out = self._history[layer].attend(q, self.kv, step.batches[layer], scaling)
        else:
            out = self._attention.decode_step(
                layer, q.contiguous(), k[:, :, 0], v[:, :, 0], step, scaling
            )
        self._stored[layer] = [n + 1 for n in self._stored[layer]]
        return out.unsqueeze(1)  # [B, 1, H_q, D]

    @staticmethod
    def _visible_counts(attention_mask) -> list[int]:
        last = attention_mask[:, 0, -1]
        if last.dtype != torch.bool:
            last = last > torch.finfo(last.dtype).min / 2
        return last.sum(dim=-1).tolist()

    def _extend(self, layer, query, k, v, attention_mask, scaling) -> torch.Tensor:
        """Several new tokens on a non-empty cache: dequantized past + new tokens, in torch."""
        bsz, _, t, _ = query.shape
        vis = self._new_token_mask(attention_mask, bsz, t, k.device)
        outs = [
            self._attention.extend(
                layer, sid, query[b], k[b], v[b], scaling, vis[b]
            ).transpose(0, 1)
            for b, sid in enumerate(self.seq_ids)
        ]  # each [T, H_q, D]
        counts = self._real_counts(vis, require_left_padding=False)
        self._append(layer, k.transpose(1, 2)[vis], v.transpose(1, 2)[vis], counts)
        return torch.stack(outs).to(query.dtype)  # [B, T, H_q, D]


# ---------------------------------------------------------------------------- dequantized decode
class DequantizedHistory:
    """One layer's cache as fp32 values by position, kept up to date (``decode="dequantized"``).

    ``k, v: [rows, H, capacity, D]`` float32 in the stored (rotated) coordinates: position ``p``
    of row ``i`` holds the BF16 sink or tail value, or, once ``p`` is in the quantized history,
    ``s' * y + z'`` of the operands the decode path reads through the page table
    (:func:`foscar.cache.read.history_operands`, dequantized in float64). History tokens never
    change once written (demotion appends whole quanta), so each is dequantized once, when it
    enters the history; a step copies only the new tail tokens and the newly demoted ones. The
    step then rotates ``q`` by ``R_K``, runs one fp32 softmax attention over every position
    (SDPA) and rotates the output by ``R_V^T``, as :func:`foscar.decode_attention` does.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity  # the most tokens per row (the cache's max length; 0: none)
        self.k = self.v = None  # [rows, H, capacity, D] float32
        self.done: list[int] = []  # history tokens dequantized per row
        self.copied: list[int] = []  # positions whose window value was copied per row

    def _grow(self, cache: QuantizedKVCache, rows: int, need: int) -> None:
        cap = 0 if self.k is None else self.k.shape[2]
        if self.k is not None and need <= cap and self.k.shape[0] >= rows:
            return
        # doubling, up to the cache's max length: memory follows the tokens stored
        if self.k is None or need <= cap:
            new_cap = max(need, cap)
        else:
            new_cap = max(need, min(2 * cap, self.capacity or 2 * cap))
        shape = (rows, cache.num_kv_heads, new_cap, cache.head_dim)
        k = torch.zeros(shape, dtype=torch.float32, device=cache.device)
        v = torch.zeros(shape, dtype=torch.float32, device=cache.device)
        if self.k is not None:
            k[: self.k.shape[0], :, :cap] = self.k
            v[: self.v.shape[0], :, :cap] = self.v
        self.k, self.v = k, v
        self.done += [0] * (rows - len(self.done))
        self.copied += [0] * (rows - len(self.copied))

    def _update(self, cache: QuantizedKVCache, plan: DecodeBatch) -> None:
        self._grow(cache, plan.batch_size, plan.max_seq_len)
        st = cache.layers[plan.layer]
        sink = plan.sink_tokens
        for i, (length, lq) in enumerate(zip(plan.seq_lens_host, plan.num_quantized_host)):
            slot = plan.slots_host[i]
            # BF16 sink and tail positions not copied yet (a demoted one is overwritten below)
            start = self.copied[i]
            if start < min(length, sink):
                end = min(length, sink)
                self.k[i, :, start:end] = st.k_sink[slot, :, start:end].float()
                self.v[i, :, start:end] = st.v_sink[slot, :, start:end].float()
            t0, t1 = max(start, sink + lq), length
            if t0 < t1:
                ring = ((torch.arange(t0, t1) - sink) % plan.tail_capacity).to(st.k_tail.device)
                self.k[i, :, t0:t1] = st.k_tail[slot][:, ring].float()
                self.v[i, :, t0:t1] = st.v_tail[slot][:, ring].float()
            self.copied[i] = length
            # history tokens demoted since the last step
            h0 = self.done[i]
            if lq > h0:
                for name, buf in (("k", self.k), ("v", self.v)):
                    f = cache.role_format(plan.layer, name)
                    a = h0 // f.group_size * f.group_size if f.axis is GroupAxis.CHANNEL else h0
                    y, s, z = history_operands(cache, plan, i, name, a, lq)
                    x = dequantize(y, s, z, f, dtype=torch.float64)  # [H, lq - a, D]
                    buf[i, :, sink + h0 : sink + lq] = x[:, h0 - a :].to(torch.float32)
                self.done[i] = lq

    def attend(self, q: torch.Tensor, cache: QuantizedKVCache, plan: DecodeBatch, sm_scale):
        """``q: [B, H_q, D]`` -> ``o: [B, H_q, D]`` in ``q.dtype``."""
        self._update(cache, plan)
        tr = cache.transforms[plan.layer]
        out_dtype = q.dtype
        if tr.key_rotation is not None:
            q = tr.rotate(q, "key")
        b = q.shape[0]
        lengths = plan.seq_lens_host
        n = max(lengths)
        mask = None
        if min(lengths) != n:
            pos = torch.arange(n, device=q.device)
            mask = (pos < torch.tensor(lengths, device=q.device).unsqueeze(1))[:, None, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.to(torch.float32).unsqueeze(2),  # [B, H_q, 1, D]
            self.k[:b, :, :n],
            self.v[:b, :, :n],
            attn_mask=mask,
            scale=sm_scale,
            enable_gqa=True,
        )[:, :, 0]
        if tr.value_rotation is not None:
            o = tr.rotate(o, "value", inverse=True)
        return o.to(out_dtype)
