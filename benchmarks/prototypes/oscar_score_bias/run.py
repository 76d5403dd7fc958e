# ruff: noqa: E402, E501
"""Do INT2 keys bias the softmax towards the quantized history, and does a score correction fix it?

A quantized key k + e gives the score q.k + q.e. Across the thousands of quantized tokens a
query reads, q.e behaves as zero-mean noise of variance s_i^2, and E[exp(x + n)] = exp(x +
s^2/2) for Gaussian n: the quantized tokens' share of the softmax grows by about exp(s^2/2)
against the exact BF16 sink and recent windows, more so the longer the quantized history. If
the key error of token i is e_i ~ Delta_i * z with Delta_i its stored scale and z of covariance
S (per layer and KV head, fitted on calibration text), then s_i^2 = scaling^2 Delta_i^2 q^T S q,
and subtracting s_i^2 / 2 from the score makes the expected weights unbiased. In a FOSCAR
kernel that is one term per token, -gamma(q) * Delta_i^2, gamma(q) computed once per query.

Offline (EVAL_NOTES 18): calibrate (8,192 tokens of the Python reference), the shipped rotation
(K^TK per KV head) with GPTQ keys under C_Q and also rounding to nearest, INT2 token-wise g 64,
BF16 64/256 windows exact, S fitted on two calibration sequences; on held-out text (2 x 2,048
tokens of the FOSCAR paper, 64 queries in each sequence's second half) per layer: the softmax
mass on quantized keys (exact / quantized / corrected) and the relative error of the attention
output with K alone quantized, best clip of a list per variant.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prototypes/oscar_score_bias/run.py OUT.json
"""

import json
import sys
import time

import torch

torch.set_num_threads(1)
from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.formats import QuantFormat
from foscar.oscar.calibrate import _rotate, _window_mask, calibrate, default_sequences, gptq_factors
from foscar.oscar.capture import capture_attention
from foscar.quantize import dequantize, quantize, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "score_bias.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85, 0.8, 0.75)
WINDOWS = (64, 256)
NQ = 64
LAMBDAS = (0.5, 1.0, 1.5)

t0 = time.perf_counter()
model, tok = load_model()
seqs = default_sequences(tok, 8192, 2048, texts.python_reference().text)
cal = calibrate(model, seqs)
L, d, H = cal.num_layers, cal.head_dim, cal.num_kv_heads
rot = cal.rotations("full", key_target="plain", per_head=True)
GPTQ = gptq_factors(cal, rot)
print(f"calibrated {time.perf_counter() - t0:.0f}s", flush=True)


def quantized_keys(kb, layer, clip, rounding):
    """(dequantized keys [H, T, d], scale [H, T]) of BF16 rotated keys ``kb``."""
    f = QuantFormat(2, "token", 64, None if clip == 1.0 else clip)
    xb = kb.to(torch.bfloat16)
    if rounding == "gptq":
        codes, scale, off = quantize_gptq(xb, f, GPTQ[layer])
    else:
        codes, scale, off = quantize(xb, f)
    return dequantize(codes, scale, off, f, dtype=torch.float32), scale[..., 0]


# ---- S = E[e e^T / Delta^2] per layer, KV head, clip and rounding, on 2 calibration sequences
ROUNDINGS = ("nearest", "gptq")
S = {r: torch.zeros(L, len(CLIPS), H, d, d, dtype=torch.float64) for r in ROUNDINGS}
S_count = torch.zeros(L)


def fit(layer, q, k, v, scaling):
    kb = _rotate(k, rot.key[layer]).to(torch.bfloat16).float()
    for r in ROUNDINGS:
        for j, c in enumerate(CLIPS):
            kq, scale = quantized_keys(kb, layer, c, r)
            z = ((kq - kb) / scale[..., None]).double()
            S[r][layer, j] += torch.einsum("htd,hte->hde", z, z)
    S_count[layer] += k.shape[1]


with capture_attention(model, fit):
    for s in seqs[:2]:
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
for r in ROUNDINGS:
    S[r] /= S_count[:, None, None, None, None].double()
print(f"fitted S {time.perf_counter() - t0:.0f}s", flush=True)

ref = texts.paper()
ids = tok(ref.text, return_tensors="pt").input_ids[0]
held = [ids[256 : 256 + 2048], ids[256 + 2048 : 256 + 4096]]

