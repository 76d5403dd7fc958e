# ruff: noqa: E402, E501
"""GPTQ keys refined (prototype): how far from the best INT2 codes under the metric is GPTQ?

GPTQ rounds each token's rotated key channel by channel, feeding each error forward under the
metric H = R^T C_Q R (Babai's nearest plane); clamping to INT2's four levels cuts the feedback.
Two refinements, each keeping the stored format (so the kernels are unchanged):
- "cd": coordinate descent after GPTQ: passes over the channels, each code moved by +-1 where
  that lowers e^T H e (e the row's error);
- "cd+ls": the same, alternating with a least-squares refit of the row's scale and offset under
  H (codes fixed).
Held out as in oscar_rope_positions (the FOSCAR paper, 2 x 4,096 tokens, 64 queries in the last
512 positions, BF16 64/256 windows exact, V exact), calibration 4 x 2,048 at RoPE shifts 0-8K,
rotation U*H*P_br of K^T K per KV head and H*P_br; best clip per layer.

    OMP_NUM_THREADS=2 python benchmarks/prototypes/oscar_gptq_refine/run.py OUT.json
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
from foscar.quantize import gptq_factor, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "gptq_refine.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85)
WINDOWS = (64, 256)
NQ = 64
PASSES = 4

t0 = time.perf_counter()
model, tok = load_model()
shapes = model_shapes(model)
L, H, d = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
views = shifted_views(model, position_shifts(2048, 8192))
qq = torch.zeros(L, H, d, d, dtype=torch.float64)
kk = torch.zeros(L, H, d, d, dtype=torch.float64)


def accumulate(layer, q, k, v, scaling):
    g = q.shape[0] // H
    for qv, kv in views(q, k):
        qs = qv.double().reshape(H, -1, d)
        qq[layer] += (qs.transpose(1, 2) @ qs) / g
        kk[layer] += kv.double().transpose(1, 2) @ kv.double()


with capture_attention(model, accumulate):
    for s in default_sequences(tok, 8192, 2048, texts.python_reference().text):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"statistics: {time.perf_counter() - t0:.0f}s", flush=True)


def sym(c):
    return (c + c.transpose(-1, -2)) / 2


def refine(x, codes, scale, lo, hmat, refit: bool):
    """Coordinate descent on the codes (and optionally LS refits of scale, offset) under hmat.

    x: [H, T, d] fp32 rows (unclipped); codes [H, T, d]; scale, lo [H, T, 1]; hmat [H, d, d]."""
    c = codes.float()
    s, z = scale.clone(), lo.clone()
    hm = hmat.float()
    diag = torch.diagonal(hm, dim1=-2, dim2=-1)[:, None, :]  # [H, 1, d]
    for _ in range(PASSES):
        if refit:
            # minimise (x - s c - z)^T H (x - s c - z) over (s, z): a 2x2 system per row
            hc = c @ hm
            h1 = hm.sum(-1)[:, None, :]  # H 1
            a11 = (hc * c).sum(-1, keepdim=True)
            a12 = (hc).sum(-1, keepdim=True)
            a22 = h1.sum(-1, keepdim=True).expand_as(a11)
            hx = x @ hm
            b1 = (hx * c).sum(-1, keepdim=True)
            b2 = hx.sum(-1, keepdim=True)
            det = a11 * a22 - a12 * a12
            ok = det.abs() > 1e-12 * (a11 * a22).abs().clamp_min(1e-30)
            s_new = (b1 * a22 - a12 * b2) / det
            z_new = (a11 * b2 - a12 * b1) / det
            ok = ok & (s_new > 0)
            s = torch.where(ok, s_new, s)
            z = torch.where(ok, z_new, z)
        for j in range(x.shape[-1]):
            e = x - (c * s + z)
            he = (e @ hm)[..., j]  # (H e)_j
            best_gain = torch.zeros_like(he)
            best_delta = torch.zeros_like(he)
            for delta in (-1.0, 1.0):
                newc = c[..., j] + delta
                valid = (newc >= 0) & (newc <= 3)
                step = delta * s[..., 0]
                gain = 2 * step * he - step * step * diag[..., j]  # decrease of e^T H e
                take = valid & (gain > best_gain)
                best_gain = torch.where(take, gain, best_gain)
                best_delta = torch.where(take, torch.full_like(he, delta), best_delta)
            c[..., j] += best_delta
    return c * s + z


rot = {}
for name in ("full", "no-u"):
    rs, fs, hs = [], [], []
    for layer in range(L):
        r = rotation(sym(kk[layer]), RECIPES[name])
        hmat = r.transpose(-1, -2) @ sym(qq[layer]) @ r
        rs.append(r.float())
        fs.append(gptq_factor(hmat).float())
        hs.append(hmat / torch.diagonal(hmat, dim1=-2, dim2=-1).mean(-1)[:, None, None])
    rot[name] = (rs, fs, hs)

ids = tok(texts.paper().text, return_tensors="pt").input_ids[0]
HELD = [ids[256 : 256 + 4096], ids[256 + 4096 : 256 + 8192]]
VARIANTS = ("gptq", "gptq+cd", "gptq+cd+ls")
err = {(n, v): torch.zeros(L, len(CLIPS), dtype=torch.float64) for n in rot for v in VARIANTS}
metric = {(n, v): torch.zeros(L, len(CLIPS), dtype=torch.float64) for n in rot for v in VARIANTS}
norm = {n: torch.zeros(L, dtype=torch.float64) for n in rot}


def measure(layer, q, k, v, scaling):
    t = k.shape[1]
    positions = torch.linspace(t - 512, t - 1, NQ).round().long()
    window = _window_mask(positions, t, WINDOWS)
    vb = v.to(torch.bfloat16).float()
    for name, (rs, fs, hs) in rot.items():
        r = rs[layer]
        qs = _rotate(q[:, positions], r)
        kr = _rotate(k, r).to(torch.bfloat16)
        exact = _causal_attention(qs, kr.float(), vb, positions, scaling)
        norm[name][layer] += float(exact.double().square().sum())
        for j, p in enumerate(CLIPS):
            f = QuantFormat(2, "token", 64, None if p == 1.0 else p)
            codes, scale, lo = quantize_gptq(kr, f, fs[layer])
            x = kr.float()
            for var in VARIANTS:
                if var == "gptq":
                    kq = codes.float() * scale + lo
                else:
                    kq = refine(x, codes, scale, lo, hs[layer], var.endswith("ls"))
                out = _causal_attention(qs, x, vb, positions, scaling, kq=kq, window=window)
                err[name, var][layer, j] += float((out - exact).double().square().sum())
                e = (x - kq)[:, t // 2 :]
                metric[name, var][layer, j] += float(((e @ hs[layer].float()) * e).sum())


with capture_attention(model, measure):
    for s in HELD:
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
print(f"held-out: {time.perf_counter() - t0:.0f}s", flush=True)

rows = {}
for (name, var), e in err.items():
    rel = (e / norm[name][:, None]).sqrt()
    best = rel.min(1)
    rows[f"{name}/{var}"] = {
        "per_layer": best.values.tolist(),
        "mean": float(best.values.mean()),
        "metric_ratio_to_gptq": float((metric[name, var] / metric[name, "gptq"]).mean()),
    }
for name in rot:
    base = torch.tensor(rows[f"{name}/gptq"]["per_layer"])
    for var in VARIANTS:
        rel = torch.tensor(rows[f"{name}/{var}"]["per_layer"])
        rows[f"{name}/{var}"]["ratio_to_gptq"] = float((rel / base).mean())
        print(f"{name:5s} {var:11s} mean {rel.mean():.4f}  ratio {(rel / base).mean():.3f}  e^T H e ratio {rows[f'{name}/{var}']['metric_ratio_to_gptq']:.3f}  ({int((rel < base).sum())}/{L} better)")
sel = {var: torch.minimum(torch.tensor(rows[f"full/{var}"]["per_layer"]), torch.tensor(rows[f"no-u/{var}"]["per_layer"])) for var in VARIANTS}
for var, v in sel.items():
    print(f"select {var:11s} mean {v.mean():.4f}  ratio {(v / sel['gptq']).mean():.3f}")
json.dump(rows, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
