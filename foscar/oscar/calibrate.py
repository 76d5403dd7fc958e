"""OSCAR's offline calibration: covariance targets -> rotations -> fitted clip ratios.

1. :func:`calibrate` runs the model (prefill only, one sequence at a time) over calibration
   token sequences and accumulates every layer's covariance targets in float64
   (:mod:`foscar.oscar.covariance`) from the post-RoPE Q, K, V its attention layers see; the
   released code's diagonal proxy for values needs the final key targets and so a second pass.
2. :meth:`Calibration.rotations` turns the targets into ``R = U * H * P_br`` per layer (or per
   KV head), with the ablation switches of :mod:`foscar.oscar.rotation` and the targets to use.
3. :func:`fit_clips` fits a clip ratio per layer for K and for V (oscar.md Sec. 3: the paper
   fixes 0.96 / 0.92 globally): with the rotations in place, K alone (V exact) and V alone are
   quantized-dequantized over each calibration sequence for every candidate ratio, and the
   ratio with the smallest relative error of the causal attention output at ``num_queries``
   query positions (spread over each sequence's second half) wins.
4. :func:`select_rotations` (our extension) picks, per layer and for K and V separately, the
   candidate rotation (e.g. with or without ``U``, per layer or per KV head) whose fitted error
   is smallest: on SmolLM2 the query eigenbasis ``U`` helps values but not keys
   (docs/oscar.md). It is :func:`fit_candidates` (the clip fit of every candidate) followed by
   :func:`choose_rotations` (the choice), which can also choose among a subset of fitted
   candidates without fitting them again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..formats import QuantFormat
from ..quantize import dequantize, gptq_factor, quantize, quantize_gptq
from .capture import capture_attention, model_shapes
from .covariance import LayerMoments, attention_key_moment
from .policy import OscarRotations, layers_by_gain
from .positions import check_shifts, position_shifts, shifted_views
from .rotation import RECIPES, RotationRecipe, check_head_dim, rotation

__all__ = [
    "Calibration",
    "calibrate",
    "fit_clips",
    "fit_candidates",
    "choose_rotations",
    "select_rotations",
    "gptq_factors",
    "attention_key_metrics",
    "calibrate_rotations",
    "default_sequences",
    "CLIP_CANDIDATES",
    "KEY_TARGETS",
    "VALUE_TARGETS",
    "PLAIN_TARGETS",
]

#: clip ratios :func:`fit_clips` tries (1 clips nothing: min-max)
CLIP_CANDIDATES = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
#: key targets: the paper's query covariance, or the ablation's K^T K
KEY_TARGETS = {"query": "key", "plain": "kk"}
#: value targets: the paper's score-weighted V^T S^T S V, the released diagonal proxy, or V^T V
VALUE_TARGETS = {"attention": "value", "proxy": "proxy", "plain": "vv"}
#: :meth:`Calibration.rotations` kwargs of the plain second-moment targets (K^TK, V^TV)
PLAIN_TARGETS = {"key_target": "plain", "value_target": "plain"}


def _sequences(sequences) -> list[torch.Tensor]:
    if isinstance(sequences, torch.Tensor):
        sequences = [sequences] if sequences.dim() == 1 else list(sequences)
    out = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not out or any(s.numel() < 2 for s in out):
        raise ValueError("sequences must hold at least one sequence of >= 2 tokens")
    return out


@dataclass
class Calibration:
    """Every layer's float64 moments (:class:`LayerMoments`) and what produced them."""

    moments: list[LayerMoments]
    num_kv_heads: int
    head_dim: int
    header: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.moments)

    def target(self, layer: int, name: str, *, per_head: bool = False) -> torch.Tensor:
        """``[H, d, d]`` (per head) or ``[1, d, d]`` (averaged over the KV heads) float64."""
        c = self.moments[layer].target(name)
        return c if per_head else c.mean(dim=0, keepdim=True)

    def rotations(
        self,
        recipe: RotationRecipe | str = "full",
        *,
        key_target: str = "query",
        value_target: str = "attention",
        per_head: bool = False,
    ) -> OscarRotations:
        """Rotations ``R = U * H * P_br`` of every layer (``[L, 1 or H, d, d]``).

        recipe : a :class:`RotationRecipe` or a name of :data:`foscar.oscar.rotation.RECIPES`
            (``"full"``, ``"no-br"``, ``"no-h"``, ``"no-u"``, ``"none"``, ``"hadamard"``).
        key_target : ``"query"`` (C_Q) or ``"plain"`` (K^T K).
        value_target : ``"attention"`` (V^T S^T S V), ``"proxy"`` or ``"plain"`` (V^T V).
        per_head : one rotation per KV head instead of one per layer.
        """
        if isinstance(recipe, str):
            if recipe not in RECIPES:
                raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
            name, recipe = recipe, RECIPES[recipe]
        else:
            name = recipe.name
        if key_target not in KEY_TARGETS:
            raise ValueError(f"key_target must be one of {sorted(KEY_TARGETS)}, got {key_target!r}")
        if value_target not in VALUE_TARGETS:
            raise ValueError(
                f"value_target must be one of {sorted(VALUE_TARGETS)}, got {value_target!r}"
            )
        keys, values = [], []
        for layer in range(self.num_layers):
            ck = self.target(layer, KEY_TARGETS[key_target], per_head=per_head)
            cv = self.target(layer, VALUE_TARGETS[value_target], per_head=per_head)
            keys.append(rotation(ck, recipe))
            values.append(rotation(cv, recipe))
        header = {
            **self.header,
            "num_kv_heads": self.num_kv_heads,
            "recipe": name,
            "use_u": recipe.use_u,
            "use_h": recipe.use_h,
            "use_br": recipe.use_br,
            "key_target": key_target,
            "value_target": value_target,
        }
        return OscarRotations(torch.stack(keys), torch.stack(values), {}, header)


