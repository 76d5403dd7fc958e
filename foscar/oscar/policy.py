"""OSCAR's calibrated artifact: per-layer rotations and clip ratios, saved as safetensors.

:class:`OscarRotations` holds, for ``L`` layers,

* ``key``, ``value``: ``[L, Hr, d, d]`` float64 orthogonal ``R_K``, ``R_V`` (``Hr = 1``: one
  per layer shared by the KV heads, the released configuration; ``Hr = H_kv``: one per head);
* ``clips``: fitted per-layer clip ratios, ``{(bits, "key"|"value"): [L] float64}``;
* ``key_gptq`` (optional): ``[L, H_kv, d, d]`` GPTQ factors of the keys' metric in the rotated
  basis, for GPTQ rounding of the keys at the cache write (:func:`foscar.quantize.quantize_gptq`,
  :func:`foscar.oscar.calibrate.gptq_factors`);
* ``header``: a JSON-able dict: model, num_layers, num_kv_heads, head_dim, per_head, recipe,
  targets, calibration text and token count, foscar version.

File layout (safetensors): tensors ``key_rotation``, ``value_rotation``,
``clip.<key|value>.int<bits>`` and optionally ``key_gptq``; the header is JSON under the
metadata key ``"oscar"``. Loading checks every shape against the header and (optionally)
against the model it will serve.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import torch

from ..cache import QuantizedKVCache, effective_bits, layer_formats
from ..formats import KVFormat

__all__ = [
    "OscarRotations",
    "FORMAT_VERSION",
    "apply_to_cache",
    "budget_bounds",
    "clip_widths",
    "fold_value_rotations",
    "key_widths_by_error",
    "layer_key_formats",
    "layer_width_formats",
    "layers_by_gain",
    "layers_by_key_gain",
    "widths_by_budget",
    "widths_by_error",
    "oscar_cache",
]

#: bumped when the file layout changes; files of another version are rejected
FORMAT_VERSION = 1
_META_KEY = "oscar"


def _is_identity(r: torch.Tensor) -> bool:
    eye = torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)
    return bool((r == eye).all())


@dataclass
class OscarRotations:
    """Per-layer OSCAR rotations and fitted clip ratios (module docstring)."""

    key: torch.Tensor
    value: torch.Tensor
    clips: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    header: dict = field(default_factory=dict)
    key_gptq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("key", "value"):
            r = getattr(self, name)
            if not isinstance(r, torch.Tensor) or r.dim() != 4 or r.shape[-1] != r.shape[-2]:
                raise ValueError(
                    f"{name} must be a [num_layers, heads, head_dim, head_dim] tensor, got "
                    f"{list(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}"
                )
            setattr(self, name, r.to(torch.float64).contiguous())
        if self.key.shape != self.value.shape:
            raise ValueError(
                f"key and value rotations differ in shape: {list(self.key.shape)} and "
                f"{list(self.value.shape)}"
            )
        for (bits, role), c in self.clips.items():
            if role not in ("key", "value") or bits not in (2, 4):
                raise ValueError(f"clips keys must be (2|4, 'key'|'value'), got {(bits, role)}")
            if tuple(c.shape) != (self.num_layers,):
                raise ValueError(
                    f"clips[{(bits, role)}] must hold one ratio per layer ({self.num_layers}), "
                    f"got shape {list(c.shape)}"
                )
        if self.key_gptq is not None:
            shape = tuple(self.key_gptq.shape)
            if len(shape) != 4 or shape[0] != self.num_layers or shape[2:] != (self.head_dim,) * 2:
                raise ValueError(
                    f"key_gptq must be [num_layers={self.num_layers}, num_kv_heads, "
                    f"{self.head_dim}, {self.head_dim}], got {list(shape)}"
                )
            self.key_gptq = self.key_gptq.to(torch.float32).contiguous()
        self.header = {
            **self.header,
            "num_layers": self.num_layers,
            "head_dim": self.head_dim,
            "per_head": self.per_head,
        }

    @property
    def num_layers(self) -> int:
        return self.key.shape[0]

    @property
    def head_dim(self) -> int:
        return self.key.shape[-1]

    @property
    def per_head(self) -> bool:
        return self.key.shape[1] > 1

    def check(self, *, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise ``ValueError`` naming the mismatch unless these rotations fit such a model."""
        if num_layers != self.num_layers:
            raise ValueError(
                f"num_layers: the rotations have {self.num_layers} layers, the model has "
                f"{num_layers}"
            )
        if head_dim != self.head_dim:
            raise ValueError(
                f"head_dim: the rotations are {self.head_dim}-dimensional, the model's heads "
                f"{head_dim}"
            )
        if self.per_head and self.key.shape[1] != num_kv_heads:
            raise ValueError(
                f"num_kv_heads: the per-head rotations have {self.key.shape[1]} heads, the model "
                f"{num_kv_heads}"
            )
        if self.key_gptq is not None and self.key_gptq.shape[1] != num_kv_heads:
            raise ValueError(
                f"num_kv_heads: key_gptq has {self.key_gptq.shape[1]} heads, the model "
                f"{num_kv_heads}"
            )

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file (tensors and the JSON header; module docstring)."""
        from safetensors.torch import save_file

        tensors = {"key_rotation": self.key, "value_rotation": self.value}
        if self.key_gptq is not None:
            tensors["key_gptq"] = self.key_gptq
        for (bits, role), c in self.clips.items():
            tensors[f"clip.{role}.int{bits}"] = c.to(torch.float64).contiguous()
        header = {**self.header, "version": FORMAT_VERSION}
        save_file(tensors, os.fspath(path), metadata={_META_KEY: json.dumps(header)})

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
    ) -> OscarRotations:
        """Read a file written by :meth:`save`; with the model's shapes, check they fit."""
        from safetensors import safe_open

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"path {path!r} is not a file")
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if _META_KEY not in meta:
                raise ValueError(f"path {path!r} is not an OSCAR rotations file (no header)")
            header = json.loads(meta[_META_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if header.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"path {path!r} has format version {header.get('version')}, this foscar reads "
                f"{FORMAT_VERSION}"
            )
        for name in ("key_rotation", "value_rotation"):
            if name not in tensors:
                raise ValueError(f"path {path!r} lacks the tensor {name!r}")
        clips = {}
        for k, c in tensors.items():
            if k.startswith("clip."):
                _, role, bits = k.split(".")
                clips[(int(bits.removeprefix("int")), role)] = c
        gptq = tensors.get("key_gptq")
        out = cls(tensors["key_rotation"], tensors["value_rotation"], clips, header, gptq)
        if header.get("num_layers") != out.num_layers or header.get("head_dim") != out.head_dim:
            raise ValueError(
                f"path {path!r}: header says {header.get('num_layers')} layers of head_dim "
                f"{header.get('head_dim')}, tensors hold {out.num_layers} of {out.head_dim}"
            )
        if num_layers is not None or num_kv_heads is not None or head_dim is not None:
            out.check(
                num_layers=out.num_layers if num_layers is None else num_layers,
                num_kv_heads=out.key.shape[1] if num_kv_heads is None else num_kv_heads,
                head_dim=out.head_dim if head_dim is None else head_dim,
            )
        return out


def apply_to_cache(
    rotations: OscarRotations,
    cache: QuantizedKVCache,
    *,
    clip_bits: int | tuple[int, int] | str | None = None,
) -> None:
    """Set every layer's transform of ``cache`` (:meth:`QuantizedKVCache.set_transform`).

    ``clip_bits``: use the clip ratios fitted for that bit width (they must exist), or for
    ``(key bits, value bits)`` when K and V differ in width, or ``"cache"``: each layer's K and
    V widths in the cache's formats (a cache with one format per layer; a fixed width is
    refused there where a layer's format has another, since that layer would get clips fitted
    for the wrong width); None keeps the format's clip. Identity rotations are skipped (no work
    at decode). A rejected call leaves every layer's transform as it was.
    """
    rotations.check(
        num_layers=cache.num_layers, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim
    )
    widths = clip_widths(rotations, cache.formats, clip_bits)
    saved = list(cache.transforms)
    try:
        for layer in range(cache.num_layers):
            rk, rv = rotations.key[layer], rotations.value[layer]
            kb, vb = widths[layer] if widths else (None, None)
            cache.set_transform(
                layer,
                key_rotation=None if _is_identity(rk) else rk,
                value_rotation=None if _is_identity(rv) else rv,
                key_clip=None if kb is None else float(rotations.clips[(kb, "key")][layer]),
                value_clip=None if vb is None else float(rotations.clips[(vb, "value")][layer]),
                key_gptq=None if rotations.key_gptq is None else rotations.key_gptq[layer],
            )
    except BaseException:
        # set_transform checks one layer at a time (a later layer may refuse, e.g. GPTQ on its
        # channel-wise keys): put back the layers already set
        cache.transforms[:] = saved
        raise


def clip_widths(rotations: OscarRotations, formats, clip_bits) -> list[tuple[int, int]] | None:
    """``(key bits, value bits)`` of the clips :func:`apply_to_cache` gives each layer of a
    cache of ``formats`` (one KVFormat per layer), or None for the formats' own clips; raises
    ``ValueError`` naming ``clip_bits`` unless ``rotations`` holds every clip it needs."""
    if clip_bits is None:
        return None
    formats = tuple(formats)
    mixed = len(set(formats)) > 1
    if isinstance(clip_bits, str):
        if clip_bits != "cache":
            raise ValueError(
                f"clip_bits must be a width, (key bits, value bits), 'cache' or None, got "
                f"{clip_bits!r}"
            )
        widths = [(f.key.bits, f.value.bits) for f in formats]
    else:
        pair = tuple(clip_bits) if isinstance(clip_bits, (tuple, list)) else (clip_bits,) * 2
        if len(pair) != 2:
            raise ValueError(
                f"clip_bits must be a width or (key bits, value bits), got {clip_bits}"
            )
        widths = [pair] * len(formats)
        for layer, f in enumerate(formats):
            if mixed and (f.key.bits, f.value.bits) != pair:
                raise ValueError(
                    f"clip_bits={clip_bits!r}: layer {layer} stores K INT{f.key.bits} / V "
                    f"INT{f.value.bits}, so it would get clips fitted for another width; pass "
                    "clip_bits='cache' (each layer's own widths)"
                )
    for pair in dict.fromkeys(widths):
        for role, bits in zip(("key", "value"), pair):
            if (bits, role) not in rotations.clips:
                raise ValueError(
                    f"clip_bits: no {role} clip ratios were fitted for INT{bits} (have "
                    f"{sorted(rotations.clips)})"
                )
    return widths


def key_widths_by_error(
    rotations: OscarRotations, num_wide_layers: int, *, narrow: int = 2, wide: int = 4
) -> list[int]:
    """Key width per layer: ``wide`` bits in the ``num_wide_layers`` layers whose keys gain
    most from it, ``narrow`` in the rest (:func:`widths_by_error` for the keys).

    On SmolLM2 a few layers hold most of the keys' INT2 error (the 6 layers of largest error
    hold 57% of it), so a few INT4 layers buy most of what INT4 keys everywhere would, and this
    ranking picks nearly the layers the logits' KL would (docs/oscar.md).
    """
    return widths_by_error(rotations, num_wide_layers, role="key", narrow=narrow, wide=wide)


def widths_by_error(
    rotations: OscarRotations,
    num_wide_layers: int,
    *,
    role: str = "key",
    narrow: int = 2,
    wide: int = 4,
) -> list[int]:
    """Width of ``role`` (``"key"`` or ``"value"``) per layer: ``wide`` bits in the
    ``num_wide_layers`` layers whose ``role`` gains most from it, ``narrow`` in the rest.

    The gain of a layer is the fall of the squared relative attention-output error of its
    ``role`` alone quantized from INT``narrow`` to INT``wide``, as
    :func:`foscar.oscar.fit_clips` measured it on the calibration text with the fitted clips
    (both widths must have been fitted, so ``rotations.header["clip_fit"]`` holds
    ``int<bits>.<role>``, or for rotations chosen per layer, the chosen candidate's fit does:
    ``foscar calibrate`` files of either kind, with ``--clip-bits 2 4``, the default). Ties go
    to the earlier layer. Build the formats with :func:`layer_width_formats`.
    """
    n = rotations.num_layers
    if isinstance(num_wide_layers, bool) or not isinstance(num_wide_layers, int):
        raise TypeError(f"num_wide_layers must be an int, got {type(num_wide_layers).__name__}")
    if not 0 <= num_wide_layers <= n:
        raise ValueError(f"num_wide_layers must be in [0, {n}], got {num_wide_layers}")
    order = layers_by_gain(rotations, role=role, narrow=narrow, wide=wide)
    wide_layers = set(order[:num_wide_layers])
    return [wide if layer in wide_layers else narrow for layer in range(n)]


def layers_by_key_gain(rotations: OscarRotations, *, narrow: int = 2, wide: int = 4) -> list[int]:
    """The layers, those whose keys gain most from INT``wide`` over INT``narrow`` first (the
    order :func:`key_widths_by_error` takes them in)."""
    return layers_by_gain(rotations, role="key", narrow=narrow, wide=wide)


def layers_by_gain(
    rotations: OscarRotations, *, role: str = "key", narrow: int = 2, wide: int = 4
) -> list[int]:
    """The layers, those whose ``role`` (``"key"`` or ``"value"``) gains most from INT``wide``
    over INT``narrow`` first (the order :func:`widths_by_error` takes them in)."""
    if role not in ("key", "value"):
        raise ValueError(f"role must be 'key' or 'value', got {role!r}")
    gain = _gains(rotations, role, narrow, wide)
    return sorted(range(rotations.num_layers), key=lambda layer: (-float(gain[layer]), layer))


def _gains(rotations: OscarRotations, role: str, narrow: int, wide: int) -> torch.Tensor:
    """``[L]`` falls of the squared fitted relative error of ``role`` from INT``narrow`` to
    INT``wide`` (:func:`widths_by_error`)."""
    e_narrow, e_wide = (_fitted_errors(rotations, role, b, (narrow, wide)) for b in (narrow, wide))
    return e_narrow.square() - e_wide.square()


def budget_bounds(
    fmt: KVFormat, num_tokens: int, *, narrow: int = 2, wide: int = 4, scale_bits: int = 32
) -> tuple[float, float]:
    """Stored bits per K/V element (:func:`foscar.effective_bits`) of a ``num_tokens``-token
    sequence in ``fmt`` with K and V at ``narrow`` bits in every layer and at ``wide`` bits in
    every layer: the least and the most a budget of :func:`widths_by_budget` can spend (the
    same for any number of layers)."""
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a KVFormat, got {type(fmt).__name__}")
    return tuple(
        effective_bits(
            num_tokens,
            replace(fmt, key=replace(fmt.key, bits=b), value=replace(fmt.value, bits=b)),
            scale_bits=scale_bits,
        )
        for b in (narrow, wide)
    )


def widths_by_budget(
    rotations: OscarRotations,
    fmt: KVFormat,
    bits: float,
    num_tokens: int,
    *,
    narrow: int = 2,
    wide: int = 4,
    scale_bits: int = 32,
) -> tuple[list[int], list[int]]:
    """Key and value width per layer: the most layers at ``wide`` bits whose stored bits per
    K/V element at ``num_tokens`` tokens (:func:`foscar.effective_bits` of the per-layer
    formats of ``fmt``, its groups, scales, offsets and BF16 windows counted) stay at most
    ``bits``; ``narrow`` bits elsewhere. Returns ``(key_bits, value_bits)``, one width per
    layer each, for :func:`layer_width_formats`.

    Keys and values of every layer are walked in one order, by the fall of the fitted error
    that ``wide`` bits buy (the squared relative attention-output error, as
    :func:`widths_by_error` ranks each role, so keys and values compete on one measure) per
    bit per element they add; the walk stops at the first one the budget cannot hold, so the
    wide set leads that order and one more would exceed ``bits``. With one group size and one
    pair of windows every layer and role adds the same bits, so the order is that of the error
    falls. Ties go to the earlier layer, keys before values. A budget of at least
    ``wide`` bits everywhere (:func:`budget_bounds`) gets ``wide`` everywhere; one below
    ``narrow`` bits everywhere raises ``ValueError`` naming ``bits``.
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not bits > 0:
        raise ValueError(f"bits must be a number > 0, got {bits!r}")
    floor, _ = budget_bounds(fmt, num_tokens, narrow=narrow, wide=wide, scale_bits=scale_bits)
    if bits < floor:
        raise ValueError(
            f"bits={bits} is below INT{narrow} everywhere: {floor:.4f} bits per element at "
            f"{num_tokens} tokens"
        )
    n = rotations.num_layers
    widths = {"key": [narrow] * n, "value": [narrow] * n}

    def total() -> float:
        formats = layer_width_formats(fmt, key_bits=widths["key"], value_bits=widths["value"])
        return effective_bits(num_tokens, formats, scale_bits=scale_bits)

    steps = []
    for r, role in enumerate(("key", "value")):
        # every layer shares ``fmt``'s group and windows: one cost per role, so that equal
        # error falls tie exactly
        one = replace(fmt, **{role: replace(getattr(fmt, role), bits=wide)})
        cost = effective_bits(num_tokens, one, scale_bits=scale_bits) - floor
        for layer, gain in enumerate(_gains(rotations, role, narrow, wide).tolist()):
            rate = gain / cost if cost > 0 else float("inf")
            steps.append((-rate, layer, r, role))
    for _, layer, _, role in sorted(steps):
        widths[role][layer] = wide
        if total() > bits:
            widths[role][layer] = narrow
            break
    return widths["key"], widths["value"]


def _fitted_errors(rotations: OscarRotations, role: str, bits: int, widths) -> torch.Tensor:
    """``[L]`` fitted relative errors of ``role`` at INT``bits`` from the header: one clip
    fit's, or, for rotations chosen per layer (:func:`foscar.oscar.choose_rotations`), each
    layer's chosen candidate's."""
    fit = rotations.header.get("clip_fit") or {}
    choice = (rotations.header.get("selection") or {}).get(role)
    per_layer = []
    for layer in range(rotations.num_layers):
        f = fit[choice[layer]] if choice and choice[layer] in fit else fit
        entry = f.get(f"int{bits}.{role}")
        if not isinstance(entry, dict) or "fitted_relative_error" not in entry:
            raise ValueError(
                f"rotations: no INT{bits} {role} clip fit in the header (clip_fit has "
                f"{sorted(k for k in f if str(k).startswith('int'))}); fit_clips with bits "
                f"{tuple(widths)} records the per-layer errors this ranks by"
            )
        per_layer.append(entry["fitted_relative_error"][layer])
    return torch.tensor(per_layer, dtype=torch.float64)


def layer_key_formats(fmt: KVFormat, key_bits) -> tuple[KVFormat, ...]:
    """One format per layer: ``fmt`` with its keys at ``key_bits[layer]`` bits (for a cache
    with per-layer formats, e.g. from :func:`key_widths_by_error`)."""
    return layer_width_formats(fmt, key_bits=key_bits)


def layer_width_formats(fmt: KVFormat, *, key_bits=None, value_bits=None) -> tuple[KVFormat, ...]:
    """One format per layer: ``fmt`` with its keys at ``key_bits[layer]`` and its values at
    ``value_bits[layer]`` bits (2 or 4; None keeps ``fmt``'s width of that role in every
    layer; given both, of one length), e.g. from :func:`widths_by_error`."""
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a KVFormat, got {type(fmt).__name__}")
    widths = {}
    for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
        if bits is None:
            continue
        bits = list(bits)
        for i, b in enumerate(bits):
            if isinstance(b, bool) or not isinstance(b, int) or b not in (2, 4):
                raise ValueError(f"{name}[{i}] must be 2 or 4, got {b!r}")
        widths[name] = bits
    if not widths:
        raise ValueError("give key_bits, value_bits or both (one width per layer)")
    lengths = {len(b) for b in widths.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            "key_bits and value_bits must give one width per layer, of one non-zero length; got "
            + ", ".join(f"{k} of {len(v)}" for k, v in widths.items())
        )
    out = []
    for layer in range(lengths.pop()):
        key, value = fmt.key, fmt.value
        if "key_bits" in widths:
            key = replace(key, bits=widths["key_bits"][layer])
        if "value_bits" in widths:
            value = replace(value, bits=widths["value_bits"][layer])
        out.append(replace(fmt, key=key, value=value))
    return tuple(out)


#: the model config attribute :func:`fold_value_rotations` sets
FOLDED_FLAG = "foscar_value_rotations_folded"


def oscar_cache(
    fmt,
    config,
    rotations: OscarRotations,
    *,
    clip_bits: int | tuple[int, int] | str | None = None,
    **kw,
):
    """A transformers :class:`~foscar.integrations.transformers.FoscarCache` whose layers are
    rotated (and re-clipped) by ``rotations``; ``fmt`` one KVFormat or one per layer;
    ``clip_bits`` as :func:`apply_to_cache`; ``kw`` go to ``FoscarCache``."""
    from ..integrations.transformers import FoscarCache

    class _OscarCache(FoscarCache):
        def _allocate(self, batch_size, device):
            super()._allocate(batch_size, device)
            try:
                apply_to_cache(rotations, self.kv, clip_bits=clip_bits)
            except BaseException:  # no half-made pool for a retry to reuse unrotated
                self.kv = self.seq_ids = None
                raise

    folded = bool(rotations.header.get("value_rotations_folded"))
    if folded != bool(getattr(config, FOLDED_FLAG, False)):
        raise ValueError(
            f"rotations: value rotations {'folded' if folded else 'not folded'} into a model, "
            f"but the model's config says {'not ' if folded else ''}folded "
            "(fold_value_rotations returns the rotations to use with the folded model)"
        )
    cache = _OscarCache(fmt, config, **kw)
    rotations.check(
        num_layers=cache.num_layers, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim
    )
    # the clips' widths are checked now, not at the first forward pass
    clip_widths(rotations, layer_formats(cache.fmt, cache.num_layers), clip_bits)
    return cache


def _attention_modules(model) -> list:
    """The model's attention modules by layer (Llama-style: ``v_proj``, ``o_proj`` linear
    layers and a ``layer_idx``)."""
    found = {}
    for m in model.modules():
        if all(hasattr(m, a) for a in ("v_proj", "o_proj", "layer_idx")):
            found[m.layer_idx] = m
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(
            "fold_value_rotations needs Llama-style attention modules (v_proj, o_proj and "
            f"layer_idx) for layers 0..L-1; found layers {sorted(found)}"
        )
    return [found[i] for i in range(len(found))]


@torch.no_grad()
def fold_value_rotations(model, rotations: OscarRotations) -> OscarRotations:
    """Fold the value rotations into the model's weights; return the rotations left to apply.

    ``v R_V`` and ``o R_V^T`` are linear maps next to linear layers: per KV head ``h``,
    ``v_proj``'s output rows become ``R_h^T W_v`` (its bias ``b R_h``), so the layer computes
    the rotated values itself, and for every query head ``j`` reading head ``h`` ``o_proj``'s
    input columns become ``W_o R_h``, which takes the rotated attention output back. Attention
    is unchanged in exact arithmetic (computed in float64, then rounded to the weights' dtype
    once), and the cache and the decode path then skip two of a layer's four rotations per
    step: the returned :class:`OscarRotations` has identity value rotations (which
    :func:`apply_to_cache` does not apply) and ``header["value_rotations_folded"] = True``.

    Modifies ``model`` in place (keep the original weights if you need them) and marks its
    config (``config.foscar_value_rotations_folded``): :func:`oscar_cache` then refuses
    rotations whose value rotations are not folded, and an unfolded model folded rotations,
    either of which would rotate the values twice or not at all. Llama-style
    attention only (``v_proj`` -> attention -> ``o_proj``, no operation on V in between, as in
    Llama, Qwen2/3, Mistral and SmolLM2). Refuses rotations already folded.
    """
    if rotations.header.get("value_rotations_folded"):
        raise ValueError("rotations: their value rotations are already folded into a model")
    from .capture import model_shapes

    modules = _attention_modules(model)
    if getattr(model.config, FOLDED_FLAG, False):
        raise ValueError("model: value rotations are already folded into its weights")
    shape = model_shapes(model)
    h_kv, h_q, d = shape["num_kv_heads"], shape["num_q_heads"], shape["head_dim"]
    if len(modules) != shape["num_layers"] or h_q % h_kv:
        raise ValueError(
            f"model: {len(modules)} attention modules for {shape['num_layers']} layers, "
            f"{h_q} query heads for {h_kv} KV heads (expected one module per layer and a "
            "multiple)"
        )
    rotations.check(num_layers=len(modules), num_kv_heads=h_kv, head_dim=d)
    for layer, attn in enumerate(modules):  # every layer checked before any weight changes
        v, o = attn.v_proj, attn.o_proj
        if v.weight.shape[0] != h_kv * d or o.weight.shape[1] != h_q * d:
            raise ValueError(
                f"layer {layer}: v_proj has {v.weight.shape[0]} outputs and o_proj "
                f"{o.weight.shape[1]} inputs, expected {h_kv} x {d} and {h_q} x {d}"
            )
    for layer, attn in enumerate(modules):
        v, o = attn.v_proj, attn.o_proj
        r = rotations.value[layer].to(v.weight.device, torch.float64).expand(h_kv, d, d)
        wv = v.weight.to(torch.float64).reshape(h_kv, d, -1)  # [H, d, hidden]
        v.weight.copy_((r.transpose(1, 2) @ wv).reshape(v.weight.shape))
        if v.bias is not None:
            b = v.bias.to(torch.float64).reshape(h_kv, 1, d)
            v.bias.copy_((b @ r).reshape(v.bias.shape))
        rq = r.to(o.weight.device).repeat_interleave(h_q // h_kv, dim=0)  # query head j: KV j // g
        wo = o.weight.to(torch.float64).reshape(-1, h_q, d).transpose(0, 1)  # [Hq, hidden, d]
        o.weight.copy_((wo @ rq).transpose(0, 1).reshape(o.weight.shape))
    setattr(model.config, FOLDED_FLAG, True)
    eye = torch.eye(d, dtype=torch.float64).expand(rotations.value.shape).contiguous()
    header = {**rotations.header, "value_rotations_folded": True}
    return OscarRotations(rotations.key, eye, dict(rotations.clips), header, rotations.key_gptq)
