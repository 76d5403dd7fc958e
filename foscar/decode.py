"""Public decode entry: validate, pick a backend, launch."""

from __future__ import annotations

import torch

from . import reference
from .cache import DecodeBatch, QuantizedKVCache

__all__ = ["decode_attention", "BACKENDS"]

BACKENDS = ("auto", "reference")


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
    return_lse : also return ``lse: [batch, num_q_heads]`` float32 (natural log).

    Returns
    -------
    o : [batch, num_q_heads, head_dim] in ``q.dtype`` (and ``lse`` if asked).
    """
    if not isinstance(cache, QuantizedKVCache):
        raise TypeError(f"cache must be a QuantizedKVCache, got {type(cache).__name__}")
    if not isinstance(batch, DecodeBatch):
        raise TypeError(f"batch must be a DecodeBatch (from cache.plan), got {type(batch).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(q, torch.Tensor) and q.device != cache.device:
        raise ValueError(f"q is on {q.device}, expected the cache's device {cache.device}")
    dtype = torch.float64 if isinstance(q, torch.Tensor) and q.dtype == torch.float64 else torch.float32
    o, lse = reference.attend_folded(q, cache, batch, sm_scale, block_n=256, dtype=dtype)
    o = o.to(q.dtype)
    return (o, lse.to(torch.float32)) if return_lse else o
