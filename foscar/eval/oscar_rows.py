"""OSCAR's rows for ``foscar eval``: rotated formats, their ablations, and the cache that runs them.

Every row is token-wise with one group per head row (``g = min(head_dim, 128)``, like the
harness's other formats) unless its name says ``gG`` (groups of ``G`` channels); "clips
0.96/0.92" is the released recipe's fixed per-token clipping, "fitted clips" the per-layer
ratios of :func:`foscar.oscar.fit_clips`; windows are BF16 sink and recent tokens (64/256 by
default). From one :class:`~foscar.oscar.Calibration`:

=====================================  =========================================================
row                                    rotation / clipping / windows
=====================================  =========================================================
INT2 Hadamard (QuaRot-style)           R = H for K and V; 0.96/0.92; none
OSCAR INT2                             U*H*P_br; fitted; none
OSCAR INT2 + BF16 s/r                  U*H*P_br; fitted; s/r
OSCAR INT2 + BF16 s/r, clips 0.96/0.92 U*H*P_br; 0.96/0.92; s/r (the ablations' reference)
... w/o P_br, w/o H, w/o U             U*H, U*P_br, H*P_br; 0.96/0.92; s/r
... no rotation                        identity; 0.96/0.92; s/r
... K^TK/V^TV targets                  U*H*P_br of K^T K and V^T V; 0.96/0.92; s/r
OSCAR-select INT2 (+ BF16 s/r)         per layer and K/V: U*H*P_br, H*P_br or U*H*P_br of
                                       K^TK/V^TV, the smallest fitted error; fitted; none (s/r)
OSCAR-select per-KV-head INT2 (+ s/r)  the same candidates and U*H*P_br per KV head of both
                                       targets (H*P_br has no per-head variant: it reads no
                                       target); fitted; none (s/r)
OSCAR-select [per-KV-head] INT2 gG ...  the two rows above with token-wise groups of G channels
                                       (``group_sizes``: e.g. 32, two groups per 64-channel
                                       row); clips fitted and rotations chosen at that group
                                       size; fitted; none (s/r)
OSCAR INT4 (+ BF16 s/r)                U*H*P_br; fitted for INT4; none (s/r)
... + GPTQ keys (``gptq``)             OSCAR INT2 and OSCAR-select per-KV-head INT2 with the
                                       keys' codes chosen by GPTQ under the queries' covariance
                                       (same stored format); refitted; none (s/r)
... + attention-GPTQ keys              the same rows with GPTQ under the attention-weighted key
                                       metric (``gptq_metrics`` with "attention":
                                       :func:`~foscar.oscar.attention_key_metrics`); refitted
OSCAR-select by GPTQ per-KV-head ...   (``gptq``) OSCAR-select per-KV-head made again with every
                                       candidate's keys rounded by GPTQ, so each layer's key
                                       rotation is the one of smallest GPTQ error; none (s/r)
OSCAR-select per-KV-head K INTa, V INTb (``gptq``) K INT2 by GPTQ with V INT4, and K INT4 with V
                                       INT2: what each role's INT2 costs alone; fitted; s/r
... INT4 keys in N layers[, INT4       (``gptq``) one format per layer: INT4 keys (values) in
values in M layers]                    the N (M) layers whose fitted error falls most from INT2
                                       to INT4 (``int4_layers``, default
                                       :data:`INT4_LAYERS`), INT2 elsewhere; each
                                       layer's clips fitted for its widths; s/r
=====================================  =========================================================

From a saved :class:`~foscar.oscar.OscarRotations` alone (no ablations): the OSCAR INT2/INT4
rows with and without windows, fitted clips when the file has them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ..formats import KVFormat, QuantFormat
from ..oscar.calibrate import (
    PLAIN_TARGETS,
    Calibration,
    attention_key_metrics,
    calibrate,
    choose_rotations,
    default_sequences,
    fit_candidates,
    fit_clips,
    gptq_factors,
)
from ..oscar.capture import model_shapes
from ..oscar.policy import (
    OscarRotations,
    key_widths_by_error,
    oscar_cache,
    widths_by_error,
)
from ..oscar.positions import position_shifts
from .texts import python_reference

__all__ = [
    "OscarEvalFormat",
    "oscar_formats",
    "make_oscar_cache",
    "attention_errors",
    "prepare",
    "report",
    "RELEASED_CLIPS",
    "ERROR_VARIANTS",
    "SELECT_CANDIDATES",
    "select_candidates",
    "select_formats",
    "gptq_rows",
]

#: the released recipe's fixed clip ratios (oscar.md Sec. 3)
RELEASED_CLIPS = (0.96, 0.92)


#: OSCAR-select's candidates: name -> (label, recipe, :meth:`Calibration.rotations` kwargs);
#: the "OSCAR-select" rows choose among the per-layer ones, "OSCAR-select per-KV-head" among all
SELECT_CANDIDATES = {
    "full": ("U*H*P_br", "full", {}),
    "no-u": ("H*P_br", "no-u", {}),
    # the plain second moments: lower K error than C_Q's on SmolLM2
    "ktk": ("K^TK/V^TV", "full", PLAIN_TARGETS),
    # one rotation per KV head: the lowest V error of the held-out table on SmolLM2
    "full-kvh": ("U*H*P_br per KV head", "full", {"per_head": True}),
    "ktk-kvh": ("K^TK/V^TV per KV head", "full", {**PLAIN_TARGETS, "per_head": True}),
}


#: the OSCAR-select per-KV-head row whose key rotations are chosen by their GPTQ errors
GPTQ_SELECT = "OSCAR-select by GPTQ per-KV-head INT2"


@dataclass(frozen=True)
class OscarEvalFormat:
    """A row of ``foscar eval`` whose cache is rotated (and possibly re-clipped per layer).

    ``name``, ``fmt``, ``bits`` as the harness's ``EvalFormat`` (``fmt`` may be one KVFormat
    per layer); ``rotations`` to apply; ``clip_bits``: use the ratios fitted for that width, or
    ``(key bits, value bits)``, or ``"cache"`` for each layer's own widths (None: the format's
    clips).
    """

    name: str
    fmt: KVFormat | tuple[KVFormat, ...]
    bits: int
    rotations: OscarRotations
    clip_bits: int | tuple[int, int] | str | None = None

    def make_cache(self, model, prefill, extra_tokens: int):
        """A rotated FoscarCache holding ``prefill`` (the harness's row interface)."""
        return make_oscar_cache(model, self, prefill, extra_tokens)


def _fmt(bits, g, clips=None, sink=0, recent=0) -> KVFormat:
    """Token-wise groups of ``g``; ``bits`` one width or ``(key bits, value bits)``."""
    pk, pv = clips if clips is not None else (None, None)
    kb, vb = bits if isinstance(bits, tuple) else (bits, bits)
    return KVFormat(
        QuantFormat(kb, "token", g, pk),
        QuantFormat(vb, "token", g, pv),
        sink_tokens=sink,
        recent_tokens=recent,
    )


def oscar_formats(
    head_dim: int,
    *,
    calibration: Calibration | None = None,
    rotations: OscarRotations | None = None,
    selected: OscarRotations | None = None,
    selected_per_head: OscarRotations | None = None,
    windows: tuple[int, int] = (64, 256),
) -> list[OscarEvalFormat]:
    """The rows of the module docstring.

    calibration : gives every row; ``rotations`` (the full recipe with fitted clips) is then
        built from it unless passed.
    rotations : alone, gives the OSCAR rows of that artifact.
    selected : rotations chosen per layer (:func:`foscar.oscar.select_rotations`) with fitted
        clips: adds the "OSCAR-select" rows.
    selected_per_head : the same, chosen among candidates that include per-KV-head rotations
        (``[L, H, d, d]``): adds the "OSCAR-select per-KV-head" rows.
    windows : ``(sink, recent)`` BF16 tokens of the windowed rows.
    """
    if calibration is None and rotations is None:
        raise ValueError("pass a calibration or rotations")
    g = min(head_dim, 128)
    s, r = windows
    w = f" + BF16 {s}/{r}"
    rows = []

    def fitted(rot, bits):
        return bits if (bits, "key") in rot.clips and (bits, "value") in rot.clips else None

    def oscar_rows(rot, bits):
        cb = fitted(rot, bits)
        clips = None if cb is not None else (RELEASED_CLIPS if bits == 2 else None)
        label = "fitted clips" if cb is not None else "clips 0.96/0.92" if clips else "min-max"
        return [
            OscarEvalFormat(f"OSCAR INT{bits} ({label})", _fmt(bits, g, clips), bits, rot, cb),
            OscarEvalFormat(
                f"OSCAR INT{bits}{w} ({label})", _fmt(bits, g, clips, s, r), bits, rot, cb
            ),
        ]

    if calibration is None:
        return oscar_rows(rotations, 2) + oscar_rows(rotations, 4)
    if rotations is None:
        raise ValueError("with a calibration, pass the fitted full rotations too")
    fixed = _fmt(2, g, RELEASED_CLIPS, s, r)
    rows.append(
        OscarEvalFormat(
            "INT2 Hadamard (QuaRot-style, clips 0.96/0.92)",
            _fmt(2, g, RELEASED_CLIPS),
            2,
            calibration.rotations("hadamard"),
        )
    )
    rows += oscar_rows(rotations, 2)
    rows += select_formats(head_dim, selected, selected_per_head, windows=windows)
    rows.append(OscarEvalFormat(f"OSCAR INT2{w} (clips 0.96/0.92)", fixed, 2, rotations))
    for recipe, label in (
        ("no-br", "w/o P_br"),
        ("no-h", "w/o H"),
        ("no-u", "w/o U"),
        ("none", "no rotation"),
    ):
        rows.append(
            OscarEvalFormat(
                f"OSCAR INT2{w} {label} (clips 0.96/0.92)", fixed, 2, calibration.rotations(recipe)
            )
        )
    plain = calibration.rotations(key_target="plain", value_target="plain")
    rows.append(OscarEvalFormat(f"OSCAR INT2{w} K^TK/V^TV (clips 0.96/0.92)", fixed, 2, plain))
    rows += oscar_rows(rotations, 4)
    return rows


def _fitted_group_sizes(rot: OscarRotations) -> set[int]:
    """The token-wise group sizes ``rot``'s clips were fitted at (one :func:`fit_clips`
    header, or every candidate's of a :func:`choose_rotations` header); empty if unknown."""
    fit = rot.header.get("clip_fit") or {}
    if "group_size" in fit:
        return {fit["group_size"]}
    return {f["group_size"] for f in fit.values() if isinstance(f, dict) and "group_size" in f}


def select_formats(
    head_dim: int,
    selected: OscarRotations | None = None,
    selected_per_head: OscarRotations | None = None,
    *,
    windows: tuple[int, int] = (64, 256),
    group_size: int | None = None,
) -> list[OscarEvalFormat]:
    """The OSCAR-select rows (INT2, fitted clips, without and with ``windows``) of ``selected``
    (per layer) and ``selected_per_head`` (either may be None).

    group_size : token-wise group of the rows (default ``min(head_dim, 128)``, one group per
        head row); another size is named in the row ("OSCAR-select INT2 g32 + ..."). The
        rotations' clips must have been fitted at that group size (``ValueError`` otherwise:
        clips fitted for one scale per row are not the clips of two scales per row).
    """
    default = min(head_dim, 128)
    g = group_size or default
    QuantFormat(2, "token", g).check_head_dim(head_dim, name="group")
    tag = "" if g == default else f" g{g}"
    rows = []
    for label, sel in (("OSCAR-select", selected), ("OSCAR-select per-KV-head", selected_per_head)):
        if sel is None:
            continue
        fitted_at = _fitted_group_sizes(sel)
        if fitted_at and fitted_at != {g}:
            raise ValueError(
                f"{label}: the clips were fitted at group size {sorted(fitted_at)}, the rows "
                f"quantize groups of {g}"
            )
        rows += _fitted_int2_rows(f"{label} INT2{tag}", g, sel, windows)
    return rows


def _fitted_int2_rows(name: str, g: int, rot: OscarRotations, windows) -> list[OscarEvalFormat]:
    """``name`` without and with the BF16 ``windows``: INT2 token-wise groups of ``g``, the
    clips fitted for INT2 in ``rot``."""
    s, r = windows
    return [
        OscarEvalFormat(f"{name}{x} (fitted clips)", f, 2, rot, 2)
        for x, f in (("", _fmt(2, g)), (f" + BF16 {s}/{r}", _fmt(2, g, None, s, r)))
    ]


def select_candidates(
    model,
    sequences,
    calibration: Calibration,
    *,
    windows: tuple[int, int] = (64, 256),
    group_size: int | None = None,
    bits: Sequence[int] = (2, 4),
    position_shifts: Sequence[int] = (0,),
    log=None,
) -> tuple[dict[str, OscarRotations], OscarRotations, OscarRotations]:
    """Fit the clips of every :data:`SELECT_CANDIDATES` rotation at token-wise groups of
    ``group_size`` (default one per head row) on ``sequences``, with ``windows`` left exact,
    and choose among them; returns ``(fitted, selected, selected_per_head)``: OSCAR-select
    (among the per-layer candidates) and OSCAR-select per-KV-head (among all).
    ``position_shifts``: :func:`foscar.oscar.fit_clips`'s."""
    candidates = {n: calibration.rotations(r, **kw) for n, (_, r, kw) in SELECT_CANDIDATES.items()}
    fitted = fit_candidates(
        model,
        sequences,
        candidates,
        bits=bits,
        group_size=group_size,
        windows=windows,
        position_shifts=position_shifts,
        log=log,
    )
    per_layer = {n: r for n, r in fitted.items() if not SELECT_CANDIDATES[n][2].get("per_head")}
    return fitted, choose_rotations(per_layer), choose_rotations(fitted)


def make_oscar_cache(model, row: OscarEvalFormat, prefill, extra_tokens: int):
    """The harness's ``make_cache`` for an OSCAR row: a rotated FoscarCache holding
    ``prefill`` (``foscar.eval.metrics.Prefill``)."""
    cache = oscar_cache(
        row.fmt,
        model.config,
        row.rotations,
        clip_bits=row.clip_bits,
        max_cache_len=prefill.length + extra_tokens,
        max_batch_size=prefill.mask.shape[0],
    )
    cache.load_prompt(prefill.keys, prefill.values, prefill.mask)
    return cache


#: rotations whose attention error :func:`attention_errors` compares: (recipe, rotations kwargs)
ERROR_VARIANTS = {
    "full": ("full", {}),
    "w/o P_br": ("no-br", {}),
    "w/o H": ("no-h", {}),
    "w/o U (Hadamard * P_br)": ("no-u", {}),
    "no rotation": ("none", {}),
    "Hadamard (QuaRot-style)": ("hadamard", {}),
    "K^TK/V^TV targets": SELECT_CANDIDATES["ktk"][1:],
    "per KV head": SELECT_CANDIDATES["full-kvh"][1:],
    "K^TK/V^TV per KV head": SELECT_CANDIDATES["ktk-kvh"][1:],
}


def attention_errors(
    model,
    calibration: Calibration,
    sequences,
    *,
    bits: int = 2,
    candidates=(1.0, 0.96, 0.92, 0.85, 0.8, 0.75, 0.7),
    num_queries: int = 64,
    variants: dict | None = None,
    windows: tuple[int, int] = (0, 0),
) -> dict:
    """Relative error of the attention output on held-out ``sequences`` for each rotation.

    For every variant of :data:`ERROR_VARIANTS`, K alone (V exact) and V alone are quantized
    (token-wise INT``bits``, one group per head row) over each sequence with each clip ratio of
    ``candidates``; the error at ``num_queries`` positions of each sequence's second half is
    averaged over layers (:func:`foscar.oscar.fit_clips` measures it). A finer, low-noise view
    of what the perplexity rows show. Returns ``{variant: {"key"|"value": {ratio: error,
    "per-layer best": error}}}``.
    """
    out = {}
    for name, (recipe, kw) in (variants or ERROR_VARIANTS).items():
        rot = fit_clips(
            model,
            sequences,
            calibration.rotations(recipe, **kw),
            bits=(bits,),
            candidates=candidates,
            num_queries=num_queries,
            windows=windows,
        )
        fit = rot.header["clip_fit"]
        out[name] = {
            role: {
                **{
                    f"{p:g}": e
                    for p, e in zip(
                        fit[f"int{bits}.{role}"]["candidates"],
                        fit[f"int{bits}.{role}"]["mean_relative_error"],
                    )
                },
                "per-layer best": fit[f"int{bits}.{role}"]["fitted_mean_relative_error"],
            }
            for role in ("key", "value")
        }
    return out


#: (INT4 key layers, INT4 value layers) of the per-layer width rows by default: 6 and 10 key
#: layers (on SmolLM2 the 6 layers of largest key error hold 57% of the keys' squared INT2
#: error), and 10 with 6 value layers (what the values' INT2 costs once the keys' worst layers
#: are INT4). ``foscar eval --oscar-int4-layers`` picks others.
INT4_LAYERS = ((6, 0), (10, 0), (10, 6))


def check_int4_layers(int4_layers, num_layers: int | None = None) -> tuple[tuple[int, int], ...]:
    """``int4_layers`` as distinct ``(key_layers, value_layers)`` pairs of ints: at least one
    key layer, no negative count, and (with ``num_layers``) fewer than ``num_layers`` of each
    (INT4 in every layer is the "K INT4" and "OSCAR INT4" rows). None: the pairs of
    :data:`INT4_LAYERS` below ``num_layers`` (a small model gets fewer rows, not an error)."""
    if int4_layers is None:
        below = num_layers if num_layers is not None else float("inf")
        return tuple((n, m) for n, m in INT4_LAYERS if n < below and m < below)
    pairs = []
    for item in int4_layers:
        try:
            n, m = (int(x) for x in item)
        except (TypeError, ValueError):
            raise ValueError(
                f"int4_layers must hold (key_layers, value_layers) pairs, got {item!r}"
            ) from None
        if n < 1 or m < 0:
            raise ValueError(
                f"int4_layers: INT4 key layers must be >= 1 and value layers >= 0, got {n}:{m}"
            )
        if num_layers is not None and (n >= num_layers or m >= num_layers):
            raise ValueError(
                f"int4_layers: each count must be below the model's {num_layers} layers (INT4 "
                f"everywhere is the 'K INT4' and 'OSCAR INT4' rows), got {n}:{m}"
            )
        pairs.append((n, m))
    if len(set(pairs)) != len(pairs):  # (none: no such rows)
        raise ValueError(f"int4_layers must be distinct pairs, got {pairs}")
    return tuple(pairs)


def prepare(
    model,
    tok,
    *,
    tokens: int = 8192,
    seq_len: int = 2048,
    context: int | None = None,
    windows: tuple[int, int] = (64, 256),
    group_sizes: Sequence[int] = (),
    path: str | None = None,
    held_out: list | None = None,
    gptq: bool = False,
    gptq_metrics: Sequence[str] = ("query",),
    int4_layers: Sequence[tuple[int, int]] | None = None,
    wanted=None,
    log=None,
) -> tuple[list[OscarEvalFormat], dict]:
    """Calibrate OSCAR for ``foscar eval`` and return ``(rows, info)``.

    Calibration text: the first ``tokens`` tokens of CPython's language reference (the text the
    harness fits its own clipping on; never scored), in sequences of ``seq_len``; with
    ``context``, every statistic and fit of the keys covers positions ``0 .. context - 1`` by
    RoPE shifts of those sequences (:func:`foscar.oscar.positions.position_shifts`). Clips are
    fitted (INT2 and INT4, with ``windows`` left exact) on the first sequence for every
    candidate of :data:`SELECT_CANDIDATES` (once each); OSCAR-select chooses among the
    per-layer ones, OSCAR-select per-KV-head among all. ``group_sizes``: for each (e.g. 32,
    smaller than the head row's group), the candidates' INT2 clips are fitted again at
    token-wise groups of that size and both OSCAR-select rows are added at it
    (:func:`select_formats`; the rows come last). With ``path`` (a
    ``foscar calibrate`` file) only that artifact's rows are returned. ``held_out``: token-id
    sequences of the evaluation text for the attention-error table (skipped when None).
    ``gptq``: also the rows of OSCAR INT2 and OSCAR-select per-KV-head INT2 with GPTQ-rounded
    keys (:func:`gptq_rows`; their clips fitted again with the keys so rounded; they come last),
    one set per metric of ``gptq_metrics``; ``int4_layers``: the ``(key_layers,
    value_layers)`` counts of their rows with INT4 in some layers (None: those of
    :data:`INT4_LAYERS` below the model's layer count). ``wanted``: a predicate on
    row names; GPTQ rows it takes none of are not fitted. ``info`` goes into the result's
    config.
    """
    import time

    group_sizes, gptq_metrics, int4_layers = _check_prepare_arguments(
        model, group_sizes=group_sizes, path=path, gptq=gptq, context=context,
        gptq_metrics=gptq_metrics, int4_layers=int4_layers,
    )
    if path is not None:
        rot = OscarRotations.load(path)
        return oscar_formats(rot.head_dim, rotations=rot, windows=windows), {
            "file": str(path),
            "header": rot.header,
        }
    ref = python_reference()
    seqs = default_sequences(tok, tokens, seq_len, ref.text)
    shifts = position_shifts(seq_len, context)
    header = {
        "model": getattr(model.config, "name_or_path", "") or "SmolLM2-135M-Instruct",
        "calibration_text": f"{ref.source}, first {tokens} tokens",
    }
    t0 = time.perf_counter()
    cal = calibrate(model, seqs, position_shifts=shifts, header=header, log=log)
    t1 = time.perf_counter()
    fitted, sel, sel_kvh = select_candidates(
        model, seqs[:1], cal, windows=windows, position_shifts=shifts, log=log
    )
    full = fitted["full"]  # the full recipe with fitted clips: the "OSCAR INT2/INT4" rows
    grouped = {
        g: select_candidates(
            model,
            seqs[:1],
            cal,
            windows=windows,
            group_size=g,
            bits=(2,),
            position_shifts=shifts,
            log=log,
        )[1:]
        for g in group_sizes
    }
    t2 = time.perf_counter()
    # held-out sequences inside the windows have no quantized key to measure (fit_clips refuses
    # them): the table is left out then, as without held-out text
    if held_out and all(len(h) <= sum(windows) for h in held_out):
        held_out = None
    errors = attention_errors(model, cal, held_out, windows=windows) if held_out else None
    t3 = time.perf_counter()
    rows = oscar_formats(
        cal.head_dim,
        calibration=cal,
        rotations=full,
        selected=sel,
        selected_per_head=sel_kvh,
        windows=windows,
    )
    for g, (sel_g, kvh_g) in grouped.items():
        rows += select_formats(cal.head_dim, sel_g, kvh_g, windows=windows, group_size=g)
    t4 = time.perf_counter()
    gptq_info = {}
    if gptq:
        extra, gptq_info = gptq_rows(
            model,
            seqs[:1],
            cal,
            full,
            sel_kvh,
            windows=windows,
            metrics=gptq_metrics,
            metric_sequences=seqs,
            position_shifts=shifts,
            int4_layers=int4_layers,
            wanted=wanted,
            log=log,
        )
        rows += extra
    seconds = {
        "targets": round(t1 - t0, 1),
        "clip_fit_and_selection": round(t2 - t1, 1),
        "attention_errors": round(t3 - t2, 1),
        "gptq_clip_fit": round(time.perf_counter() - t4, 1),
    }
    info = _prepare_info(cal, full, sel, sel_kvh, grouped, gptq_info, errors, windows, seconds)
    return rows, info



def _check_prepare_arguments(
    model, *, group_sizes, path, gptq, context, gptq_metrics, int4_layers
) -> tuple[list[int], tuple[str, ...], tuple[tuple[int, int], ...]]:
    """:func:`prepare`'s checks before any work: ``(group_sizes, gptq_metrics, int4_layers)``
    as lists and tuples, or ``ValueError`` naming the argument."""
    group_sizes = [int(g) for g in group_sizes]
    if group_sizes:
        if path is not None:
            raise ValueError("group_sizes need a calibration in the run, not a file's rotations")
        d = model_shapes(model)["head_dim"]
        for g in group_sizes:
            QuantFormat(2, "token", g).check_head_dim(d, name="group")
            if g == min(d, 128):
                raise ValueError(f"group size {g} is the default (one group per head row)")
    if path is not None and gptq:
        raise ValueError("gptq rows need a calibration in the run, not a file's rotations")
    if path is not None and context is not None:
        raise ValueError("context shapes a calibration in the run, not a file's rotations")
    gptq_metrics = _check_gptq_metrics(gptq_metrics)
    int4_layers = check_int4_layers(int4_layers, model_shapes(model)["num_layers"])
    return group_sizes, gptq_metrics, int4_layers


def _prepare_info(cal, full, sel, sel_kvh, grouped, gptq_info, errors, windows, seconds) -> dict:
    """What :func:`prepare` records of its calibration for the result's config."""
    fit = full.header["clip_fit"]
    info = {
        "calibration": {
            k: cal.header[k]
            for k in (
                "calibration_text",
                "calibration_tokens",
                "calibration_sequences",
                "position_shifts",
            )
        },
        "seconds": seconds,
        "windows": list(windows),
        "fitted_clips": {f"int{b}.{r}": c.tolist() for (b, r), c in full.clips.items()},
        "clip_fit_errors": {
            k: {kk: vv for kk, vv in v.items() if kk != "fitted_relative_error"}
            for k, v in fit.items()
            if k.startswith("int")
        },
        **_selection_info(sel, sel_kvh),
    }
    if grouped:
        info["groups"] = {str(g): _selection_info(*sels) for g, sels in grouped.items()}
    if gptq_info:
        info["gptq"] = gptq_info
    if errors is not None:
        info["attention_errors_heldout"] = {"bits": 2, "windows": list(windows), "errors": errors}
    return info

#: GPTQ key metrics of :func:`gptq_rows`: name -> the rows' label for it
GPTQ_METRICS = {"query": "GPTQ keys", "attention": "attention-GPTQ keys"}


def _check_gptq_metrics(metrics) -> tuple[str, ...]:
    """``metrics`` as a tuple: distinct names of :data:`GPTQ_METRICS`, at least one."""
    if isinstance(metrics, str) or not isinstance(metrics, Sequence):
        raise ValueError(f"gptq metrics must be a sequence of names, got {metrics!r}")
    bad = [m for m in metrics if m not in GPTQ_METRICS]
    if bad or not metrics or len(set(metrics)) != len(metrics):
        raise ValueError(
            f"gptq metrics must be distinct names among {sorted(GPTQ_METRICS)}, at least one; "
            f"got {list(metrics)}"
        )
    return tuple(metrics)


def gptq_rows(
    model,
    sequences,
    calibration: Calibration,
    full: OscarRotations,
    selected_per_head: OscarRotations,
    *,
    windows: tuple[int, int] = (64, 256),
    damp: float = 0.01,
    metrics: Sequence[str] = ("query",),
    metric_sequences=None,
    position_shifts: Sequence[int] = (0,),
    int4_layers: Sequence[tuple[int, int]] | None = None,
    wanted=None,
    log=None,
) -> tuple[list[OscarEvalFormat], dict]:
    """OSCAR INT2 and OSCAR-select per-KV-head INT2 with GPTQ-rounded keys, with and without
    ``windows``; the INT2 clips of K and V fitted again with the keys so rounded (GPTQ favours
    milder clips than rounding to nearest). Returns ``(rows, info)``.

    ``metrics``: the keys' metric GPTQ rounds under, one set of rows each (:data:`GPTQ_METRICS`
    names their rows): ``"query"`` the queries' covariance of each KV head
    (:func:`foscar.oscar.gptq_factors`), ``"attention"`` the same weighted by what a key error
    costs the output with ``windows`` (:func:`foscar.oscar.attention_key_metrics`, on
    ``metric_sequences``, default ``sequences``). ``wanted``: a predicate on row names
    (``foscar eval --formats``); a set of rows it takes none of is not fitted (a fit costs
    minutes). ``position_shifts``: every fit's and metric's RoPE shifts
    (:func:`foscar.oscar.fit_clips`). ``int4_layers``: the ``(key_layers, value_layers)``
    counts of the rows with INT4 in some layers (:func:`check_int4_layers`; None: the
    defaults below the layer count). ``info`` is keyed by the rows' names before their
    windows.
    """
    metrics = _check_gptq_metrics(metrics)
    int4_layers = check_int4_layers(int4_layers, calibration.num_layers)
    rows, info = [], {}
    for metric in metrics:
        weights = None
        if metric == "attention":  # a pass over the text, made only if a row needs it
            text = sequences if metric_sequences is None else metric_sequences
            weights = functools.cache(
                functools.partial(
                    attention_key_metrics,
                    model,
                    text,
                    windows=windows,
                    position_shifts=position_shifts,
                    log=log,
                )
            )

        more, more_info = _gptq_metric_rows(
            model,
            sequences,
            calibration,
            full,
            selected_per_head,
            metric=metric,
            weights=weights,
            windows=windows,
            damp=damp,
            int4_keys=metric == metrics[0],
            int4_layers=int4_layers,
            position_shifts=position_shifts,
            wanted=wanted,
            log=log,
        )
        rows += more
        info.update(more_info)
    return rows, info


def _gptq_metric_rows(
    model,
    sequences,
    calibration: Calibration,
    full: OscarRotations,
    selected_per_head: OscarRotations,
    *,
    metric: str,
    weights,
    windows,
    damp: float,
    int4_keys: bool,
    int4_layers: Sequence[tuple[int, int]],
    position_shifts: Sequence[int],
    wanted,
    log,
) -> tuple[list[OscarEvalFormat], dict]:
    """:func:`gptq_rows` of one metric (``weights``: None, or a function returning its
    :func:`gptq_factors` ``metrics``, called only for rows ``wanted`` takes)."""
    g = min(calibration.head_dim, 128)
    keys = GPTQ_METRICS[metric]

    def needed(rows: list[OscarEvalFormat]) -> bool:
        return wanted is None or any(wanted(r.name) for r in rows)

    def rounded_by_gptq(base: OscarRotations, factors: bool = True) -> OscarRotations:
        """``base``'s rotations, no clips yet, with the GPTQ factors of their key basis
        (``factors=False``: without, for the rows' names only)."""
        header = {**base.header, "key_rounding": f"gptq, damp {damp}, metric {metric}"}
        key_gptq = None
        if factors:
            metrics = None if weights is None else weights()
            key_gptq = gptq_factors(calibration, base, damp=damp, metrics=metrics)
        return OscarRotations(base.key, base.value, {}, header, key_gptq)

    def group(
        label: str,
        rot: OscarRotations,
        base: OscarRotations,
        names_only: bool = False,
        layer_widths: bool = True,
    ) -> list[OscarEvalFormat]:
        """``layer_widths``: the rows with INT4 keys in some layers too (their clips need an
        INT4 fit, made only where a row of them is wanted)."""
        out = _fitted_int2_rows(f"{label} + {keys}", g, rot, windows)
        if base is selected_per_head:
            out += _mixed_width_rows(g, rot, base, windows, keys, int4_keys)
            if layer_widths:
                out += _layer_width_rows(
                    label, g, rot, windows, keys, int4_layers, names_only=names_only
                )
        return out

    rows, info = [], {}
    for label, base in (("OSCAR INT2", full), ("OSCAR-select per-KV-head INT2", selected_per_head)):
        unfitted = rounded_by_gptq(base, factors=False)
        if not needed(group(label, unfitted, base, names_only=True)):
            continue  # (only the names are read: no factors, no metric, no fit)
        # INT4 clips too (GPTQ keys at INT4) where a row puts some layers' keys at INT4
        wide = base is selected_per_head and needed(
            _layer_width_rows(label, g, unfitted, windows, keys, int4_layers, names_only=True)
        )
        rot = rounded_by_gptq(base)
        fit_clips(
            model,
            sequences,
            rot,
            bits=(2, 4) if wide else (2,),
            windows=windows,
            position_shifts=position_shifts,
            log=log,
        )
        rows += group(label, rot, base, layer_widths=wide)
        info[f"{label} + {keys}"] = {
            "clips_int2": {role: rot.clips[(2, role)].tolist() for role in ("key", "value")},
            "fitted_mean_relative_error": {
                role: rot.header["clip_fit"][f"int2.{role}"]["fitted_mean_relative_error"]
                for role in ("key", "value")
            },
        }
        if wide:
            fit = rot.header["clip_fit"]
            info[f"{label} + {keys}"].update(
                clips_int4_key=rot.clips[(4, "key")].tolist(),
                key_relative_error_per_layer={
                    f"int{b}": fit[f"int{b}.key"]["fitted_relative_error"] for b in (2, 4)
                },
                int4_key_layers={
                    str(n): [i for i, b in enumerate(key_widths_by_error(rot, n)) if b == 4]
                    for n in dict.fromkeys(n for n, _ in int4_layers)
                },
                clips_int4_value=rot.clips[(4, "value")].tolist(),
                value_relative_error_per_layer={
                    f"int{b}": fit[f"int{b}.value"]["fitted_relative_error"] for b in (2, 4)
                },
                int4_value_layers={
                    str(m): [
                        i for i, b in enumerate(widths_by_error(rot, m, role="value")) if b == 4
                    ]
                    for m in dict.fromkeys(m for _, m in int4_layers)
                    if m
                },
            )
    # OSCAR-select made again with every candidate's keys rounded by GPTQ: the rotation whose
    # GPTQ error is smallest need not be the one whose rounding-to-nearest error is
    label = f"{GPTQ_SELECT} + {keys}"
    if not needed(_fitted_int2_rows(label, g, full, windows)):
        return rows, info
    candidates = {
        n: rounded_by_gptq(calibration.rotations(recipe, **kw))
        for n, (_, recipe, kw) in SELECT_CANDIDATES.items()
    }
    fit_candidates(
        model,
        sequences,
        candidates,
        bits=(2,),
        windows=windows,
        position_shifts=position_shifts,
        log=log,
    )
    chosen = choose_rotations(candidates)
    rows += _fitted_int2_rows(label, g, chosen, windows)
    info[label] = {
        "selection_per_kv_head": {r: chosen.header["selection"][r] for r in ("key", "value")},
        "clips_int2": {r: chosen.clips[(2, r)].tolist() for r in ("key", "value")},
        "selection_errors": {
            r: chosen.header["selection"][f"{r}_error_per_candidate"] for r in ("key", "value")
        },
    }
    return rows, info


def _mixed_width_rows(
    g: int,
    gptq: OscarRotations,
    plain: OscarRotations,
    windows,
    keys: str = GPTQ_METRICS["query"],
    int4_keys: bool = True,
) -> list[OscarEvalFormat]:
    """K and V at different widths, with ``windows``: K INT2 by GPTQ with V INT4, and K INT4
    with V INT2 (INT4 is within 1% of BF16 on SmolLM2, so each row shows about what
    the other role's INT2 costs alone). ``gptq``: the rotations with GPTQ keys and INT2 clips;
    ``plain``: the same rotations with INT2 and INT4 clips, keys to nearest; ``keys`` names
    the GPTQ keys' metric (:data:`GPTQ_METRICS`); ``int4_keys``: also the K INT4 row (it has no
    GPTQ keys, so one metric's rows carry it)."""
    s, r = windows
    w = f" + BF16 {s}/{r}"
    # the GPTQ rotations with the INT4 value clips of the same value rotations
    k2 = OscarRotations(
        gptq.key,
        gptq.value,
        {**gptq.clips, (4, "value"): plain.clips[(4, "value")]},
        gptq.header,
        gptq.key_gptq,
    )
    rows = [
        OscarEvalFormat(
            f"OSCAR-select per-KV-head K INT2 + {keys}, V INT4{w} (fitted clips)",
            _fmt((2, 4), g, None, s, r),
            2,
            k2,
            (2, 4),
        )
    ]
    if int4_keys:
        rows.append(
            OscarEvalFormat(
                f"OSCAR-select per-KV-head K INT4, V INT2{w} (fitted clips)",
                _fmt((4, 2), g, None, s, r),
                2,
                plain,
                (4, 2),
            )
        )
    return rows


def _layer_width_rows(
    label: str,
    g: int,
    rot: OscarRotations,
    windows,
    keys: str,
    int4_layers: Sequence[tuple[int, int]] = INT4_LAYERS,
    names_only: bool = False,
) -> list[OscarEvalFormat]:
    """``label`` + ``keys`` with ``windows``, for each ``(n, m)`` of ``int4_layers``: its keys
    at INT4 in the ``n`` layers where INT4 lowers their error most
    (:func:`foscar.oscar.key_widths_by_error`) and its values at INT4 in the ``m`` layers where
    that lowers theirs most, INT2 elsewhere: one format per layer, each layer's clips those
    fitted for its widths (``rot``'s clips of INT2 and INT4, fitted with its GPTQ keys).
    ``names_only``: the rows' names are all that will be read (``rot`` may not be fitted
    yet)."""
    s, r = windows
    two = [2] * rot.num_layers
    rows = []
    for n, m in int4_layers:
        kbits = two if names_only else widths_by_error(rot, n, role="key")
        vbits = two if names_only or not m else widths_by_error(rot, m, role="value")
        fmt = tuple(_fmt((kb, vb), g, None, s, r) for kb, vb in zip(kbits, vbits))
        values = f", INT4 values in {m} layers" if m else ""
        name = f"{label} + {keys}, INT4 keys in {n} layers{values} + BF16 {s}/{r} (fitted clips)"
        rows.append(OscarEvalFormat(name, fmt, 2, rot, "cache"))
    return rows


def _selection_info(sel: OscarRotations, sel_kvh: OscarRotations) -> dict:
    """What both OSCAR-select rows chose, their INT2 clips and every candidate's error."""
    roles = ("key", "value")
    return {
        "selection": {r: sel.header["selection"][r] for r in roles},
        "selected_clips_int2": {r: sel.clips[(2, r)].tolist() for r in roles},
        "selection_per_kv_head": {r: sel_kvh.header["selection"][r] for r in roles},
        "selected_per_kv_head_clips_int2": {r: sel_kvh.clips[(2, r)].tolist() for r in roles},
        "selection_errors": {
            r: sel_kvh.header["selection"][f"{r}_error_per_candidate"] for r in roles
        },
    }


def _label(name: str) -> str:
    return SELECT_CANDIDATES[name][0] if name in SELECT_CANDIDATES else name


def _ordered(names) -> list[str]:
    """``names`` in :data:`SELECT_CANDIDATES`' order (unknown names last, sorted)."""
    order = list(SELECT_CANDIDATES)
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def _selection_lines(info: dict, prefix: str = "") -> list[str]:
    """:func:`report`'s lines of one :func:`_selection_info`."""
    lines = []
    for key, row in (("selection", "OSCAR-select"), ("selection_per_kv_head", "per-KV-head")):
        for role, chosen in info.get(key, {}).items():
            counts = ", ".join(f"{_label(n)} in {chosen.count(n)}" for n in _ordered(set(chosen)))
            lines.append(f"- {prefix}{row} {role}, of {len(chosen)} layers: {counts}")
    for role, per in info.get("selection_errors", {}).items():
        lines.append(
            f"- {prefix}fitted INT2 {role} error per candidate (calibration text, mean over "
            "layers): " + ", ".join(f"{_label(n)} {per[n]:.3f}" for n in _ordered(per))
        )
    return lines


def report(info: dict) -> str:
    """Markdown of :func:`prepare`'s ``info``: calibration, fitted clips, selection, and the
    held-out attention-error table."""
    cal = info.get("calibration", {})
    lines = ["### OSCAR calibration", ""]
    if cal:
        sec = info.get("seconds", {})
        shifts = cal.get("position_shifts", [0])  # (a calibration without shifts: none)
        where = (
            f", the keys' statistics and fits at the RoPE shifts {shifts}" if shifts != [0] else ""
        )
        lines.append(
            f"{cal['calibration_tokens']} tokens ({cal['calibration_text']}){where}; targets "
            f"{sec.get('targets', 0):.0f} s, clip fit and selection "
            f"{sec.get('clip_fit_and_selection', 0):.0f} s."
        )
    for key, clips in info.get("fitted_clips", {}).items():
        lines.append(
            f"- fitted {key} clip ratios: mean {sum(clips) / len(clips):.3f}, "
            f"range {min(clips):g}-{max(clips):g}"
        )
    lines += _selection_lines(info)
    for g, sub in info.get("groups", {}).items():
        lines += _selection_lines(sub, f"groups of {g}: ")
    gptq = info.get("gptq", {})
    for metric, keys in GPTQ_METRICS.items():
        chosen = gptq.get(f"{GPTQ_SELECT} + {keys}")
        if chosen is None and metric == "query":  # (results keyed by the row name alone)
            chosen = gptq.get(GPTQ_SELECT)
        if chosen:
            how = "GPTQ" if metric == "query" else f"GPTQ under the {metric}-weighted metric"
            lines += _selection_lines(chosen, f"keys rounded by {how}: ")
    errors = info.get("attention_errors_heldout", {}).get("errors")
    if errors:
        ratios = [r for r in next(iter(errors.values()))["key"] if r != "per-layer best"]
        lines += [
            "",
            "Relative error of the attention output on held-out text, INT2 (token-wise, one "
            "group per head row), K or V quantized alone, mean over layers:",
            "",
            "| rotation | "
            + " | ".join(f"K p={r}" for r in ratios)
            + " | K fitted | "
            + " | ".join(f"V p={r}" for r in ratios)
            + " | V fitted |",
            "|---|" + "---|" * (2 * len(ratios) + 2),
        ]
        for name, e in errors.items():
            cells = [
                f"{e[role][r]:.3f}"
                for role in ("key", "value")
                for r in [*ratios, "per-layer best"]
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
