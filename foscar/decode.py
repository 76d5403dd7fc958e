"""Public decode entry: validate -> pick a backend -> launch."""

from __future__ import annotations

import torch

from . import reference
from .cache import DecodeBatch, QuantizedKVCache

__all__ = ["decode_attention", "default_backend", "BACKENDS"]

BACKENDS = ("auto", "reference")


def default_backend(cache: QuantizedKVCache, q: torch.Tensor) -> str:
    """The backend ``"auto"`` picks for this cache and query."""
    return "reference"


def decode_attention(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    *,
    sm_scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
):
    """Attention of one query token per sequence over the quantized cache.

    Parameters
    ----------
    q : [batch, num_q_heads, head_dim]
        Queries; query head ``h`` attends to KV head ``h // (num_q_heads // num_kv_heads)``.
    cache : QuantizedKVCache
    batch : DecodeBatch
        From ``cache.plan(seq_ids, layer)``; row ``i`` of ``q`` belongs to ``batch.seq_ids[i]``.
    sm_scale : float, optional
        Logit scale (default ``1 / sqrt(head_dim)``).
    backend : ``"auto"`` or ``"reference"``
        ``"reference"`` is the folded torch computation (:func:`foscar.reference.attend_folded`)
        in fp32 (fp64 for fp64 queries).
    return_lse : bool
        Also return ``lse: [batch, num_q_heads]`` float32, the natural log of each head's softmax
        denominator over the scaled logits.

    Returns
    -------
    o : [batch, num_q_heads, head_dim] in ``q.dtype``, and ``lse`` if asked.

    Example
    -------
    >>> batch = cache.plan(seq_ids)
    >>> o = foscar.decode_attention(q, cache, batch)
    """
    if not isinstance(cache, QuantizedKVCache):
        raise TypeError(f"cache must be a QuantizedKVCache, got {type(cache).__name__}")
    if not isinstance(batch, DecodeBatch):
        raise TypeError(f"batch must be a DecodeBatch (from cache.plan), got {type(batch).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device}, expected the cache's device {cache.device}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating tensor (bfloat16 for the kernels), got {q.dtype}")
    if backend == "auto":
        backend = default_backend(cache, q)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    o, lse = reference.attend_folded(q, cache, batch, sm_scale, block_n=256, dtype=dtype)
    o = o.to(q.dtype)
    return (o, lse.to(torch.float32)) if return_lse else o
