"""One attention step over a :class:`~foscar.QuantizedKVCache`, per layer: what both the
transformers integration (:class:`foscar.integrations.transformers.FoscarCache`, under
``generate()``) and the serving engine (:class:`foscar.serving.core.PagedKV`, continuous
batching) do with a layer's new tokens. Each keeps only its adapter: how the model hands it the
tokens (a padded batch with a mask, or a packed step) and how its attention function is
registered; both reach their cache the one way of :func:`attach` / :func:`attached`.

:class:`CacheAttention` holds the cache, the decode backend and the decode plans:

* **store**: the new tokens of some sequences, quantized or kept in the BF16 windows as the
  format says (:meth:`QuantizedKVCache.append`);
* **prefill** (a sequence that holds nothing yet): the caller's attention over the new tokens at
  the model's precision, then store;
* **decode** (one new token per sequence, a step planned for every layer by
  :meth:`QuantizedKVCache.plan_decode_step`): :meth:`CacheAttention.decode_step` writes the
  layer's tokens and runs a :class:`foscar.DecodePlan` over the layer's batch; the plan is kept
  while that batch is (a planned step's batches are reused by every later step of as many rows),
  so its workspace and bound launches serve every step;
* **extend** (several new tokens on a non-empty sequence: a later chunk of a prefill, a continued
  conversation): :meth:`CacheAttention.extend` attends over the stored tokens, dequantized
  (foscar.cache.read), and the chunk, causal over the chunk (:func:`attend_chunk`), before the
  chunk is stored.

Shapes: ``H_q`` query heads, ``H`` KV heads, ``D`` head_dim, ``t`` a chunk's tokens.
"""

from __future__ import annotations

import torch
from torch.nn.attention.bias import causal_lower_right

from .cache import DecodeBatch, DecodeStep, QuantizedKVCache
from .cache.read import dequantize_sequence
from .decode import DecodePlan

__all__ = ["CHUNK_SCORE_BYTES", "CacheAttention", "attach", "attached", "attend_chunk"]

#: the attribute of a layer's new key tensor that names the object attending for it
ATTACHED = "foscar_attention"


def attach(key_states: torch.Tensor, owner) -> None:
    """Tag a layer's new keys with ``owner``, the cache object whose attention function will
    receive them: a transformers model calls the cache's ``update`` and then the attention
    function, which is never handed the cache."""
    setattr(key_states, ATTACHED, owner)


def attached(key: torch.Tensor):
    """The owner :func:`attach` tagged ``key`` with, or None."""
    return getattr(key, ATTACHED, None)


#: bytes of fp32 attention scores ``[H_q, rows, L]`` that :func:`attend_chunk` computes at once:
#: a chunk's queries go through in blocks of rows under it, so a chunk of 8192 tokens on a
#: 32K history with 32 query heads (42 GB of scores, twice over in softmax) fits any device
CHUNK_SCORE_BYTES = 256 * 2**20


