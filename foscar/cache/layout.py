"""A sequence's layout in the cache and what it costs: which tokens are quantized, one format
per layer, stored bits per element.

A sequence of ``L`` tokens is ``[ sink: S tokens, BF16 | history: Lq tokens, quantized | tail:
BF16 ]`` with ``Lq = max(0, floor((L - S - W) / quantum)) * quantum`` (``W`` the recent window,
``quantum`` the format's demotion quantum); the package docstring has the pool tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..formats import KVFormat, QuantFormat

__all__ = ["CacheLayout", "effective_bits", "layer_formats", "num_quantized", "check_int"]


@dataclass(frozen=True)
class CacheLayout:
    """What a cache of these formats and sizes stores, without storing it: the attributes that
    the kernel backends' coverage checks (``foscar.backends.get(name).supports``) and
    :func:`foscar.cache.fused_write_reason` read of a cache, so that a caller can ask them
    before it allocates one (the serving engine's CUDA-graph check).
    :meth:`QuantizedKVCache.check_layout` checks the formats against the sizes."""

    formats: tuple[KVFormat, ...]  # one per layer
    num_kv_heads: int
    head_dim: int
    page_size: int
    window_dtype: torch.dtype
    device: torch.device

    def stored_format(self, layer: int, name: str) -> QuantFormat:
        """The QuantFormat of ``"k"`` or ``"v"`` in ``layer`` (a layout has no OSCAR transform,
        so no clip of its own)."""
        fmt = self.formats[layer]
        return fmt.key if name == "k" else fmt.value


def check_int(value, name: str, *, low: int | None = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``low``; raises naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def num_quantized(length: int, fmt: KVFormat) -> int:
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
        lq = num_quantized(num_tokens, f_layer)
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
    check_int(num_layers, "num_layers", low=1)
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
