"""Calibration statistics at the positions a served context spans, from short sequences.

The cache stores post-RoPE keys, so what a key looks like depends on its position: RoPE turns
channel pair ``i`` by ``t * theta_i``, and its slow pairs turn through only part of a circle in
a few thousand positions. Rotations, GPTQ factors and clips taken over positions 0-2K then
describe keys at 0-2K; keys at 4-8K sit at other phases (SmolLM2's 8K perplexity gap of INT2
keys fell from +27% to +9% when the calibration ran at 8K positions).

A **RoPE shift** gives those positions without longer sequences: turning a sequence's post-RoPE
queries and keys together by ``RoPE(delta)`` leaves every score ``q . k`` (so the attention)
unchanged, since RoPE's rotations compose (``RoPE(t + delta) = RoPE(delta) RoPE(t)``) and the
score depends on ``RoPE(s - t)`` alone, while moving the vectors the quantizer sees to the
phases of positions ``t + delta``. Values carry no RoPE and are not shifted. Statistics over
the shifted copies of a sequence are its statistics at the shifted positions.

- :func:`position_shifts`: the shifts of ``seq_len``-token sequences that cover positions
  ``0 .. context - 1``;
- :func:`rope_shifter`: ``shift(x, delta)`` for a transformers model's RoPE (its own rotary
  embedding module, so scaled RoPE variants shift as the model rotates);
- :func:`shifted_views`: what :func:`foscar.oscar.calibrate`, :func:`~foscar.oscar.fit_clips`
  and the other calibration passes read for each attention call, one ``(q, k)`` per shift
  (:func:`check_shifts` validates the shifts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["position_shifts", "rope_shifter", "check_shifts", "shifted_views", "MAX_SHIFTS"]

#: at most this many shifts by default: the slow RoPE pairs turn smoothly with position, so a
#: few phases of them describe a long context (and every shift costs a clip fit of its own)
MAX_SHIFTS = 8


def position_shifts(
    seq_len: int, context: int | None, max_shifts: int = MAX_SHIFTS
) -> tuple[int, ...]:
    """RoPE shifts under which ``seq_len``-token sequences cover positions ``0 .. context - 1``.

    ``(0,)`` when ``context`` is None or at most ``seq_len``. Otherwise ``0``, then steps of
    ``seq_len`` (each shifted copy starts where the last one ends) up to ``context - seq_len``
    (the last copy ends at the context's end); when that takes more than ``max_shifts``,
    ``max_shifts`` shifts spread evenly over ``0 .. context - seq_len``.

    >>> position_shifts(2048, 8192)
    (0, 2048, 4096, 6144)
    >>> position_shifts(2048, 5000)
    (0, 2048, 2952)
    """
    for name, value in (("seq_len", seq_len), ("max_shifts", max_shifts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if context is None:
        return (0,)
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be None or an int >= 1, got {context!r}")
    last = context - seq_len
    if last <= 0:
        return (0,)
    shifts = sorted({*range(0, last + 1, seq_len), last})
    if len(shifts) > max_shifts:
        if max_shifts == 1:
            return (0,)
        shifts = sorted({round(i * last / (max_shifts - 1)) for i in range(max_shifts)})
    return tuple(int(s) for s in shifts)


def _rotary_embedding(model) -> torch.nn.Module:
    """The model's rotary embedding module (transformers: ``model.model.rotary_emb``), whose
    ``inv_freq`` the shifts read; ValueError if there is none, or several with different
    frequencies (e.g. one RoPE for local and one for global layers)."""
    found = [
        m
        for m in model.modules()
        if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq")
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no rotary embedding module (…RotaryEmbedding with "
            "inv_freq): position shifts need a RoPE model"
        )
    first = found[0].inv_freq
    if any(m.inv_freq.shape != first.shape or not torch.equal(m.inv_freq, first) for m in found):
        raise ValueError(
            f"{type(model).__name__} has rotary embeddings of different frequencies (one per "
            "layer type): position shifts need one RoPE for every layer"
        )
    return found[0]


def rope_shifter(model) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``shift(x, delta)``: post-RoPE rows ``x: [heads, T, head_dim]`` as if every token sat
    ``delta`` positions later (float32 out; ``delta = 0`` returns ``x`` itself).

    The turn is ``RoPE(delta)`` of the model's own frequencies (its rotary module's
    ``inv_freq``, so linear, NTK and YaRN variants shift as the model rotates), without the
    module's ``attention_scaling`` (a factor on RoPE(t)'s cos and sin, not a turn), with the
    angles taken in float64. transformers' Llama-family layout: channel ``i`` pairs with
    ``i + rot/2`` (``rotate_half``) over the first ``rot = 2 * len(inv_freq)`` channels (all of
    them unless the model has a partial rotary factor). Dynamic-NTK RoPE, whose frequencies
    change with the sequence length, shifts at the frequencies the module holds.
    """
    inv_freq = _rotary_embedding(model).inv_freq.detach().to("cpu", torch.float64)
    rot = 2 * inv_freq.numel()
    turns: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def shift(x: torch.Tensor, delta: int) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"x must be [heads, tokens, head_dim], got {list(x.shape)}")
        if rot > x.shape[-1]:
            raise ValueError(f"the model's RoPE turns {rot} channels; x has {x.shape[-1]}")
        if delta == 0:
            return x
        xf = x.float()
        key = (int(delta), x.device)
        if key not in turns:
            angle = torch.cat([inv_freq, inv_freq]) * int(delta)
            turns[key] = (angle.cos().float().to(x.device), angle.sin().float().to(x.device))
        cos, sin = turns[key]
        xr, rest = xf[..., :rot], xf[..., rot:]
        half = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], dim=-1)
        return torch.cat([xr * cos + half * sin, rest], dim=-1)

    return shift


def check_shifts(position_shifts) -> tuple[int, ...]:
    """``position_shifts`` as a tuple of distinct ints >= 0 (at least one), else ValueError."""
    shifts = tuple(position_shifts)
    if (
        not shifts
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shifts)
        or len(set(shifts)) != len(shifts)
    ):
        raise ValueError(
            f"position_shifts must be distinct ints >= 0 (at least one), got {position_shifts!r}"
        )
    return shifts


def shifted_views(model, position_shifts) -> Callable:
    """``views(q, k)``: the list of ``(q', k')`` that each of ``position_shifts`` turns one
    attention call's post-RoPE ``q: [H_q, T, d]``, ``k: [H_kv, T, d]`` into (a shift of 0 gives
    ``q, k`` themselves). With the shifts ``(0,)`` the model need not have RoPE."""
    shifts = check_shifts(position_shifts)
    if shifts == (0,):
        return lambda q, k: [(q, k)]
    shift = rope_shifter(model)
    return lambda q, k: [(shift(q, s), shift(k, s)) for s in shifts]
