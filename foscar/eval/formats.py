"""The KV formats ``foscar eval`` compares.

Groups of ``g = min(head_dim, 128)`` (a whole head row for SmolLM2's head_dim 64: one scale and
offset per token and head, as OSCAR's released configuration has for head_dim 128; 64 tokens of
a channel for channel-wise groups). Clipped formats use per-token clipping ratios ``p_K, p_V``
calibrated on a separate text (:mod:`foscar.eval.clips`); KIVI is channel-wise K with
token-wise V, min-max; windows are OSCAR's 64 sink + 256 recent BF16 tokens.

The clipped rows clip an unrotated cache: OSCAR's clipping without OSCAR's rotation. On SmolLM2
it loses to min-max (post-RoPE K has one channel per head 2-4x larger than all others, and even
the mildest ratio, p = 0.98 = the largest of 64 values, cuts exactly that channel).

More rows: anything with ``name``, ``fmt``, ``bits`` and a ``make_cache(model, prefill,
extra_tokens)`` method (e.g. a rotated cache) can be passed to
:func:`foscar.eval.harness.evaluate` as ``extra_formats``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats import KVFormat, QuantFormat

__all__ = ["EvalFormat", "eval_formats", "bf16_format", "SINK", "RECENT"]

SINK, RECENT = 64, 256


@dataclass(frozen=True)
class EvalFormat:
    """One row of ``foscar eval``: a name, the cache format, its nominal bits (16 for BF16)."""

    name: str
    fmt: KVFormat
    bits: int

    def make_cache(self, model, prefill, extra_tokens: int):
        """A :class:`FoscarCache` in this format holding ``prefill``, with room for
        ``extra_tokens`` more tokens per row."""
        from .metrics import make_cache

        return make_cache(model, self.fmt, prefill, extra_tokens)


def bf16_format(head_dim: int, max_len: int) -> KVFormat:
    """Every token in the BF16 window: the BF16 cache, read through the same decode path."""
    g = min(head_dim, 128)
    return KVFormat(QuantFormat(4, "token", g), QuantFormat(4, "token", g), recent_tokens=max_len)


def eval_formats(
    head_dim: int, max_len: int, clips: dict[tuple[int, str], tuple[float, float]]
) -> list[EvalFormat]:
    """BF16, then INT4 and INT2 in every variant.

    ``clips[(bits, axis)] = (p_K, p_V)``: calibrated clipping ratios per bit width and axis.
    """
    g = min(head_dim, 128)
    rows = [EvalFormat("BF16", bf16_format(head_dim, max_len), 16)]
    for bits in (4, 2):
        for axis in ("token", "channel"):
            rows.append(
                EvalFormat(
                    f"INT{bits} {axis} min-max",
                    KVFormat(QuantFormat(bits, axis, g), QuantFormat(bits, axis, g)),
                    bits,
                )
            )
            pk, pv = clips[(bits, axis)]
            rows.append(
                EvalFormat(
                    f"INT{bits} {axis} clipped",
                    KVFormat(QuantFormat(bits, axis, g, pk), QuantFormat(bits, axis, g, pv)),
                    bits,
                )
            )
        kivi = KVFormat(QuantFormat(bits, "channel", g), QuantFormat(bits, "token", g))
        rows.append(EvalFormat(f"INT{bits} KIVI (K channel, V token)", kivi, bits))
    # INT4 with BF16 windows, and with groups of 32 (the paper's "INT4 within 1% of BF16")
    for name, kg, vg, ka in (
        (f"INT4 KIVI + BF16 {SINK}/{RECENT}", g, g, "channel"),
        (f"INT4 KIVI g32 + BF16 {SINK}/{RECENT}", 32, 32, "channel"),
        (f"INT4 token g32 + BF16 {SINK}/{RECENT}", 32, 32, "token"),
    ):
        fmt = KVFormat(
            QuantFormat(4, ka, min(kg, g)),
            QuantFormat(4, "token", min(vg, g)),
            sink_tokens=SINK,
            recent_tokens=RECENT,
        )
        rows.append(EvalFormat(name, fmt, 4))
    g2 = [QuantFormat(2, "channel", g), QuantFormat(2, "token", g)]
    rows.append(
        EvalFormat(
            f"INT2 KIVI + BF16 {SINK}/{RECENT}",
            KVFormat(*g2, sink_tokens=SINK, recent_tokens=RECENT),
            2,
        )
    )
    pk, pv = clips[(2, "token")]
    rows.append(
        EvalFormat(
            f"INT2 token clipped + BF16 {SINK}/{RECENT}",
            KVFormat(
                QuantFormat(2, "token", g, pk),
                QuantFormat(2, "token", g, pv),
                sink_tokens=SINK,
                recent_tokens=RECENT,
            ),
            2,
        )
    )
    return rows
