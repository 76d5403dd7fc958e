# ruff: noqa: E402, E501
"""Which metric should GPTQ round INT2 keys under? (EVAL_NOTES 15)

GPTQ keys (EVAL_NOTES 13) minimise e^T C_Q e per token: the score error q . e averaged over
all queries alike. To first order a key's score error d_i moves the output by
p_i (v_i - o) d_i, so what a key's error costs is weighted by the attention it gets, squared:
E |d o|^2 ~ sum_i p_i^2 |v_i - o|^2 (q . e_i)^2 (independent errors). A query whose attention
sits in the BF16 windows, or is spread thin, barely feels the quantized keys. Metrics tried
(one per layer and KV head, from the calibration text, in the keys' stored basis):

- "C_Q": sum_n q_n q_n^T (the cache's metric today);
- "p2": sum_n w_n q_n q_n^T with w_n = sum_{i quantized for n} p_ni^2 (BF16 64/256 windows:
  keys outside both windows of query n);
- "p2v": w_n = sum_{i quantized for n} p_ni^2 |v_i - o_n|^2.

Held-out error as ../oscar_key_rounding/run.py (K alone, INT2 token g64, BF16 64/256 exact,
per-layer best clip), for the rotations "kvh-plain" and "full".

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prototypes/oscar_key_metric/run.py OUT.json
"""

import json
import sys
import time

import torch

torch.set_num_threads(1)
torch.set_grad_enabled(False)
from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.formats import QuantFormat
from foscar.oscar.calibrate import _causal_attention, _rotate, _window_mask, calibrate, default_sequences
from foscar.oscar.capture import capture_attention
from foscar.quantize import dequantize, gptq_factor, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "key_metric.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85, 0.8)
WINDOWS = (64, 256)
NQ = 64

t0 = time.perf_counter()
model, tok = load_model()
seqs = default_sequences(tok, 8192, 2048, texts.python_reference().text)
cal = calibrate(model, seqs)
L, d, H = cal.num_layers, cal.head_dim, cal.num_kv_heads
print(f"calibrated {time.perf_counter() - t0:.0f}s", flush=True)

WEIGHTED = {n: torch.zeros(L, H, d, d, dtype=torch.float64) for n in ("p2", "p2v")}


def accumulate(layer, q, k, v, scaling):
    t = k.shape[1]
    g = q.shape[0] // H
    n = torch.arange(t)
    window = _window_mask(n, t, WINDOWS)  # [t, t]: BF16 for query n
    causal = n[None, :] <= n[:, None]
    quantized = causal & ~window
    qg = q.float().reshape(H, g, t, d)
    for a in range(0, t, 512):
        b = min(t, a + 512)
        s = torch.einsum("hgnd,htd->hgnt", qg[:, :, a:b], k.float()) * scaling
        s = s.masked_fill(~causal[a:b], float("-inf"))
        p = torch.softmax(s, -1)
        o = torch.einsum("hgnt,htd->hgnd", p, v.float())
        p2 = (p.square() * quantized[a:b]).double()
        # |v_i - o_n|^2 = |v_i|^2 - 2 v_i . o_n + |o_n|^2, [H, g, n, t]
        vf = v.float()
        dv = vf.square().sum(-1)[:, None, None, :] - 2 * torch.einsum("hgnd,htd->hgnt", o, vf)
        dv = (dv + o.square().sum(-1)[..., None]).clamp_min(0).double()
        for name, w in (("p2", p2.sum(-1)), ("p2v", (p2 * dv).sum(-1))):
            x = qg[:, :, a:b].double() * w[..., None].sqrt()  # [H, g, n, d]
            x = x.reshape(H, -1, d)
            WEIGHTED[name][layer] += (x.transpose(1, 2) @ x).cpu()


with capture_attention(model, accumulate):
    for i, s in enumerate(seqs):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
        print(f"weighted metrics: sequence {i + 1}/{len(seqs)}, {time.perf_counter() - t0:.0f}s", flush=True)

ROTS = {
    "kvh-plain": cal.rotations("full", key_target="plain", per_head=True).key,
    "full": cal.rotations("full").key,
}
FACTORS = {}  # (rotation, metric) -> [L, H, d, d] float32
for rn, rk in ROTS.items():
    for mn in ("C_Q", "p2", "p2v"):
        f = []
        for layer in range(L):
            c = cal.target(layer, "key", per_head=True) if mn == "C_Q" else WEIGHTED[mn][layer]
            r = rk[layer].to(torch.float64).expand(H, d, d)
            f.append(gptq_factor(r.transpose(-1, -2) @ c @ r))
        FACTORS[rn, mn] = torch.stack(f).float()

ids = tok(texts.paper().text, return_tensors="pt").input_ids[0]
held = [ids[256 : 256 + 2048], ids[256 + 2048 : 256 + 4096]]
err = {}
norm = torch.zeros(L, dtype=torch.float64)


def measure(layer, q, k, v, scaling):
    t = k.shape[1]
    positions = torch.linspace(t // 2, t - 1, NQ).round().long()
    window = _window_mask(positions, t, WINDOWS)
    vb = v.to(torch.bfloat16).float()
    for rn, rot in ROTS.items():
        rk = rot[layer]
        qs = _rotate(q[:, positions], rk)
        kb = _rotate(k, rk).to(torch.bfloat16).float()
        exact = _causal_attention(qs, kb, vb, positions, scaling)
        if rn == "kvh-plain":
            norm[layer] += float(exact.double().square().sum())
        for mn in ("C_Q", "p2", "p2v"):
            e = err.setdefault((rn, mn), torch.zeros(L, len(CLIPS), dtype=torch.float64))
            for j, p in enumerate(CLIPS):
                f = QuantFormat(2, "token", 64, None if p == 1.0 else p)
                kq = dequantize(*quantize_gptq(kb.to(torch.bfloat16), f, FACTORS[rn, mn][layer]), f)
                out = _causal_attention(qs, kb, vb, positions, scaling, kq=kq, window=window)
                e[layer, j] += float((out - exact).double().square().sum())


with capture_attention(model, measure):
    for i, s in enumerate(held):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
        print(f"held-out sequence {i + 1}/{len(held)}, {time.perf_counter() - t0:.0f}s", flush=True)

result = {"clips": CLIPS, "windows": WINDOWS, "rows": {}}
print(f"{'rotation':10s} {'metric':6s} error (mean over layers; per-layer best clip)  vs C_Q")
for (rn, mn), e in err.items():
    best = (e / norm[:, None]).sqrt().min(1).values
    base = (err[rn, "C_Q"] / norm[:, None]).sqrt().min(1).values
    result["rows"][f"{rn}/{mn}"] = {
        "per_layer": best.tolist(),
        "mean": float(best.mean()),
        "ratio_to_C_Q": float((best / base).mean()),
        "layers_better": int((best < base).sum()),
    }
    print(f"{rn:10s} {mn:6s} {best.mean():.4f}  {(best / base).mean():.3f} ({int((best < base).sum())}/{L} better)")
json.dump(result, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
