"""What KV cache a server runs: the ``kv`` argument of :func:`foscar.serving.build_manager`.

Spellings (:func:`parse_kv` for command lines, :func:`resolve_kv` for a model):

- ``"bf16"`` (or ``"sdpa-bf16"``): the engine's own paged cache, unchanged (no foscar), attended
  by the engine's paged SDPA path;
- ``"flashinfer-bf16"``, ``"flashinfer-fp8"``: BF16 or FP8 (E4M3, per-layer ``k_scale`` /
  ``v_scale``) paged caches attended by FlashInfer's paged prefill and decode kernels, the
  baselines vLLM and SGLang users run (:mod:`foscar.serving.flashinfer_kv`; a CUDA device and
  the ``flashinfer`` package);
- ``"int4"``, ``"int2"``: token-wise min-max groups of ``min(head_dim, 128)`` channels for K and
  V, with OSCAR's BF16 windows (64 sink and 256 recent tokens);
- a :class:`foscar.KVFormat`, or a sequence of one per layer (:func:`foscar.layer_formats`);
- the path of an OSCAR calibration file (:class:`foscar.oscar.OscarRotations`): its rotations,
  its fitted clip ratios for each layer's widths, and its per-layer widths. The widths, group
  and windows are read from the file's header when it names them (``"key_bits"`` and
  ``"value_bits"``: one width, 2 or 4, per layer; ``"group_size"``; ``"windows"``:
  ``[sink, recent]``), else INT2 everywhere with the defaults above.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .. import KVFormat, QuantFormat, layer_formats

__all__ = [
    "FLASHINFER_KVS",
    "KV_NAMES",
    "KVSpecError",
    "ResolvedKV",
    "SINK_TOKENS",
    "RECENT_TOKENS",
    "default_format",
    "parse_kv",
    "resolve_kv",
]

#: the named choices of ``--kv``
KV_NAMES = ("sdpa-bf16", "flashinfer-bf16", "flashinfer-fp8", "bf16", "int4", "int2")
#: the FlashInfer caches by name: their storage (:mod:`foscar.serving.flashinfer_kv`)
FLASHINFER_KVS = {"flashinfer-bf16": "bf16", "flashinfer-fp8": "fp8"}
#: OSCAR's BF16 windows, the default of the named formats
SINK_TOKENS, RECENT_TOKENS = 64, 256


class KVSpecError(ValueError, argparse.ArgumentTypeError):
    """A ``kv`` value that names no cache; as an argparse ``type`` error, argparse prints the
    message as it is."""


def parse_kv(text: str) -> str:
    """Read a ``--kv`` value: one of :data:`KV_NAMES` (any case) or the path of an existing
    OSCAR calibration file; returns the name in lower case or the path.

    Usable as an argparse ``type`` (its errors are :class:`KVSpecError`, one line).
    """
    if not isinstance(text, str) or not text.strip():
        raise KVSpecError(f"kv must be one of {', '.join(KV_NAMES)} or an OSCAR file, got {text!r}")
    name = text.strip().lower()
    if name in KV_NAMES:
        return name
    if os.path.isfile(text):
        return text
    raise KVSpecError(
        f"kv must be one of {', '.join(KV_NAMES)} or the path of an OSCAR calibration file; "
        f"{text!r} is neither"
    )


def default_format(bits: int, head_dim: int, *, group_size: int | None = None,
                   sink: int = SINK_TOKENS, recent: int = RECENT_TOKENS) -> KVFormat:
    """Token-wise min-max K and V of ``bits`` with BF16 windows (the ``"int<bits>"`` format)."""
    g = group_size or min(head_dim, 128)
    return KVFormat(
        QuantFormat(bits, "token", g),
        QuantFormat(bits, "token", g),
        sink_tokens=sink,
        recent_tokens=recent,
    )


@dataclass(frozen=True)
class ResolvedKV:
    """A ``kv`` argument made concrete for one model: ``formats`` one per layer (None: the
    engine's BF16 cache or a FlashInfer one), ``rotations`` (OscarRotations or None) and
    ``clip_bits`` for :func:`foscar.oscar.apply_to_cache`; ``flashinfer``: the storage of a
    FlashInfer cache (``"bf16"`` or ``"fp8"``; None otherwise); ``label``: how logs and
    results name it."""

    label: str
    formats: tuple[KVFormat, ...] | None
    rotations: object = None
    clip_bits: object = None
    flashinfer: str | None = None

    @property
    def is_bf16(self) -> bool:
        """The engine's own BF16 cache (no foscar storage, no FlashInfer)."""
        return self.formats is None and self.flashinfer is None


def resolve_kv(
    kv, *, num_layers: int, head_dim: int, num_kv_heads: int | None = None
) -> ResolvedKV:
    """``kv`` (module docstring) for a model of ``num_layers`` layers of ``head_dim`` channels
    (``num_kv_heads``: to check per-head rotations). Raises ``ValueError`` naming what does not
    fit."""
    if isinstance(kv, KVFormat):
        kv.check_head_dim(head_dim)
        return ResolvedKV(kv.short(), layer_formats(kv, num_layers))
    if isinstance(kv, Sequence) and not isinstance(kv, (str, bytes)):
        formats = layer_formats(kv, num_layers)
        for i, f in enumerate(formats):
            try:
                f.check_head_dim(head_dim)
            except ValueError as e:
                raise ValueError(f"kv[{i}]: {e}") from None
        return ResolvedKV("per-layer", formats)
    if isinstance(kv, os.PathLike):
        kv = os.fspath(kv)
    if not isinstance(kv, str):
        raise TypeError(
            f"kv must be a name ({', '.join(KV_NAMES)}), a KVFormat, a list of them or a path, "
            f"got {type(kv).__name__}"
        )
    name = parse_kv(kv)
    if name in ("bf16", "sdpa-bf16"):
        return ResolvedKV(name, None)
    if name in FLASHINFER_KVS:
        return ResolvedKV(name, None, flashinfer=FLASHINFER_KVS[name])
    if name in ("int4", "int2"):
        fmt = default_format(int(name[3]), head_dim)
        return ResolvedKV(name, (fmt,) * num_layers)
    return _oscar(name, num_layers=num_layers, head_dim=head_dim, num_kv_heads=num_kv_heads)


def _oscar(path: str, *, num_layers: int, head_dim: int, num_kv_heads: int | None) -> ResolvedKV:
    from ..oscar import OscarRotations

    rot = OscarRotations.load(path, num_layers=num_layers, num_kv_heads=num_kv_heads,
                              head_dim=head_dim)
    header = rot.header
    widths = {}
    for role in ("key", "value"):
        bits = header.get(f"{role}_bits")
        if bits is None:
            bits = [2] * num_layers
        if len(bits) != num_layers or any(b not in (2, 4) for b in bits):
            raise ValueError(
                f"{path}: header {role}_bits must give a width (2 or 4) per layer "
                f"({num_layers}), got {bits!r}"
            )
        widths[role] = list(bits)
    sink, recent = header.get("windows") or (SINK_TOKENS, RECENT_TOKENS)
    base = default_format(2, head_dim, group_size=header.get("group_size"), sink=sink,
                          recent=recent)
    formats = tuple(
        replace(
            base,
            key=replace(base.key, bits=kb),
            value=replace(base.value, bits=vb),
        )
        for kb, vb in zip(widths["key"], widths["value"])
    )
    label = "oscar-" + os.path.splitext(os.path.basename(path))[0]
    return ResolvedKV(label, formats, rot, "cache" if rot.clips else None)
