# ruff: noqa: E402, E501
"""Bit allocation inside a head from INT2 digits (prototype): is it worth building?

OSCAR spreads every key direction evenly over the head's INT2 codes (the Hadamard flattens
the metric's diagonal). Transform coding says more: whiten the error metric (the queries'
covariance C_Q), take the keys' principal axes in that space (variances lambda_i), and give
the strong axes more bits and the weak ones none, with one quantization step for all.
The INT2 cache can hold that without a new format: an INT4 code c = 4a + b of one axis is two
INT2 codes (a, b) in two channels whose query entries carry the weights 4 and 1; the group's
scale and offset stay one per token. The query side becomes a general (non-orthogonal) matrix.

Held out (the FOSCAR paper, 2 x 4,096 tokens, 64 queries in the last 512 positions of each),
K alone quantized, V exact, BF16 64/256 windows exact or projected on what the digits can hold;
relative attention-output error per layer; calibration 4 x 2,048 tokens at RoPE shifts over
0-8K (the shipped default).

    OMP_NUM_THREADS=2 python benchmarks/prototypes/oscar_bit_allocation/run.py OUT.json
"""

import json
import sys
import time

import torch

torch.set_grad_enabled(False)
from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.formats import QuantFormat
from foscar.oscar.calibrate import _causal_attention, _rotate, _window_mask, default_sequences
from foscar.oscar.capture import capture_attention, model_shapes
from foscar.oscar.positions import position_shifts, shifted_views
from foscar.oscar.rotation import RECIPES, rotation
from foscar.quantize import dequantize, gptq_factor, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "bit_allocation.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85)
WINDOWS = (64, 256)
NQ = 64
# MSE per unit variance of a Gaussian under 0, 1, 2, 3 INT2 digits (0, 2, 4, 6 bits; Lloyd-Max)
DIGIT_MSE = (1.0, 0.1175, 0.009497, 0.00069)
STEP_FACTORS = (1.0, 0.85, 0.7, 0.6, 0.5, 0.42, 0.35)

t0 = time.perf_counter()
model, tok = load_model()
shapes = model_shapes(model)
L, H, d = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
views = shifted_views(model, position_shifts(2048, 8192))
qq = torch.zeros(L, H, d, d, dtype=torch.float64)
kk = torch.zeros(L, H, d, d, dtype=torch.float64)
ks = torch.zeros(L, H, d, dtype=torch.float64)
count = torch.zeros(L, dtype=torch.float64)


def accumulate(layer, q, k, v, scaling):
    g = q.shape[0] // H
    for qv, kv in views(q, k):
        qs = qv.double().reshape(H, -1, d)
        kd = kv.double()
        qq[layer] += (qs.transpose(1, 2) @ qs) / g
        kk[layer] += kd.transpose(1, 2) @ kd
        ks[layer] += kd.sum(1)
        count[layer] += kd.shape[1]


with capture_attention(model, accumulate):
    for s in default_sequences(tok, 8192, 2048, texts.python_reference().text):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"statistics: {time.perf_counter() - t0:.0f}s", flush=True)


def sym(c):
    return (c + c.transpose(-1, -2)) / 2


def allocate(lam: torch.Tensor, digits: int) -> torch.Tensor:
    """Greedy: each of ``digits`` INT2 digits to the axis whose expected error falls most."""
    n = torch.zeros_like(lam, dtype=torch.long)
    for _ in range(digits):
        cur = lam * torch.tensor(DIGIT_MSE, dtype=lam.dtype)[n.clamp(max=3)]
        nxt = lam * torch.tensor(DIGIT_MSE + (0.0,), dtype=lam.dtype)[(n + 1).clamp(max=4)]
        gain = torch.where(n < 3, cur - nxt, torch.zeros_like(lam))
        n[int(gain.argmax())] += 1
    return n


CQ = sym(qq) / count[:, None, None, None]
MU = ks / count[:, None, None]
CK = sym(kk) / count[:, None, None, None] - MU[..., :, None] * MU[..., None, :]
T, TINV, NDIG, LAM = [], [], [], []
for layer in range(L):
    e, v = torch.linalg.eigh(CQ[layer])
    e = e.clamp_min(1e-4 * e.mean(-1, keepdim=True))
    w = v @ torch.diag_embed(e.sqrt()) @ v.transpose(-1, -2)
    winv = v @ torch.diag_embed(e.rsqrt()) @ v.transpose(-1, -2)
    lam, u = torch.linalg.eigh(sym(w @ CK[layer] @ w))
    lam, u = lam.flip(-1).clamp_min(0), u.flip(-1)
    T.append(w @ u)  # y' = (k - mu) T
    TINV.append(u.transpose(-1, -2) @ winv)
    NDIG.append(torch.stack([allocate(lam[h], d) for h in range(H)]))
    LAM.append(lam)
