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
  conversation): :meth:`CacheAttention.extend` attends over the stored tokens and the chunk,
  causal over the chunk (:func:`foscar.backends.extend.extend_attention`: the history dequantized in
  torch; the extend kernel on request), before the chunk is stored.

Shapes: ``H_q`` query heads, ``H`` KV heads, ``D`` head_dim, ``t`` a chunk's tokens.
"""

from __future__ import annotations

import torch

from .backends.extend import extend_attention
from .cache import DecodeBatch, DecodeStep, QuantizedKVCache
from .decode import DecodePlan

__all__ = ["CacheAttention", "attach", "attached"]

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
        ``layer`` -> ``[H_q, t, D]`` in q's dtype (:func:`foscar.backends.extend.extend_attention`;
        ``new_mask: bool [t]``, the chunk's real tokens). Call it before the chunk is stored."""
        batch = self.cache.plan([seq_id], layer)
        o = extend_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.cache, batch, 0,
            scaling, new_mask=new_mask,
        )  # [t, H_q, D]
        return o.transpose(0, 1)

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