VARIANTS = ["none"] + [f"S x{lam}" for lam in LAMBDAS] + [f"iso x{lam}" for lam in LAMBDAS]
err = {(r, v): torch.zeros(L, len(CLIPS), dtype=torch.float64) for r in ROUNDINGS for v in VARIANTS}
mass = {(r, v): torch.zeros(L, len(CLIPS), dtype=torch.float64) for r in ROUNDINGS for v in VARIANTS}
mass_exact = torch.zeros(L, dtype=torch.float64)
norm = torch.zeros(L, dtype=torch.float64)
nq_total = torch.zeros(L)


def attend(q, k, kq, v, positions, scaling, window, bias=None):
    """Output [Hq, n, d] and mass on quantized keys [Hq, n]; ``bias: [Hq, n, T]`` added to the
    quantized keys' scores."""
    g = q.shape[0] // k.shape[0]
    rep = lambda x: x.repeat_interleave(g, 0)  # noqa: E731
    s = torch.einsum("hnd,htd->hnt", q, rep(k)) * scaling
    if kq is not None:
        sq = torch.einsum("hnd,htd->hnt", q, rep(kq)) * scaling
        if bias is not None:
            sq = sq + bias
        s = torch.where(window, s, sq)
    visible = torch.arange(k.shape[1]) <= positions[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hnt,htd->hnd", p, rep(v)), (p * ~window).sum(-1)


def measure(layer, q, k, v, scaling):
    t = k.shape[1]
    positions = torch.linspace(t // 2, t - 1, NQ).round().long()
    window = _window_mask(positions, t, WINDOWS)
    rk = rot.key[layer]
    qs = _rotate(q[:, positions], rk).float()
    kb = _rotate(k, rk).to(torch.bfloat16).float()
    vb = v.to(torch.bfloat16).float()
    g = qs.shape[0] // H
    exact, m0 = attend(qs, kb, None, vb, positions, scaling, window)
    # exact mass on the keys that would be quantized
    _, m_exact = attend(qs, kb, kb, vb, positions, scaling, window)
    mass_exact[layer] += float(m_exact.double().sum())
    norm[layer] += float(exact.double().square().sum())
    nq_total[layer] += m_exact.numel()
    qq = (qs * qs).sum(-1)  # [Hq, n]
    for r in ROUNDINGS:
        for j, c in enumerate(CLIPS):
            kq, scale = quantized_keys(kb, layer, c, r)
            Sl = S[r][layer, j].float().repeat_interleave(g, 0)  # [Hq, d, d]
            qSq = torch.einsum("hnd,hde,hne->hn", qs, Sl, qs)
            iso = qq * (Sl.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None])
            d2 = scale.repeat_interleave(g, 0)[:, None, :] ** 2  # [Hq, 1, T]
            for vname in VARIANTS:
                if vname == "none":
                    bias = None
                else:
                    kind, lam = vname.split(" x")
                    quad = qSq if kind == "S" else iso
                    bias = -float(lam) * 0.5 * scaling**2 * quad[..., None] * d2
                out, mq = attend(qs, kb, kq, vb, positions, scaling, window, bias)
                err[(r, vname)][layer, j] += float((out - exact).double().square().sum())
                mass[(r, vname)][layer, j] += float(mq.double().sum())


with capture_attention(model, measure):
    for i, s in enumerate(held):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
        print(f"held-out sequence {i + 1}/{len(held)}, {time.perf_counter() - t0:.0f}s", flush=True)

result = {"clips": CLIPS, "windows": WINDOWS, "rows": {}}
me = mass_exact / nq_total
print(f"mass on quantized keys, exact keys: mean over layers {me.mean():.4f}")
print(f"{'rounding':8s} {'variant':10s} best-clip err  vs none   mass(q)/mass(exact) at that clip")
for (r, vname), e in err.items():
    rel = (e / norm[:, None]).sqrt()
    best, arg = rel.min(1)
    base = (err[(r, "none")] / norm[:, None]).sqrt().min(1).values
    mq = mass[(r, vname)].gather(1, arg[:, None])[:, 0] / nq_total
    result["rows"][f"{r}/{vname}"] = {
        "per_layer_best": best.tolist(),
        "best_clip": [CLIPS[a] for a in arg.tolist()],
        "mean": float(best.mean()),
        "ratio_to_none": float((best / base).mean()),
        "layers_better": int((best < base).sum()),
        "mass_quantized": mq.tolist(),
        "mass_ratio_mean": float((mq / me).mean()),
    }
    print(
        f"{r:8s} {vname:10s} {best.mean():.4f}  {(best / base).mean():.3f} ({int((best < base).sum())}/{L})"
        f"  {(mq / me).mean():.3f}",
        flush=True,
    )
result["mass_exact"] = me.tolist()
json.dump(result, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
