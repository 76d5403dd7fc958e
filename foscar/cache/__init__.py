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

OSCAR transforms (:meth:`QuantizedKVCache.set_transform`, :mod:`foscar.cache.transforms`): a
layer may rotate what it stores, ``k R_K`` and ``v R_V`` with orthogonal ``R`` (one per layer or
per KV head), in every segment (sink, history, tail); :func:`foscar.decode_attention` then
rotates the queries by ``R_K`` and the output by ``R_V^T``, so attention is unchanged in exact
arithmetic. A layer may also replace the format's clip ratios of K and V with its own.

NaN/Inf rule: K and V must be finite; a call with a non-finite value is rejected (one
device-to-host sync per call; pass ``check_finite=False`` to the cache to skip it, and then a
non-finite value poisons its whole group, as it would a BF16 attention).

Modules: :mod:`~foscar.cache.layout` (which tokens are quantized, per-layer formats, effective
bits), :mod:`~foscar.cache.pages` (page allocator, sequences, :class:`DecodeBatch` plans),
:mod:`~foscar.cache.transforms` (OSCAR's per-layer transforms), :mod:`~foscar.cache.write` (the
torch writers), :mod:`~foscar.cache.fused_write` (the fused decode-step write's launcher),
:mod:`~foscar.cache.decode_step` (a decode step planned once for every layer into static device
tensors: :meth:`QuantizedKVCache.plan_decode_step`, graph-capturable per-layer work),
:mod:`~foscar.cache.kv_cache` (:class:`QuantizedKVCache`, composing them),
:mod:`~foscar.cache.read` (the stored tokens read back in torch, as the kernels read them).
"""

from .decode_step import DecodeStep
from .fused_write import fused_write_reason
from .kv_cache import QuantizedKVCache
from .layout import CacheLayout, effective_bits, layer_formats
from .pages import DecodeBatch
from .transforms import LayerTransform, rotate_rows
from .write import DECODE_WRITE_PATHS, LayerStorage, check_decode_write

__all__ = [
    "CacheLayout",
    "DECODE_WRITE_PATHS",
    "DecodeBatch",
    "DecodeStep",
    "LayerStorage",
    "LayerTransform",
    "QuantizedKVCache",
    "check_decode_write",
    "effective_bits",
    "fused_write_reason",
    "layer_formats",
    "rotate_rows",
]
