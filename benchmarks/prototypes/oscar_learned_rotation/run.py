# ruff: noqa: E402, E501
"""Learned key rotations (prototype): does gradient descent beat U*H*P_br for INT2 keys?

OSCAR's rotation is closed-form: the optimum of a surrogate (the quantization error frozen as
diagonal). Any orthogonal R keeps attention exact and the kernels unchanged (queries and keys
are rotated alike), so R can instead be fitted to what we measure: the attention output's
error with the keys INT2, on calibration text. R_h = R0_h expm(A_h - A_h^T) per KV head,
A_h from zero, Adam; the quantizer in the loop is the cache's per-token clipped min-max INT2
with rounding passed straight through (the cache rounds by GPTQ; the learned R is then scored
with GPTQ keys at its own factors).

Calibration: 4 x 2,048 tokens of the Python reference at RoPE shifts 0/2K/4K/6K (the default);
held out: 2 x 4,096 tokens of the FOSCAR paper, 64 queries in the last 512 positions, BF16
64/256 windows exact, V exact; relative error of the attention output at the best clip.

    OMP_NUM_THREADS=2 python benchmarks/prototypes/oscar_learned_rotation/run.py OUT.json [STEPS] [LAYERS...]
"""

import json
import sys
import time

import torch

from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.formats import QuantFormat
from foscar.oscar.calibrate import _causal_attention, _rotate, _window_mask, default_sequences
from foscar.oscar.capture import capture_attention, model_shapes
from foscar.oscar.positions import position_shifts, shifted_views
from foscar.oscar.rotation import RECIPES, rotation
from foscar.quantize import dequantize, gptq_factor, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "learned_rotation.json"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 150
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85)
TRAIN_CLIP = 0.92
WINDOWS = (64, 256)
NQ = 64
torch.manual_seed(0)

t0 = time.perf_counter()
model, tok = load_model()
shapes = model_shapes(model)
L, H, d = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
LAYERS = [int(x) for x in sys.argv[3:]] or list(range(L))
views = shifted_views(model, position_shifts(2048, 8192))
CAL = {layer: [] for layer in LAYERS}
qq = torch.zeros(L, H, d, d, dtype=torch.float64)
kk = torch.zeros(L, H, d, d, dtype=torch.float64)


def capture(layer, q, k, v, scaling):
    g = q.shape[0] // H
    for qv, kv in views(q, k):
        qs = qv.double().reshape(H, -1, d)
        qq[layer] += (qs.transpose(1, 2) @ qs) / g
        kk[layer] += kv.double().transpose(1, 2) @ kv.double()
        if layer in CAL:
            CAL[layer].append((qv.float().clone(), kv.float().clone(), v.to(torch.bfloat16).float().clone(), scaling))


with torch.no_grad(), capture_attention(model, capture):
    for s in default_sequences(tok, 8192, 2048, texts.python_reference().text):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"calibration captured: {time.perf_counter() - t0:.0f}s", flush=True)

ids = tok(texts.paper().text, return_tensors="pt").input_ids[0]
HELD = {layer: [] for layer in LAYERS}


def capture_held(layer, q, k, v, scaling):
    if layer in HELD:
        HELD[layer].append((q.float().clone(), k.float().clone(), v.to(torch.bfloat16).float().clone(), scaling))


with torch.no_grad(), capture_attention(model, capture_held):
    for s in (ids[256 : 256 + 4096], ids[256 + 4096 : 256 + 8192]):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"held-out captured: {time.perf_counter() - t0:.0f}s", flush=True)


def sym(c):
    return (c + c.transpose(-1, -2)) / 2