T, TINV, NDIG, LAM = (torch.stack(x) for x in (T, TINV, NDIG, LAM))
for layer in range(L):
    fr = LAM[layer] / LAM[layer].sum(-1, keepdim=True)
    dropped = (fr * (NDIG[layer] == 0)).sum(-1)
    hist = [[int((NDIG[layer, h] == n).sum()) for n in range(4)] for h in range(H)]
    print(f"layer {layer:2d}: top-8 energy {fr[:, :8].sum(-1).numpy().round(3)}, dropped {dropped.numpy().round(4)}, digits 0/1/2/3 per head {hist}", flush=True)


def digit_quantize(y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Rows ``y: [T, d]`` quantized with ``n[i]`` INT2 digits on axis i, one step per row
    (chosen among STEP_FACTORS of the min-max step by the row's error); dropped axes 0."""
    kept = n > 0
    half = ((4.0 ** n.double()) - 1) / 2
    s0 = (y[:, kept].abs() / half[kept]).amax(-1, keepdim=True).clamp_min(1e-12)
    best, best_err = None, None
    for f in STEP_FACTORS:
        s = s0 * f
        c = torch.round(y / s + half).clamp(torch.zeros_like(half), 2 * half)
        yh = torch.where(kept, s * (c - half), torch.zeros_like(y))
        err = (y - yh).square().sum(-1)
        if best is None:
            best, best_err = yh, err
        else:
            better = err < best_err
            best = torch.where(better[:, None], yh, best)
            best_err = torch.where(better, err, best_err)
    return best


full, nou = RECIPES["full"], RECIPES["no-u"]
BASE = {}
for name, recipe in (("full", full), ("no-u", nou)):
    rots, facts = [], []
    for layer in range(L):
        r = rotation(sym(kk[layer]), recipe)
        rots.append(r.float())
        facts.append(gptq_factor(r.transpose(-1, -2) @ CQ[layer] @ r).float())
    BASE[name] = (torch.stack(rots), torch.stack(facts))

ids = tok(texts.paper().text, return_tensors="pt").input_ids[0]
HELD = [ids[256 : 256 + 4096], ids[256 + 4096 : 256 + 8192]]
err = {}
norm = torch.zeros(L, dtype=torch.float64)


def add(name, layer, value, clip=None):
    e = err.setdefault(name, torch.zeros(L, *(() if clip is None else (len(CLIPS),)), dtype=torch.float64))
    if clip is None:
        e[layer] += value
    else:
        e[layer, clip] += value


def measure(layer, q, k, v, scaling):
    t = k.shape[1]
    positions = torch.linspace(t - 512, t - 1, NQ).round().long()
    window = _window_mask(positions, t, WINDOWS)
    vb = v.to(torch.bfloat16).float()
    kb = k.to(torch.bfloat16).double()
    qp = q[:, positions].double()
    exact = _causal_attention(qp, kb, vb.double(), positions, scaling)
    norm[layer] += float(exact.square().sum())
    for name, (rk, fk) in BASE.items():
        r = rk[layer]
        qs = _rotate(q[:, positions], r)
        kr = _rotate(k, r).to(torch.bfloat16)
        for j, p in enumerate(CLIPS):
            f = QuantFormat(2, "token", 64, None if p == 1.0 else p)
            kq = dequantize(*quantize_gptq(kr, f, fk[layer]), f)
            out = _causal_attention(qs, kr.float(), vb, positions, scaling, kq=kq, window=window)
            add(name, layer, float((out.double() - exact).square().sum()), j)
    mu = MU[layer][:, None, :]
    y = (kb - mu) @ T[layer]  # [H, T, d]
    khat = torch.stack([digit_quantize(y[h], NDIG[layer, h]) for h in range(H)]) @ TINV[layer] + mu
    proj = torch.where(NDIG[layer][:, None, :] > 0, y, 0) @ TINV[layer] + mu
    for wname, kw in (("exact windows", kb), ("projected windows", proj)):
        out = _causal_attention(qp, kw, vb.double(), positions, scaling, kq=khat, window=window)
        add(f"alloc, {wname}", layer, float((out - exact).square().sum()))
    # the windows' own share: only the window keys projected, history exact
    out = _causal_attention(qp, kb, vb.double(), positions, scaling, kq=proj, window=~window)
    add("projection of windows alone", layer, float((out - exact).square().sum()))


with capture_attention(model, measure):
    for s in HELD:
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"held-out: {time.perf_counter() - t0:.0f}s", flush=True)

rows = {}
for name, e in err.items():
    rel = (e / (norm[:, None] if e.dim() == 2 else norm)).sqrt()
    if rel.dim() == 2:
        rel = rel.min(1).values
    rows[name] = rel
rows["select (best of full, no-u per layer)"] = torch.minimum(rows["full"], rows["no-u"])
base = rows["select (best of full, no-u per layer)"]
for name, rel in rows.items():
    print(f"{name:42s} mean {rel.mean():.4f}  ratio to select {(rel / base).mean():.3f}  ({int((rel < base).sum())}/{L} better)")
print("per layer (select, alloc exact, alloc projected):")
for layer in range(L):
    print(layer, f"{base[layer]:.4f} {rows['alloc, exact windows'][layer]:.4f} {rows['alloc, projected windows'][layer]:.4f} {rows['projection of windows alone'][layer]:.4f}")
json.dump({n: r.tolist() for n, r in rows.items()}, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
