"""Pure-torch references for decode attention over a :class:`~foscar.cache.QuantizedKVCache`:
the oracles the tests compare the kernels and the production torch paths against. Production
code never imports this module.

(a) :func:`attend_dequantized` dequantizes every stored value (``x = s' * y + z'``, read by
    :func:`foscar.cache.read.dequantize_sequence`) and runs plain softmax attention in fp64 (or
    fp32): the ground truth every kernel is tested against.
(b) :func:`attend_folded` never dequantizes a value: it computes the way a FOSCAR kernel does
    (tiles, the four affine folds, online softmax, split-KV partials, the BF16 windows as further
    partials). It is the ``"reference"`` backend's computation, kept in
    :mod:`foscar.backends.folded` and re-exported here with its helpers, so that tests find
    both references in one place.

Shapes: ``q: [batch, num_q_heads, head_dim]``; query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)``. Outputs ``o: [batch, num_q_heads, head_dim]`` and
``lse: [batch, num_q_heads]`` (natural log of the softmax denominator of the scaled logits).
"""

from __future__ import annotations

import math

import torch

from .backends.folded import attend_folded, merge_partials, split_tiles
from .cache import DecodeBatch, QuantizedKVCache
from .cache.read import dequantize_sequence, history_operands

__all__ = [
    "attend_dequantized",
    "attend_folded",
    "attention",
    "dequantize_sequence",
    "history_operands",
    "merge_partials",
    "split_tiles",
]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float):
    """Softmax attention of grouped queries ``q: [H, hq, D]`` over ``k, v: [H, L, D]``.

    Returns ``o: [H, hq, D]`` and ``lse: [H, hq]`` in the dtype of the inputs.
    """
    s = torch.einsum("hqd,hld->hql", q, k) * sm_scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("hql,hld->hqd", p, v), lse


def attend_dequantized(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (a): dequantize the whole cache, then attend in ``dtype``.

    Returns ``o: [batch, num_q_heads, head_dim]`` and ``lse: [batch, num_q_heads]`` in ``dtype``.
    """
    hq = cache.check_query(q, batch)
    cache.check_plan(batch)
    sm_scale = 1.0 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    h, d = cache.num_kv_heads, cache.head_dim
    outs, lses = [], []
    for i in range(batch.batch_size):
        k, v = dequantize_sequence(cache, batch, i, dtype)
        o, lse = attention(q[i].to(dtype).reshape(h, hq, d), k, v, sm_scale)
        outs.append(o.reshape(h * hq, d))
        lses.append(lse.reshape(h * hq))
    return torch.stack(outs), torch.stack(lses)
