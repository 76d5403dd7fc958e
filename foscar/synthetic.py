"""The paper's synthetic stress input for KV quantization accuracy (FOSCAR Sec. 6.2).

"Amplify eight K channels, ramp K's per-token scale along the sequence, and rescale K so that
the pre-softmax logits have unit standard deviation." The paper gives neither the gain nor the
ramp; ours are parameters: the outlier channels are multiplied by ``outlier_gain`` (default 2)
and token ``t`` of ``L`` by ``ramp[0] + (ramp[1] - ramp[0]) * t / (L-1)`` (default ``(1, 2)``).
Q, K and V start standard normal. ``foscar demo --outlier-gain G --ramp FIRST LAST`` shows how
the errors move with both.
"""

from __future__ import annotations

import math

import torch

__all__ = ["stress_inputs"]


def stress_inputs(
    num_tokens: int,
    *,
    batch: int = 1,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    outlier_channels: int = 8,
    outlier_gain: float = 2.0,
    ramp: tuple[float, float] = (1.0, 2.0),
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and a K/V history that stress quantization.

    Returns ``q: [batch, num_q_heads, head_dim]`` and ``k, v: [batch, num_tokens, num_kv_heads,
    head_dim]`` in ``dtype``; K is rescaled so that ``q . k / sqrt(head_dim)`` has unit standard
    deviation over all (sequence, head, token).
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_q_heads, head_dim, generator=g)
    k = torch.randn(batch, num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(batch, num_tokens, num_kv_heads, head_dim, generator=g)
    channels = torch.randperm(head_dim, generator=g)[:outlier_channels]
    k[..., channels] *= outlier_gain
    if num_tokens > 1:
        k *= torch.linspace(ramp[0], ramp[1], num_tokens).view(1, num_tokens, 1, 1)
    ratio = num_q_heads // num_kv_heads
    kq = k.repeat_interleave(ratio, dim=2)  # [B, L, Hq, D]
    logits = torch.einsum("bhd,blhd->bhl", q, kq) / math.sqrt(head_dim)
    k /= logits.std()
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)
