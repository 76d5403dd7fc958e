# ruff: noqa: E402, E501
"""A BF16 key residual along the queries' top directions (prototype): is it worth a format?

Per token and KV head, store r fp16 numbers besides the INT2 row: the key error's components
along the top-r eigenvectors of the metric H = R^T C_Q R (c_t = U_r^T (k_t - k_hat_t)). The
decode score becomes s_t (q' . codes_t) + z_t sum(q') + (U_r^T q') . c_t: one more per-token
term beside the offset's, r/4 bits per key element at head_dim 64 (r/8 per K and V element).
Variants:
- "res r": GPTQ's codes as shipped, then the residual;
- "proj r": GPTQ under the metric with the top-r directions removed (the residual corrects
  them exactly, so the codes need not spend effort there), then the residual;
- "int4": INT4 GPTQ keys, the per-layer upgrade the 4.51-bit recipe buys (2 bits per key
  element in that layer), to compare what a bit buys each way.
The measure is ``oscar_heldout``'s (as oscar_gptq_refine's): held-out attention-output error,
best clip per layer, "select" of U*H*P_br / H*P_br of K^T K per KV head.

    OMP_NUM_THREADS=2 python benchmarks/prototypes/oscar_key_residual/run.py OUT.json
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

OUT = sys.argv[1] if len(sys.argv) > 1 else "key_residual.json"
RANKS = (1, 2, 4)

t0 = time.perf_counter()
model, tok = load_model()
L = model_shapes(model)["num_layers"]
stats = calibration_statistics(model, tok)
print(f"statistics: {time.perf_counter() - t0:.0f}s", flush=True)


VARIANTS = ("gptq", *(f"res {r}" for r in RANKS), *(f"proj {r}" for r in RANKS), "int4")
rot = {}
spectrum = {}
for name in ROTATIONS:
    per_layer = []
    top_share = torch.zeros(L, len(RANKS), dtype=torch.float64)
    for layer in range(L):
        r, hmat = key_rotations(stats, name, layer)
        evals, evecs = torch.linalg.eigh(hmat)  # ascending
        evals, evecs = evals.flip(-1), evecs.flip(-1)
        trace = evals.sum(-1)
        entry = {
            "r": r.float(),
            "factor": gptq_factor(hmat).float(),
            "basis": {},
            "proj_factor": {},
        }
        for i, rank in enumerate(RANKS):
            top_share[layer, i] = (evals[:, :rank].sum(-1) / trace).mean()
            u = evecs[:, :, :rank]  # [H, d, r]
            entry["basis"][rank] = u.float()
            rest = hmat - u @ torch.diag_embed(evals[:, :rank]) @ u.transpose(-1, -2)
            entry["proj_factor"][rank] = gptq_factor(rest).float()
        per_layer.append(entry)
    rot[name] = per_layer
    spectrum[name] = top_share
    print(
        f"{name}: share of tr(H) in the top 1/2/4 directions, mean over layers and heads: "
        + " / ".join(f"{float(top_share[:, i].mean()):.3f}" for i in range(len(RANKS))),
        flush=True,
    )

HELD = held_out(tok)
err = {(n, v): torch.zeros(L, len(CLIPS), dtype=torch.float64) for n in rot for v in VARIANTS}
norm = {n: torch.zeros(L, dtype=torch.float64) for n in rot}


def with_residual(x, kq, basis):
    """kq plus the error's fp16-rounded components along basis [H, d, r]."""
    coeff = ((x - kq) @ basis).to(torch.float16).float()  # [H, T, r]
    return kq + coeff @ basis.transpose(-1, -2)


def measure(layer, q, k, v, scaling):
    for name, per_layer in rot.items():
        entry = per_layer[layer]
        held = rotated_layer(q, k, v, entry["r"], scaling)
        positions, window, qs, kr, x, vb, exact = (
            held[n] for n in ("positions", "window", "qs", "kr", "x", "vb", "exact")
        )
        norm[name][layer] += float(exact.double().square().sum())
        for j, p in enumerate(CLIPS):
            clip = None if p == 1.0 else p
            codes, scale, lo = quantize_gptq(kr, QuantFormat(2, "token", 64, clip), entry["factor"])
            base = codes.float() * scale + lo
            keys = {"gptq": base}
            for rank in RANKS:
                keys[f"res {rank}"] = with_residual(x, base, entry["basis"][rank])
                c2, s2, z2 = quantize_gptq(
                    kr, QuantFormat(2, "token", 64, clip), entry["proj_factor"][rank]
                )
                keys[f"proj {rank}"] = with_residual(x, c2.float() * s2 + z2, entry["basis"][rank])
            c4, s4, z4 = quantize_gptq(kr, QuantFormat(4, "token", 64, clip), entry["factor"])
            keys["int4"] = c4.float() * s4 + z4
            for var, kq in keys.items():
                out = _causal_attention(qs, x, vb, positions, scaling, kq=kq, window=window)
                err[name, var][layer, j] += float((out - exact).double().square().sum())
    print(f"  layer {layer}: {time.perf_counter() - t0:.0f}s", flush=True)


with capture_attention(model, measure):
    for s in HELD:
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"held-out: {time.perf_counter() - t0:.0f}s", flush=True)

rows = {}
for (name, var), e in err.items():
    best = best_clip_errors(e, norm[name])
    rows[f"{name}/{var}"] = {"per_layer": best.tolist(), "mean": float(best.mean())}
sel = {
    var: select({n: torch.tensor(rows[f"{n}/{var}"]["per_layer"]) for n in ROTATIONS})
    for var in VARIANTS
}
for var, v in sel.items():
    worst6 = torch.topk(sel["gptq"], 6).indices
    print(
        f"select {var:7s} mean {v.mean():.4f}  ratio {(v / sel['gptq']).mean():.3f}  six worst layers {v[worst6].mean():.4f} (gptq {sel['gptq'][worst6].mean():.4f})"
    )
    rows[f"select/{var}"] = {"per_layer": v.tolist(), "mean": float(v.mean())}
# the 4.51-bit recipe's key side at equal bits: INT4 in the k layers where it helps most
gain = sel["gptq"] - sel["int4"]
for k_layers in (4, 8, 10, 15):
    pick = torch.topk(gain, k_layers).indices
    mixed = sel["gptq"].clone()
    mixed[pick] = sel["int4"][pick]
    extra = 2 * k_layers / L  # key bits per key element, averaged over layers
    print(
        f"INT4 keys in {k_layers:2d} layers: mean {mixed.mean():.4f}  (+{extra:.2f} key bits/elem)"
    )
    rows[f"select/int4 in {k_layers} layers"] = {
        "per_layer": mixed.tolist(),
        "mean": float(mixed.mean()),
        "extra_key_bits": extra,
    }
for rank in RANKS:
    print(f"residual rank {rank}: +{rank * 16 / model_shapes(model)['head_dim']:.2f} key bits/elem")
rows["spectrum_top_share"] = {n: s.tolist() for n, s in spectrum.items()}
json.dump(rows, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
