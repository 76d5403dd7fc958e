# ruff: noqa: E402, E501
"""Pinned BF16 tokens (prototype): is INT2 keys' error concentrated on a few tokens?

Decode attention is a sum over the cached tokens, so a token kept in BF16 need not be one of
the first or the last ones: a cache could keep any token's key exact (a "pinned" set beside
the sink window). Worth a format only if a small set of tokens, chosen when the token is
written, carries much of the error. Per layer, the held-out attention-output error of the
shipped INT2 keys (GPTQ, select of U*H*P_br / H*P_br per KV head, best clip) when the top
f of the tokens are kept exact, by:
- "oracle": the attention the held-out queries actually give the token (mean over query heads
  and queries; not known at write time: the bound of what any choice can do);
- "error": the token's GPTQ error in the queries' metric, sum over KV heads of e^T H e;
- "norm": the key's size in that metric, k^T H k;
- "magnet": the token's logit under the calibration's mean query of each KV head (tokens every
  query attends to, like the sink).
Keys only (values exact), BF16 64/256 windows exact: ``oscar_heldout``'s measure. A pinned key costs
16 - 3 = 13 more bits: f = 1% of the tokens is +0.13 key bits per element.

    OMP_NUM_THREADS=2 python benchmarks/prototypes/oscar_pinned_tokens/run.py OUT.json
"""

import json
import sys
import time
from pathlib import Path

import torch

torch.set_grad_enabled(False)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/prototypes
from oscar_heldout import (
    CLIPS,
    ROTATIONS,
    WINDOWS,
    best_clip_errors,
    calibration_statistics,
    held_out,
    key_rotations,
    rotated_layer,
    select,
)

from foscar.eval.model import load_model
from foscar.formats import QuantFormat
from foscar.oscar.calibrate import _causal_attention
from foscar.oscar.capture import capture_attention, model_shapes
from foscar.quantize import gptq_factor, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "pinned_tokens.json"
FRACTIONS = (0.005, 0.01, 0.02, 0.04)
CRITERIA = ("oracle", "error", "norm", "magnet")

t0 = time.perf_counter()
model, tok = load_model()
L, H = model_shapes(model)["num_layers"], model_shapes(model)["num_kv_heads"]
stats = calibration_statistics(model, tok)
print(f"statistics: {time.perf_counter() - t0:.0f}s", flush=True)

rot = {}
for name in ROTATIONS:
    per_layer = []
    for layer in range(L):
        r, hmat = key_rotations(stats, name, layer)
        mean_q = stats["mean_q"][layer][:, None, :] @ r  # [H, 1, d] rotated
        per_layer.append({"r": r.float(), "factor": gptq_factor(hmat).float(),
                          "h": hmat.float(), "mean_q": mean_q.float()})  # fmt: skip
    rot[name] = per_layer

HELD = held_out(tok)
VARIANTS = ["none", *(f"{c} {f}" for c in CRITERIA for f in FRACTIONS)]
err = {(n, v): torch.zeros(L, len(CLIPS), dtype=torch.float64) for n in rot for v in VARIANTS}
norm = {n: torch.zeros(L, dtype=torch.float64) for n in rot}
# how much of the pinned set each criterion shares with the oracle's (at 1%)
overlap = {c: torch.zeros(L, dtype=torch.float64) for c in CRITERIA}


def top_mask(score: torch.Tensor, fraction: float, sink: int) -> torch.Tensor:
    """[T] bool: the top ``fraction`` of the tokens after the sink by ``score``."""
    t = score.shape[0]
    k = max(1, round(fraction * t))
    s = score.clone()
    s[:sink] = float("-inf")
    mask = torch.zeros(t, dtype=torch.bool)
    mask[torch.topk(s, k).indices] = True
    return mask


def measure(layer, q, k, v, scaling):
    t = k.shape[1]
    for name, per_layer in rot.items():
        entry = per_layer[layer]
        held = rotated_layer(q, k, v, entry["r"], scaling)
        positions, window, qs, kr, x, vb, exact = (
            held[n] for n in ("positions", "window", "qs", "kr", "x", "vb", "exact")
        )
        norm[name][layer] += float(exact.double().square().sum())
        # the attention each token receives from the held-out queries (exact keys)
        group = qs.shape[0] // H
        logits = torch.einsum("hnd,htd->hnt", qs, x.repeat_interleave(group, 0)) * scaling
        visible = torch.arange(t) <= positions[:, None]
        p = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
        received = p.mean((0, 1))
        magnet = (torch.einsum("hod,htd->ht", entry["mean_q"], x) * scaling).amax(0)
        keynorm = torch.einsum("htd,hde,hte->t", x, entry["h"], x)
        for j, clip in enumerate(CLIPS):
            f = QuantFormat(2, "token", 64, None if clip == 1.0 else clip)
            codes, sc, lo = quantize_gptq(kr, f, entry["factor"])
            kq = codes.float() * sc + lo
            e = x - kq
            score = {"oracle": received, "error": torch.einsum("htd,hde,hte->t", e, entry["h"], e),
                     "norm": keynorm, "magnet": magnet}  # fmt: skip
            out = _causal_attention(qs, x, vb, positions, scaling, kq=kq, window=window)
            err[name, "none"][layer, j] += float((out - exact).double().square().sum())
            for c in CRITERIA:
                for frac in FRACTIONS:
                    pinned = top_mask(score[c], frac, WINDOWS[0])
                    out = _causal_attention(
                        qs, x, vb, positions, scaling, kq=kq, window=window | pinned
                    )
                    err[name, f"{c} {frac}"][layer, j] += float(
                        (out - exact).double().square().sum()
                    )
                if name == "full" and j == 2:
                    a, b = (
                        top_mask(score[c], 0.01, WINDOWS[0]),
                        top_mask(received, 0.01, WINDOWS[0]),
                    )
                    overlap[c][layer] += float((a & b).sum() / b.sum()) / len(HELD)
    print(f"  layer {layer}: {time.perf_counter() - t0:.0f}s", flush=True)


with capture_attention(model, measure):
    for s in HELD:
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"held-out: {time.perf_counter() - t0:.0f}s", flush=True)

sel = {v: select({n: best_clip_errors(err[n, v], norm[n]) for n in ROTATIONS}) for v in VARIANTS}
base = sel["none"]
worst6 = torch.topk(base, 6).indices
print(
    f"select, INT2 GPTQ keys, nothing pinned: mean {base.mean():.4f}, six worst layers {base[worst6].mean():.4f}"
)
for c in CRITERIA:
    cells = []
    for frac in FRACTIONS:
        v = sel[f"{c} {frac}"]
        cells.append(
            f"{100 * frac:.1f}%: {v.mean():.4f} ({(v.mean() / base.mean() - 1) * 100:+.0f}%)"
        )
    print(f"{c:7s} " + "  ".join(cells) + f"   overlap with oracle at 1%: {overlap[c].mean():.2f}")
for frac in FRACTIONS:
    print(f"pinning {100 * frac:.1f}% of the keys: +{13 * frac:.3f} key bits per element")
json.dump(
    {
        "select": {v: t.tolist() for v, t in sel.items()},
        "overlap_with_oracle_1pct": {c: o.tolist() for c, o in overlap.items()},
    },
    open(OUT, "w"),
    indent=1,
)
print(f"done {time.perf_counter() - t0:.0f}s")