def _forward_captured(model, seqs, callback, what: str, log, t0: float) -> None:
    """Each of ``seqs`` through ``model`` (batch 1, no cache), ``callback`` seeing every
    attention call (:func:`capture_attention`); logs ``what`` and the time since ``t0`` after
    each sequence."""
    device = next(model.parameters()).device
    with capture_attention(model, callback):
        for i, s in enumerate(seqs):
            model(input_ids=s.to(device)[None], use_cache=False, logits_to_keep=1)
            if log:
                log(
                    f"{what}: sequence {i + 1}/{len(seqs)} ({s.numel()} tokens), "
                    f"{time.perf_counter() - t0:.0f}s"
                )


@torch.no_grad()
def calibrate(
    model,
    sequences,
    *,
    proxy: bool = False,
    chunk: int = 512,
    dtype: torch.dtype = torch.float32,
    position_shifts: Sequence[int] = (0,),
    header: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> Calibration:
    """Accumulate every layer's covariance targets over ``sequences`` of token ids.

    Parameters
    ----------
    model : a transformers causal LM (Llama-style attention: post-RoPE Q/K/V reach the
        attention function).
    sequences : a list of 1-D token-id tensors (or a ``[N, T]`` tensor); each is one forward
        pass of batch 1, so a sequence's tokens attend causally to that sequence only.
    proxy : also accumulate the released code's diagonal value proxy (a second pass).
    chunk, dtype : query chunk and compute dtype of the score-weighted value target (its sums
        are float64 whatever ``dtype``).
    position_shifts : RoPE shifts (:mod:`foscar.oscar.positions`): the key targets (C_Q, K^T K,
        and the proxy's weights) are the mean over every sequence turned by each shift, so
        they describe the positions ``shift .. shift + T - 1``, e.g.
        ``position_shifts(2048, 8192)`` for a context of 8,192 from 2,048-token sequences.
        Values carry no RoPE and their targets do not depend on the shifts. Needs a RoPE model
        unless ``(0,)``.
    header : entries for the artifact's header (model, calibration text, ...).
    """
    shapes = model_shapes(model)
    check_head_dim(shapes["head_dim"])
    seqs = _sequences(sequences)
    shifts = check_shifts(position_shifts)
    views = shifted_views(model, shifts)
    moments = [
        LayerMoments(shapes["num_kv_heads"], shapes["head_dim"])
        for _ in range(shapes["num_layers"])
    ]
    t0 = time.perf_counter()

    def add(layer, q, k, v, scaling):
        moments[layer].add(q, k, v, scaling, chunk=chunk, dtype=dtype, shifted=views(q, k))

    _forward_captured(model, seqs, add, "calibration", log, t0)
    if proxy:
        key_targets = [m.target("key") for m in moments]

        def add_proxy(layer, q, k, v, scaling):
            for _, ks in views(q, k):
                moments[layer].add_proxy(ks, v, key_targets[layer])

        _forward_captured(model, seqs, add_proxy, "proxy pass", log, t0)
    info = {
        **(header or {}),
        "calibration_tokens": int(sum(s.numel() for s in seqs)),
        "calibration_sequences": [int(s.numel()) for s in seqs],
        "position_shifts": list(shifts),
        "calibration_seconds": round(time.perf_counter() - t0, 2),
        "value_target_chunk": chunk,
        "value_target_dtype": str(dtype).removeprefix("torch."),
    }
    return Calibration(moments, shapes["num_kv_heads"], shapes["head_dim"], info)


# ---------------------------------------------------------------------------- clip fitting
def _fake_quantize(x: torch.Tensor, f: QuantFormat, gptq: torch.Tensor | None = None):
    """Quantize-dequantize token rows ``x: [H, T, d]`` as the cache does (BF16 first; GPTQ's
    rounding with the factors ``gptq: [H, d, d]``, else to nearest)."""
    xb = x.to(torch.bfloat16)
    codes, scale, offset = quantize(xb, f) if gptq is None else quantize_gptq(xb, f, gptq)
    return dequantize(codes, scale, offset, f, dtype=torch.float32)


def gptq_factors(
    calibration: Calibration,
    rotations: OscarRotations,
    *,
    damp: float = 0.01,
    metrics: torch.Tensor | None = None,
) -> torch.Tensor:
    """GPTQ factors of the keys' metric for every layer and KV head, ``[L, H_kv, d, d]``
    float32: the metric ``M`` of the KV head in the basis ``rotations`` stores keys in,
    ``R^T M R``, through :func:`foscar.quantize.gptq_factor` (``damp`` times its mean diagonal
    added first). ``M`` is the queries' covariance (the keys' target, C_Q) unless ``metrics:
    [L, H_kv, d, d]`` (the model's coordinates) is given, e.g. :func:`attention_key_metrics`.
    Set them as ``rotations.key_gptq`` to round the keys by GPTQ at the cache write (and in
    :func:`fit_clips`)."""
    shape = (calibration.num_layers, calibration.num_kv_heads, calibration.head_dim)
    if metrics is not None and tuple(metrics.shape) != (*shape, shape[-1]):
        raise ValueError(
            f"metrics must be [num_layers={shape[0]}, num_kv_heads={shape[1]}, {shape[2]}, "
            f"{shape[2]}], got {list(metrics.shape)}"
        )
    out = []
    for layer in range(calibration.num_layers):
        if metrics is None:
            c = calibration.target(layer, "key", per_head=True)  # [H, d, d]
        else:
            c = metrics[layer].to(torch.float64)
        r = rotations.key[layer].to(torch.float64)  # [1 or H, d, d]
        out.append(gptq_factor(r.transpose(-1, -2) @ c @ r, damp))
    return torch.stack(out).to(torch.float32)


@torch.no_grad()
def attention_key_metrics(
    model,
    sequences,
    *,
    windows: tuple[int, int] = (64, 256),
    query_stride: int = 4,
    chunk: int = 512,
    position_shifts: Sequence[int] = (0,),
    log: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Every layer's attention-weighted key metric, ``[L, H_kv, d, d]`` float64 (the model's
    coordinates; :func:`foscar.oscar.covariance.attention_key_moment` says what it weighs).

    The keys each query reads quantized are those outside the BF16 ``windows = (sink,
    recent)`` the cache will keep, so the metric belongs to those windows. Queries: every
    ``query_stride``-th position of each sequence that reads any quantized key. Pass it to
    :func:`gptq_factors` as ``metrics``. A second pass over the text (the metric is not a
    rotation target); ``ValueError`` if the windows leave no key of any sequence quantized.
    ``position_shifts``: the queries turned by each RoPE shift too, as :func:`calibrate`'s.
    """
    shapes = model_shapes(model)
    seqs = _sequences(sequences)
    _check_windows(windows, seqs)
    views = shifted_views(model, position_shifts)
    if isinstance(query_stride, bool) or not isinstance(query_stride, int) or query_stride < 1:
        raise ValueError(f"query_stride must be an int >= 1, got {query_stride!r}")
    num_layers, h, d = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
    moment = torch.zeros(num_layers, h, d, d, dtype=torch.float64)
    weight = torch.zeros(num_layers, h, dtype=torch.float64)
    sink, recent = windows

    def add(layer, q, k, v, scaling):
        t = k.shape[1]
        # query n reads keys sink .. n - recent quantized (none before n = sink + recent)
        positions = torch.arange(sink + recent, t, query_stride, device=q.device)
        if not positions.numel():
            return
        j = torch.arange(t, device=q.device)
        visible = j <= positions[:, None]
        window = window_mask(positions, t, windows)
        quantized = visible if window is None else visible & ~window
        for qs, ks in views(q, k):
            m, w = attention_key_moment(
                qs[:, positions], ks, v, scaling, visible, quantized, chunk=chunk
            )
            moment[layer] += m.cpu()
            weight[layer] += w.cpu()

    _forward_captured(model, seqs, add, "attention key metric", log, time.perf_counter())
    if not bool((weight > 0).all()):
        raise ValueError(
            "the attention key metric has no weight for some layer and KV head (no query read "
            "a quantized key with any attention)"
        )
    return moment / weight[..., None, None]


def causal_attention(q, k, v, positions, scaling, *, kq=None, vq=None, window=None):
    """Queries ``q: [H_q, n, d]`` at ``positions`` over ``k, v: [H_kv, T, d]`` (causal).

    ``kq``, ``vq``: quantized K / V read instead of ``k``, ``v`` outside ``window``
    (``[n, T]`` bool: the keys each query reads from the BF16 windows; None: none).
    """
    group = q.shape[0] // k.shape[0]

    def heads(x):
        return x.repeat_interleave(group, 0)

    s = torch.einsum("hnd,htd->hnt", q, heads(k))
    if kq is not None:
        sq = torch.einsum("hnd,htd->hnt", q, heads(kq))
        s = sq if window is None else torch.where(window, s, sq)
    visible = torch.arange(k.shape[1], device=q.device) <= positions[:, None]
    p = torch.softmax((s * scaling).masked_fill(~visible, float("-inf")), -1)
    if vq is None:
        return torch.einsum("hnt,htd->hnd", p, heads(v))
    if window is None:
        return torch.einsum("hnt,htd->hnd", p, heads(vq))
    return torch.einsum("hnt,htd->hnd", p * window, heads(v)) + torch.einsum(
        "hnt,htd->hnd", p * ~window, heads(vq)
    )


def window_mask(positions: torch.Tensor, length: int, windows: tuple[int, int]):
    """``[n, T]`` bool: keys in the BF16 sink or in the recent window of each query (None if
    there are no windows). A decode at position ``t`` reads keys ``t+1-recent .. t`` from the
    recent window (the cache demotes one token at a time for token-wise groups)."""
    sink, recent = windows
    if not sink and not recent:
        return None
    j = torch.arange(length, device=positions.device)
    recent_keys = j >= positions[:, None] + 1 - recent if recent else j > positions[:, None]
    return (j < sink) | recent_keys


def _check_windows(windows, seqs: list[torch.Tensor]) -> None:
    """``windows`` must be ``(sink, recent)`` ints >= 0 leaving some key of ``seqs`` quantized."""
    if len(windows) != 2 or any(
        isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in windows
    ):
        raise ValueError(f"windows must be (sink, recent) non-negative ints, got {windows!r}")
    # a query at position p reads quantized keys only if p >= sink + recent: a sequence of
    # t <= sink + recent tokens gives every clip candidate zero error, and the "fitted" clips
    # would be min-max by the tie (windows of 64/2048 on 2,048-token sequences fitted every
    # clip to 1.0 and chose candidate "full" everywhere)
    if (windows[0] or windows[1]) and all(s.numel() <= sum(windows) for s in seqs):
        raise ValueError(
            f"windows={tuple(windows)} keep every key of the calibration sequences (at most "
            f"{max(s.numel() for s in seqs)} tokens) in BF16, so nothing quantized can be "
            f"measured; calibrate on sequences longer than sink + recent = {sum(windows)} tokens"
        )


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Rows ``x: [Hx, T, d]`` times ``R_{head}``; ``r: [1 or H, d, d]``."""
    h = r.shape[0]
    xg = x.float().unflatten(0, (h, x.shape[0] // h))
    return torch.einsum("hgtd,hde->hgte", xg, r.float()).flatten(0, 1)


@torch.no_grad()
def fit_clips(
    model,
    sequences,
    rotations: OscarRotations,
    *,
    bits: Sequence[int] = (2, 4),
    group_size: int | None = None,
    candidates: Sequence[float] = CLIP_CANDIDATES,
    num_queries: int = 64,
    windows: tuple[int, int] = (0, 0),
    position_shifts: Sequence[int] = (0,),
    log: Callable[[str], None] | None = None,
) -> OscarRotations:
    """Fit a clip ratio per layer for K and V of token-wise INT``bits`` (module docstring).

    Keys are rounded as the cache will round them: by GPTQ where ``rotations.key_gptq`` is set.
    Fills ``rotations.clips[(bits, "key"|"value")]`` (``[L]``) and records the mean relative
    attention-output error per candidate in ``rotations.header["clip_fit"]``. ``group_size``
    defaults to ``min(head_dim, 128)``. ``windows = (sink, recent)``: the BF16 tokens the cache
    will keep, which the fit leaves exact (the sink's first tokens draw much of the attention,
    so fitting without the windows the cache has fits the clips to the wrong tokens).
    ``position_shifts``: the keys' errors are summed over every sequence turned by each RoPE
    shift (:func:`calibrate`), so the key clips fit the keys at those positions; the values'
    errors, which no shift changes, are taken once. Returns ``rotations``.
    """
    shapes = model_shapes(model)
    rotations.check(
        num_layers=shapes["num_layers"],
        num_kv_heads=shapes["num_kv_heads"],
        head_dim=shapes["head_dim"],
    )
    seqs = _sequences(sequences)
    g = group_size or min(shapes["head_dim"], 128)
    _check_windows(windows, seqs)
    shifts = check_shifts(position_shifts)
    views = shifted_views(model, shifts)
    cands = [float(p) for p in candidates]
    for p in cands:
        QuantFormat(2, "token", g, p)  # validates every ratio
    # squared error and squared norm per (bits, role, layer, candidate)
    num_layers = shapes["num_layers"]
    err = torch.zeros(len(bits), 2, num_layers, len(cands), dtype=torch.float64)
    norm = torch.zeros(len(bits), 2, num_layers, dtype=torch.float64)

    def fit(layer, q, k, v, scaling):
        t = k.shape[1]
        n = min(num_queries, t - t // 2)
        positions = torch.linspace(t // 2, t - 1, n, device=q.device).round().long()
        rk, rv = rotations.key[layer].to(q.device), rotations.value[layer].to(q.device)
        key_gptq = None if rotations.key_gptq is None else rotations.key_gptq[layer]
        vr = _rotate(v, rv)
        # the cache rounds every token to BF16: so does the exact reference here
        vb = vr.to(torch.bfloat16).float()
        window = window_mask(positions, t, tuple(windows))
        for view, (qv, kv) in enumerate(views(q, k)):
            qs = _rotate(qv[:, positions], rk)
            kr = _rotate(kv, rk)
            kb = kr.to(torch.bfloat16).float()
            exact = causal_attention(qs, kb, vb, positions, scaling)
            exact_norm = float(exact.double().square().sum())
            for i, b in enumerate(bits):
                norm[i, 0, layer] += exact_norm
                if view == 0:  # a shift turns q and k alike: the values' errors stay the same
                    norm[i, 1, layer] += exact_norm
                for j, p in enumerate(cands):
                    f = QuantFormat(b, "token", g, None if p == 1.0 else p)
                    kq = _fake_quantize(kr, f, key_gptq)
                    ek = causal_attention(qs, kb, vb, positions, scaling, kq=kq, window=window)
                    err[i, 0, layer, j] += float((ek - exact).double().square().sum())
                    if view == 0:
                        vq = _fake_quantize(vr, f)
                        ev = causal_attention(qs, kb, vb, positions, scaling, vq=vq, window=window)
                        err[i, 1, layer, j] += float((ev - exact).double().square().sum())

    t0 = time.perf_counter()
    _forward_captured(model, seqs, fit, "clip fit", log, t0)
    rel = (err / norm[..., None]).sqrt()  # [bits, role, layer, candidate]
    table = {}
    for i, b in enumerate(bits):
        for j, role in enumerate(("key", "value")):
            best = rel[i, j].argmin(dim=-1)
            rotations.clips[(b, role)] = torch.tensor([cands[c] for c in best], dtype=torch.float64)
            table[f"int{b}.{role}"] = {
                "candidates": cands,
                "mean_relative_error": rel[i, j].mean(dim=0).tolist(),
                "fitted_mean_relative_error": float(rel[i, j].min(dim=-1).values.mean()),
                "fitted": [cands[c] for c in best],
                "fitted_relative_error": rel[i, j].min(dim=-1).values.tolist(),
            }
    rotations.header = {
        **rotations.header,
        "clip_fit": {
            "group_size": g,
            "key_rounding": "nearest" if rotations.key_gptq is None else "gptq",
            "num_queries": num_queries,
            "windows": list(windows),
            "tokens": int(sum(s.numel() for s in seqs)),
            "position_shifts": list(shifts),
            "seconds": round(time.perf_counter() - t0, 2),
            **table,
        },
    }
    return rotations


def _common_heads(candidates: dict[str, OscarRotations]) -> int:
    """The head count ``Hr`` the candidates share once per-layer ones (``Hr = 1``) are
    broadcast to the KV heads; ``ValueError`` naming the shapes unless they fit together."""
    shapes = {n: tuple(r.key.shape) for n, r in candidates.items()}
    layers_dims = {(s[0], s[2]) for s in shapes.values()}
    heads = {s[1] for s in shapes.values()} - {1}
    if len(layers_dims) != 1 or len(heads) > 1:
        raise ValueError(
            "candidates must share num_layers and head_dim, and be per layer ([L, 1, d, d]) or "
            f"per KV head of one count ([L, H, d, d]); got {shapes}"
        )
    return heads.pop() if heads else 1


@torch.no_grad()
def fit_candidates(
    model,
    sequences,
    candidates: dict[str, OscarRotations],
    *,
    bits: Sequence[int] = (2, 4),
    group_size: int | None = None,
    clip_candidates: Sequence[float] = CLIP_CANDIDATES,
    num_queries: int = 64,
    windows: tuple[int, int] = (0, 0),
    position_shifts: Sequence[int] = (0,),
    log: Callable[[str], None] | None = None,
) -> dict[str, OscarRotations]:
    """:func:`fit_clips` of every candidate rotation on ``sequences`` (each candidate gets its
    clips and ``header["clip_fit"]`` in place); returns ``candidates``, ready for
    :func:`choose_rotations`. Candidates may mix per-layer (``[L, 1, d, d]``) and per-KV-head
    (``[L, H, d, d]``) rotations."""
    if not candidates:
        raise ValueError("candidates must name at least one rotation")
    _common_heads(candidates)
    for name, rot in candidates.items():
        if log:
            log(f"selection: fitting clips of candidate {name!r}")
        fit_clips(
            model,
            sequences,
            rot,
            bits=bits,
            group_size=group_size,
            candidates=clip_candidates,
            num_queries=num_queries,
            windows=windows,
            position_shifts=position_shifts,
        )
    return candidates


def choose_rotations(fitted: dict[str, OscarRotations], *, select_bits: int = 2) -> OscarRotations:
    """Per layer and per K/V, the fitted candidate with the smallest attention error.

    ``fitted``: candidates whose clips :func:`fit_clips` (or :func:`fit_candidates`) fitted on
    the same sequences and windows. For each layer, K takes the rotation (and its fitted clip
    ratios for every width fitted for all candidates) of the candidate whose K error at
    ``select_bits`` is smallest, and V likewise. Per-layer candidates (``[L, 1, d, d]``) are
    broadcast to the KV heads when another candidate is per KV head (``[L, H, d, d]``); the
    result is then per KV head. The header records the choice per layer
    (``header["selection"]``) and every candidate's clip fit. The candidates are not modified.

    Candidates with GPTQ factors (``key_gptq``, their clips fitted with keys so rounded): all
    of them or none must have them. Each layer's key rotation then brings its own candidate's
    factors (the metric in that rotation's basis), so the keys are chosen by GPTQ errors.
    """
    if not fitted:
        raise ValueError("candidates must name at least one rotation")
    heads = _common_heads(fitted)
    names = list(fitted)
    unfitted = [n for n in names if "clip_fit" not in fitted[n].header]
    if unfitted:
        raise ValueError(f"candidates {unfitted} have no fitted clips (run fit_clips first)")
    with_gptq = [n for n in names if fitted[n].key_gptq is not None]
    if with_gptq and len(with_gptq) != len(names):
        raise ValueError(
            f"candidates {with_gptq} have GPTQ key factors and "
            f"{[n for n in names if n not in with_gptq]} do not: all or none must"
        )
    bits = sorted(set.intersection(*({b for b, _ in r.clips} for r in fitted.values())))
    if select_bits not in bits:
        raise ValueError(f"select_bits ({select_bits}) must be one of bits {tuple(bits)}")
    first = fitted[names[0]]
    layers = first.num_layers
    out = {"key": [], "value": []}
    clips = {(b, role): torch.zeros(layers, dtype=torch.float64) for b in bits for role in out}
    choice = {"key": [], "value": []}
    key_gptq = []
    for role in ("key", "value"):
        errors = torch.tensor(
            [
                fitted[n].header["clip_fit"][f"int{select_bits}.{role}"]["fitted_relative_error"]
                for n in names
            ]
        )  # [candidate, layer]
        best = errors.argmin(dim=0)
        for layer in range(layers):
            r = fitted[names[int(best[layer])]]
            out[role].append(getattr(r, role)[layer].expand(heads, -1, -1))
            if role == "key" and with_gptq:
                key_gptq.append(r.key_gptq[layer])
            for b in bits:
                clips[(b, role)][layer] = r.clips[(b, role)][layer]
            choice[role].append(names[int(best[layer])])
        choice[f"{role}_error"] = errors.min(dim=0).values.mean().item()
        choice[f"{role}_error_per_candidate"] = dict(zip(names, errors.mean(dim=1).tolist()))
    header = {
        **first.header,
        "recipe": "selected per layer from " + ", ".join(names),
        "selection": {"bits": select_bits, **choice},
        "candidates": {
            n: {
                **{k: fitted[n].header.get(k) for k in ("recipe", "key_target", "value_target")},
                "per_head": fitted[n].per_head,
            }
            for n in names
        },
    }
    header.pop("clip_fit", None)
    header["clip_fit"] = {n: fitted[n].header["clip_fit"] for n in names}
    return OscarRotations(
        torch.stack(out["key"]),
        torch.stack(out["value"]),
        clips,
        header,
        torch.stack(key_gptq) if with_gptq else None,
    )


@torch.no_grad()
def select_rotations(
    model,
    sequences,
    candidates: dict[str, OscarRotations],
    *,
    bits: Sequence[int] = (2, 4),
    select_bits: int = 2,
    group_size: int | None = None,
    clip_candidates: Sequence[float] = CLIP_CANDIDATES,
    num_queries: int = 64,
    windows: tuple[int, int] = (0, 0),
    position_shifts: Sequence[int] = (0,),
    log: Callable[[str], None] | None = None,
) -> OscarRotations:
    """Per layer and per K/V, the candidate rotation with the smallest fitted attention error.

    Every candidate (e.g. ``{"full": U*H*P_br, "no-u": H*P_br}``; per layer ``[L, 1, d, d]``
    or per KV head ``[L, H, d, d]``, mixed as needed) gets its clips fitted
    (:func:`fit_candidates`) on ``sequences``; :func:`choose_rotations` then takes, for each
    layer, K's rotation and fitted clip ratios (every width of ``bits``) from the candidate
    whose K error at ``select_bits`` is smallest, and V's likewise. The header records the
    choice per layer.
    """
    # choose_rotations checks this too, but only after the fit (minutes): fail first
    if select_bits not in bits:
        raise ValueError(f"select_bits ({select_bits}) must be one of bits {tuple(bits)}")
    fitted = fit_candidates(  # refuses an empty ``candidates`` before any work
        model,
        sequences,
        candidates,
        bits=bits,
        group_size=group_size,
        clip_candidates=clip_candidates,
        num_queries=num_queries,
        windows=windows,
        position_shifts=position_shifts,
        log=log,
    )
    return choose_rotations(fitted, select_bits=select_bits)


def default_sequences(tok, tokens: int, seq_len: int, text: str) -> list[torch.Tensor]:
    """``ceil(tokens / seq_len)`` consecutive pieces of ``text``'s first ``tokens`` tokens."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {tokens}")
    ids = torch.tensor(ids[:tokens])
    return [ids[a : a + seq_len] for a in range(0, tokens, seq_len) if tokens - a >= 2]


def _select_candidates(
    cal: Calibration,
    rot: OscarRotations,
    recipe: str,
    targets: dict,
    per_head: bool,
    kv_heads: bool,
) -> dict[str, OscarRotations]:
    """The candidates of ``calibrate_rotations(select=True)``, named as ``foscar eval``'s
    OSCAR-select candidates (the same set for the default recipe): the recipe's rotation
    (``rot``), H*P_br ("no-u"), the recipe on the plain second moments K^TK / V^TV ("ktk")
    unless its targets are those already; with ``kv_heads`` both target sets' rotations per KV
    head too."""
    reads_targets = recipe not in ("no-u", "none", "hadamard")
    plain = targets == PLAIN_TARGETS or not reads_targets
    candidates = {recipe: rot, "no-u": cal.rotations("no-u", **targets, per_head=per_head)}
    if not plain:
        candidates["ktk"] = cal.rotations(recipe, **PLAIN_TARGETS, per_head=per_head)
    if kv_heads:
        candidates[f"{recipe}-kvh"] = cal.rotations(recipe, **targets, per_head=True)
        if not plain:
            candidates["ktk-kvh"] = cal.rotations(recipe, **PLAIN_TARGETS, per_head=True)
    return candidates


def calibrate_rotations(
    model,
    tok,
    text: str,
    *,
    tokens: int = 8192,
    seq_len: int = 2048,
    context: int | None = None,
    recipe: str = "full",
    key_target: str = "query",
    value_target: str = "attention",
    per_head: bool = False,
    select: bool = False,
    select_kv_heads: bool = False,
    gptq_keys: bool = False,
    gptq_metric: str = "query",
    clip_bits: Sequence[int] = (2, 4),
    clip_tokens: int | None = None,
    clip_queries: int = 64,
    fit_windows: tuple[int, int] = (64, 256),
    chunk: int = 512,
    header: dict | None = None,
    log: Callable[[str], None] = print,
) -> OscarRotations:
    """OSCAR's rotations and clip ratios for ``model`` from the first ``tokens`` tokens of
    ``text``: what ``foscar calibrate`` writes.

    The text is cut into sequences of ``seq_len`` tokens (:func:`default_sequences`);
    :func:`calibrate` accumulates the targets, with the keys' statistics covering positions
    ``0 .. context - 1`` by RoPE shifts (None: the model's ``max_position_embeddings``;
    ``context == seq_len``: the sequences' own positions). :meth:`Calibration.rotations` builds
    ``recipe``'s rotations (per layer, or per KV head with ``per_head``) of ``key_target`` /
    ``value_target``. ``gptq_keys``: GPTQ rounding factors of the keys' metric (``gptq_metric``
    "query": the queries' covariance; "attention": :func:`attention_key_metrics`, a second pass
    with ``fit_windows`` left exact). Clips are fitted for each width of ``clip_bits`` (none:
    no fit) on ``clip_tokens`` tokens (default one sequence) with ``clip_queries`` query
    positions per sequence and ``fit_windows`` (BF16 sink, recent) left exact; ``select``
    chooses per layer among :func:`_select_candidates` (needs 2 in ``clip_bits``), with
    ``select_kv_heads`` per-KV-head candidates too. ``header`` is stored in the result's
    header, with the timings.
    """
    if select and 2 not in clip_bits:
        raise ValueError("select chooses by the INT2 error: clip_bits must include 2")
    if select_kv_heads and not select:
        raise ValueError("select_kv_heads adds candidates to select: pass select=True")
    if gptq_metric != "query" and not gptq_keys:
        raise ValueError("gptq_metric chooses the metric of gptq_keys: pass gptq_keys=True")
    t0 = time.perf_counter()
    seqs = default_sequences(tok, tokens, seq_len, text)
    context = context or model_shapes(model)["max_positions"]
    shifts = position_shifts(seq_len, context)
    log(
        f"calibrating on {tokens} tokens, positions 0..{seq_len + shifts[-1] - 1} "
        f"(RoPE shifts {list(shifts)})"
    )
    cal = calibrate(
        model,
        seqs,
        proxy=value_target == "proxy",
        chunk=chunk,
        position_shifts=shifts,
        header=dict(header or {}),
        log=log,
    )
    t_cal = time.perf_counter() - t0
    t1 = time.perf_counter()
    targets = dict(key_target=key_target, value_target=value_target)
    rot = cal.rotations(recipe, **targets, per_head=per_head)
    metrics = None
    if gptq_keys and gptq_metric == "attention":
        metrics = attention_key_metrics(
            model, seqs, windows=tuple(fit_windows), position_shifts=shifts, log=log
        )
    if gptq_keys:
        rot.key_gptq = gptq_factors(cal, rot, metrics=metrics)
    t_rot = time.perf_counter() - t1
    t_fit = 0.0
    if clip_bits:
        t2 = time.perf_counter()
        n = seq_len if clip_tokens is None else clip_tokens
        clip_seqs = default_sequences(tok, min(n, tokens), seq_len, text)
        fit = dict(
            bits=tuple(clip_bits),
            num_queries=clip_queries,
            windows=tuple(fit_windows),
            position_shifts=shifts,
            log=log,
        )
        if select:
            candidates = _select_candidates(cal, rot, recipe, targets, per_head, select_kv_heads)
            if gptq_keys:  # every candidate's keys rounded by GPTQ: chosen by those errors
                for c in candidates.values():
                    if c.key_gptq is None:  # (the recipe's already has its factors)
                        c.key_gptq = gptq_factors(cal, c, metrics=metrics)
            rot = select_rotations(model, clip_seqs, candidates, **fit)
            chosen = rot.header["selection"]
            for role in ("key", "value"):
                n = chosen[role].count(recipe)
                log(f"{role}: {recipe} rotation kept in {n} of {rot.num_layers} layers")
                for name in list(candidates)[2:]:
                    log(f"{role}: {name} in {chosen[role].count(name)} of {rot.num_layers} layers")
        else:
            fit_clips(model, clip_seqs, rot, **fit)
        t_fit = time.perf_counter() - t2
        for b in clip_bits:
            for role in ("key", "value"):
                c = rot.clips[(b, role)]
                log(
                    f"INT{b} {role} clip ratios: mean {float(c.mean()):.3f}, "
                    f"min {float(c.min()):.2f}, max {float(c.max()):.2f}"
                )
    if {2, 4} <= set(clip_bits):
        # where INT4 keys or values buy most (foscar.oscar.widths_by_error, layer_width_formats)
        for role in ("key", "value"):
            order = layers_by_gain(rot, role=role)
            log(f"layers whose {role}s gain most from INT4 over INT2, best first: {order}")
    if gptq_keys:
        rot.header["gptq_key_metric"] = {"name": gptq_metric}
        if metrics is not None:
            rot.header["gptq_key_metric"]["windows"] = list(fit_windows)
    rot.header["timing_seconds"] = {
        "targets": round(t_cal, 1),
        "rotations": round(t_rot, 2),
        "clip_fit": round(t_fit, 1),
        "threads": torch.get_num_threads(),
    }
    return rot