def attend_chunk(
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    i: int,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    sm_scale: float,
    new_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a chunk of new tokens over sequence ``i``'s stored tokens (dequantized) and
    the chunk itself, causal over the chunk: how several new tokens on a non-empty sequence
    attend before they are appended (a chunked prefill's later chunks).

    ``q: [H_q, t, D]``, ``k_new, v_new: [H_kv, t, D]``; ``new_mask: bool [t]`` marks the chunk's
    real tokens (``None``: all of them). Returns ``[H_q, t, D]`` float32.

    A query in bf16 or fp16 with every token real attends in its own dtype through one fused
    SDPA call (bottom-right causal: a chunk's token sees the whole history and the chunk
    up to itself), as the model's own prefill does; otherwise in fp32, in blocks of query rows
    whose scores stay under :data:`CHUNK_SCORE_BYTES`.
    """
    fused = new_mask is None and q.dtype in (torch.bfloat16, torch.float16)
    dtype = q.dtype if fused else torch.float32
    k_past, v_past = dequantize_sequence(cache, batch, i, dtype=torch.float32)
    num_q_heads, t, _ = q.shape
    group = num_q_heads // k_new.shape[0]
    keys = torch.cat([k_past.to(dtype), k_new.to(dtype)], dim=1).repeat_interleave(group, dim=0)
    vals = torch.cat([v_past.to(dtype), v_new.to(dtype)], dim=1).repeat_interleave(group, dim=0)
    q = q.to(dtype)
    if fused:
        bias = causal_lower_right(t, keys.shape[1])
        o = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), attn_mask=bias, scale=sm_scale
        )
        return o[0].float()
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if new_mask is not None:
        causal = causal & new_mask.unsqueeze(0)
    mask = torch.cat(
        [torch.ones(t, k_past.shape[1], dtype=torch.bool, device=q.device), causal], dim=1
    )
    rows = max(1, CHUNK_SCORE_BYTES // (num_q_heads * keys.shape[1] * 4))
    if rows >= t:
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, scale=sm_scale
        )
    out = torch.empty_like(q)
    for r in range(0, t, rows):  # each query row's softmax is its own: blocks change no value
        out[:, r : r + rows] = torch.nn.functional.scaled_dot_product_attention(
            q[:, r : r + rows], keys, vals, attn_mask=mask[r : r + rows], scale=sm_scale
        )
    return out


class CacheAttention:
    """The attention step of one :class:`QuantizedKVCache` (module docstring); ``backend``:
    :func:`foscar.decode_attention`'s."""

    def __init__(self, cache: QuantizedKVCache, backend: str = "auto") -> None:
        self.cache = cache
        #: (layer, rows) -> the decode plan of the latest batch of that layer and size
        self._decode_plans: dict[tuple[int, int], DecodePlan] = {}
        self.backend = backend

    # copies (deepcopy, pickle) make their plans again: a plan's bound launches hold compiled
    # kernels of this process
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_decode_plans": {}}

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        """Another backend: the decode plans are made again."""
        self._backend = name
        self._decode_plans.clear()

    def store(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor, counts) -> None:
        """Store ``k, v: [N, H, D]`` (the first sequence's tokens first), ``counts[i]`` of
        ``seq_ids[i]``, into ``layer``."""
        self.cache.append(list(seq_ids), k, v, list(counts), layer=layer)

    def extend(
        self,
        layer: int,
        seq_id,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scaling: float,
        new_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q: [H_q, t, D]``, ``k, v: [H, t, D]`` of a chunk on ``seq_id``'s stored tokens of
        ``layer`` -> ``[H_q, t, D]`` float32 (:func:`attend_chunk`; ``new_mask: bool [t]``, the
        chunk's real tokens). Call it before the chunk is stored."""
        batch = self.cache.plan([seq_id], layer)
        return attend_chunk(self.cache, batch, 0, q, k, v, scaling, new_mask)

    def plan_decode(self, batch: DecodeBatch, q: torch.Tensor, scaling: float) -> DecodePlan:
        """The decode plan of ``batch`` (its layer) for queries like ``q``, made once per batch
        object, heads, dtype and scale."""
        key = (batch.layer, batch.batch_size)
        plan = self._decode_plans.get(key)
        if (
            plan is None
            or plan.batch is not batch
            or plan.num_q_heads != q.shape[1]
            or plan.q_dtype != q.dtype
            or plan.sm_scale != scaling
        ):
            plan = DecodePlan(
                self.cache,
                batch,
                num_q_heads=q.shape[1],
                q_dtype=q.dtype,
                sm_scale=scaling,
                backend=self.backend,
            )
            self._decode_plans[key] = plan
        return plan

    def decode(self, batch: DecodeBatch, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """``q: [B, H_q, D]`` over ``batch`` (its layer) -> ``[B, H_q, D]`` in q's dtype."""
        return self.plan_decode(batch, q, scaling).run(q)

    def decode_step(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        step: DecodeStep,
        scaling: float,
    ) -> torch.Tensor:
        """A planned decode step in ``layer``: write ``k, v: [step.rows, H, D]`` and attend
        ``q: [step.rows, H_q, D]`` (contiguous) over ``step.batches[layer]`` -> ``[step.rows,
        H_q, D]`` in q's dtype. No host bookkeeping and nothing copied to the device, so a
        CUDA graph may capture it (:meth:`QuantizedKVCache.write_decode_step`)."""
        self.cache.write_decode_step(layer, k, v, step)
        return self.decode(step.batches[layer], q, scaling)
