"""Calibrating the clipping ratios of the clipped formats on a text the evaluation never reads.

OSCAR clips each token to ``[-tau, tau]``, ``tau`` the ``p``-th percentile of its ``|x|``, with
``p_K = 0.96``, ``p_V = 0.92`` for head_dim 128; how ``p`` was chosen is not published
(oscar.md Sec. 3). Here ``p`` is fitted per bit width and group axis: one prefill over the
calibration text captures every layer's post-RoPE Q, K and V; for each candidate ``p``, K alone
(V exact) and V alone (K exact) are quantized-dequantized over the whole text, and the relative
error of the causal attention output of ``num_queries`` query positions spread over the text's
second half to its end is averaged over layers. The ratio with the smallest mean error wins
(``p = 1`` is min-max: clipping may lose).
"""

from __future__ import annotations

import torch

from ..formats import QuantFormat
from ..quantize import dequantize, quantize

__all__ = ["CANDIDATES", "calibrate_clips", "fake_quantize"]

CANDIDATES = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8)
_ATTENTION = "foscar_calibrate"


def fake_quantize(x: torch.Tensor, f: QuantFormat) -> torch.Tensor:
    """Quantize-dequantize ``x: [H, T, D]`` as the cache would (BF16 first); channel-wise
    groups cover the first ``T // g * g`` tokens, the rest stays BF16. Returns float32."""
    x = x.to(torch.bfloat16)
    t = x.shape[1] if f.axis.value == "token" else x.shape[1] // f.group_size * f.group_size
    codes, scale, offset = quantize(x[:, :t], f)
    q = dequantize(codes, scale, offset, f, dtype=torch.float32)
    return torch.cat([q, x[:, t:].float()], dim=1)


def _attention(q, k, v, positions, scaling):
    """Causal attention of queries ``q: [H_q, n, D]`` at ``positions`` over ``k, v: [H_kv, T,
    D]``; returns ``[H_q, n, D]``."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = torch.einsum("hnd,htd->hnt", q, k) * scaling
    visible = torch.arange(k.shape[1], device=k.device).unsqueeze(0) <= positions.unsqueeze(1)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,htd->hnd", torch.softmax(s, -1), v)


def _layer_errors(q, k, v, scaling, group_size, num_queries, grid):
    """``{(bits, axis, "k"|"v", p): relative error}`` for one layer (batch 1)."""
    t = k.shape[1]
    positions = torch.linspace(t // 2, t - 1, num_queries, device=q.device).round().long()
    qs = q[:, positions].float()
    k, v = k.float(), v.float()
    exact = _attention(qs, k, v, positions, scaling)
    norm = exact.norm()
    out = {}
    for bits, axis in grid:
        for p in CANDIDATES:
            f = QuantFormat(bits, axis, group_size, None if p == 1.0 else p)
            ek = _attention(qs, fake_quantize(k, f), v, positions, scaling)
            ev = _attention(qs, k, fake_quantize(v, f), positions, scaling)
            out[(bits, axis, "k", p)] = float((ek - exact).norm() / norm)
            out[(bits, axis, "v", p)] = float((ev - exact).norm() / norm)
    return out


@torch.no_grad()
def calibrate_clips(model, input_ids: torch.Tensor, *, num_queries: int = 64, log=None):
    """Fit ``p_K, p_V`` per ``(bits, axis)`` on ``input_ids: [1, T]``.

    Returns ``(clips, table)``: ``clips[(bits, axis)] = (p_K, p_V)`` and
    ``table[(bits, axis, "k"|"v")] = {p: mean relative error over layers}``.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    group_size = min(head_dim, 128)
    grid = [(b, a) for b in (4, 2) for a in ("token", "channel")]
    per_layer = []

    def capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        errors = _layer_errors(query[0], key[0], value[0], scaling, group_size, num_queries, grid)
        per_layer.append(errors)
        if log:
            log(f"calibration: layer {module.layer_idx} done")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
        )

    AttentionInterface.register(_ATTENTION, capture)
    AttentionMaskInterface.register(_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_ATTENTION)
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    table, clips = {}, {}
    for bits, axis in grid:
        best = []
        for role in ("k", "v"):
            mean = {
                p: sum(e[(bits, axis, role, p)] for e in per_layer) / len(per_layer)
                for p in CANDIDATES
            }
            table[(bits, axis, role)] = mean
            best.append(min(mean, key=mean.get))
        clips[(bits, axis)] = tuple(best)
    return clips, table
