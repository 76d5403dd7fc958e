"""Capture what a transformers model's attention layers see: post-RoPE Q, K, V per layer.

transformers (5.x) hands every attention layer's post-RoPE ``query [B, H_q, T, d]``, ``key`` and
``value [B, H_kv, T, d]`` to the function registered under the config's attention
implementation. :func:`capture_attention` registers one that calls ``callback(layer, q, k, v,
scaling)`` with the batch's single row (``q: [H_q, T, d]``, ``k, v: [H_kv, T, d]``) and then
runs SDPA, so the forward pass is the model's own. Exactly what the KV cache stores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["attention_implementation", "capture_attention", "model_shapes"]

_NAME = "foscar_oscar_capture"


def model_shapes(model) -> dict:
    """``num_layers``, ``num_q_heads``, ``num_kv_heads``, ``head_dim`` and ``max_positions``
    (``max_position_embeddings``, None if the config has none) of a transformers model."""
    get = getattr(model.config, "get_text_config", None)
    cfg = get(decoder=True) if get is not None else model.config
    heads = cfg.num_attention_heads
    return {
        "num_layers": cfg.num_hidden_layers,
        "num_q_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "max_positions": getattr(cfg, "max_position_embeddings", None),
    }


@contextmanager
def attention_implementation(model, name: str, attention: Callable) -> Iterator[None]:
    """Within the block, ``model``'s attention layers call ``attention`` (transformers'
    attention-function signature, registered under ``name`` with SDPA's mask); the model's
    previous attention implementation comes back on exit."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def capture_attention(
    model, callback: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], None]
) -> Iterator[None]:
    """Within the block, every attention call of ``model`` first calls ``callback``.

    Forward one sequence at a time (batch 1, no padding): the callback sees the causal
    attention of that one row. The model's previous attention implementation comes back on
    exit.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        if query.shape[0] != 1:
            raise ValueError(
                f"capture_attention forwards one sequence at a time, got a batch of "
                f"{query.shape[0]}"
            )
        scaling = module.scaling if scaling is None else scaling
        callback(module.layer_idx, query[0], key[0], value[0], float(scaling))
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
        )

    with attention_implementation(model, _NAME, attention):
        yield