def ste_int2(x: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-token clipped min-max INT2 of rows ``x: [..., d]`` (one group), rounding straight-through."""
    dd = x.shape[-1]
    tau = torch.kthvalue(x.abs(), min(int(clip * dd), dd - 1) + 1, dim=-1, keepdim=True).values
    xc = torch.maximum(torch.minimum(x, tau), -tau)
    lo = xc.amin(-1, keepdim=True)
    s = (xc.amax(-1, keepdim=True) - lo).clamp_min(1e-8) / 3
    c = (xc - lo) / s
    c = c + (torch.floor(c + 0.5).clamp(0, 3) - c).detach()
    return c * s + lo


def attention_error(r, q, k, v, scaling, positions, quant):
    qs = _rotate(q[:, positions], r)
    kr = _rotate(k, r)
    window = _window_mask(positions, k.shape[1], WINDOWS)
    exact = _causal_attention(q[:, positions], k, v, positions, scaling)
    out = _causal_attention(qs, kr, v, positions, scaling, kq=quant(kr), window=window)
    return (out - exact).square().sum(), exact.square().sum()


def train(layer, r0):
    a = torch.zeros(H, d, d, requires_grad=True)
    opt = torch.optim.Adam([a], lr=2e-3)
    data = CAL[layer]
    history = []
    for step in range(STEPS):
        q, k, v, scaling = data[step % len(data)]
        t = k.shape[1]
        positions = torch.randint(sum(WINDOWS), t, (NQ,)).sort().values
        r = r0 @ torch.linalg.matrix_exp(a - a.transpose(1, 2))
        e, n = attention_error(r, q, k, v, scaling, positions, lambda x: ste_int2(x, TRAIN_CLIP))
        loss = e / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(float(loss))
    with torch.no_grad():
        return (r0 @ torch.linalg.matrix_exp(a - a.transpose(1, 2))).double(), history


@torch.no_grad()
def held_error(layer, r, factor):
    """Best-clip relative error on the held-out text, keys rounded by GPTQ (factor) or to nearest."""
    errs = torch.zeros(len(CLIPS), dtype=torch.float64)
    norm = 0.0
    rf = r.float()
    for q, k, v, scaling in HELD[layer]:
        t = k.shape[1]
        positions = torch.linspace(t - 512, t - 1, NQ).round().long()
        window = _window_mask(positions, t, WINDOWS)
        qs = _rotate(q[:, positions], rf)
        kr = _rotate(k, rf).to(torch.bfloat16)
        exact = _causal_attention(qs, kr.float(), v, positions, scaling)
        norm += float(exact.double().square().sum())
        for j, p in enumerate(CLIPS):
            f = QuantFormat(2, "token", 64, None if p == 1.0 else p)
            codes = quantize_gptq(kr, f, factor.float()) if factor is not None else None
            kq = dequantize(*codes, f) if codes is not None else dequantize(*__import__("foscar.quantize", fromlist=["quantize"]).quantize(kr, f), f)
            out = _causal_attention(qs, kr.float(), v, positions, scaling, kq=kq, window=window)
            errs[j] += float((out - exact).double().square().sum())
    rel = (errs / norm).sqrt()
    return float(rel.min()), CLIPS[int(rel.argmin())]


CQ = sym(qq)
rows = {}
for layer in LAYERS:
    tl = time.perf_counter()
    row = {}
    for name in ("full", "no-u"):
        r0 = rotation(sym(kk[layer]), RECIPES[name])
        fac0 = gptq_factor(r0.transpose(-1, -2) @ CQ[layer] @ r0)
        row[name] = {"rtn": held_error(layer, r0, None), "gptq": held_error(layer, r0, fac0)}
        r, hist = train(layer, r0.float())
        fac = gptq_factor(r.transpose(-1, -2) @ CQ[layer] @ r)
        row[name + "+learned"] = {"rtn": held_error(layer, r, None), "gptq": held_error(layer, r, fac), "loss_first_last": [sum(hist[:10]) / 10, sum(hist[-10:]) / 10]}
    rows[layer] = row
    print(f"layer {layer:2d} ({time.perf_counter() - tl:.0f}s): " + "; ".join(f"{n} rtn {v['rtn'][0]:.4f} gptq {v['gptq'][0]:.4f}" for n, v in row.items()) + f"  train loss {row['full+learned']['loss_first_last'][0]:.4f}->{row['full+learned']['loss_first_last'][1]:.4f}", flush=True)
    json.dump(rows, open(OUT, "w"), indent=1)


def mean(name, kind):
    return sum(rows[layer][name][kind][0] for layer in LAYERS) / len(LAYERS)


base = [min(rows[layer]["full"]["gptq"][0], rows[layer]["no-u"]["gptq"][0]) for layer in LAYERS]
best = [min(rows[layer][n]["gptq"][0] for n in rows[layer]) for layer in LAYERS]
for name in ("full", "no-u", "full+learned", "no-u+learned"):
    print(f"{name:14s} rtn {mean(name, 'rtn'):.4f}  gptq {mean(name, 'gptq'):.4f}")
print(f"select (best of full, no-u, GPTQ) {sum(base) / len(base):.4f}; best of all four {sum(best) / len(best):.4f}")
print(f"done {time.perf_counter() - t0:.0f}s")
