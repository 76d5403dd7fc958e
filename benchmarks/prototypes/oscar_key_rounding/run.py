# ruff: noqa: E402, E501
"""Which way of storing INT2 keys lowers their attention error most? (EVAL_NOTES 15)

The same offline measurement as ../oscar_key_shift/run.py (calibration on 8,192 tokens of the
Python reference; held-out 2 x 2,048 tokens of the FOSCAR paper; K alone quantized, INT2, BF16
64/256 windows exact, 64 queries per sequence's second half; relative error of the attention
output, mean over layers), for rotations x ways of storing the keys:

- token g64, to nearest / GPTQ, one clip ratio per layer (the best of CLIPS on the held-out
  text: an oracle, as for every variant here);
- token g64 GPTQ with the clip ratio chosen per token: the candidate whose GPTQ-rounded row
  has the smallest metric error e^T H e (H = R^T C_Q R, the keys' metric; the cache could do
  this at the write, the format is unchanged);
- channel g64 (KIVI's axis: one scale and offset per channel and 64 tokens), to nearest and by
  GPTQ (channel by channel, each column's min-max scale taken from the column as updated by
  the previous channels' error feedback).

Rotations: none; "full" (U H P_br of C_Q per layer, the paper's); "kvh-plain" (U H P_br of
K^T K per KV head, what OSCAR-select per-KV-head takes for most layers); "kvh-u" (U of K^T K
per KV head alone: decorrelated channels of decreasing variance, transform coding's basis for
channel-wise scales).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prototypes/oscar_key_rounding/run.py OUT.json
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
from foscar.oscar.calibrate import (
    _causal_attention,
    _fake_quantize,
    _rotate,
    _window_mask,
    calibrate,
    default_sequences,
)
from foscar.oscar.capture import capture_attention
from foscar.oscar.rotation import RotationRecipe
from foscar.quantize import dequantize, gptq_factor, quantize, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "key_rounding.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85, 0.8, 0.75)
WINDOWS = (64, 256)
NQ = 64
G = 64

t0 = time.perf_counter()
model, tok = load_model()
seqs = default_sequences(tok, 8192, 2048, texts.python_reference().text)
cal = calibrate(model, seqs)
L, d, H = cal.num_layers, cal.head_dim, cal.num_kv_heads
print(f"calibrated {time.perf_counter() - t0:.0f}s", flush=True)

ROTS = {
    "none": cal.rotations("none", per_head=True).key,
    "full": cal.rotations("full").key,
    "kvh-plain": cal.rotations("full", key_target="plain", per_head=True).key,
    "kvh-u": cal.rotations(RotationRecipe(True, False, False), key_target="plain", per_head=True).key,
}
METRIC = {}  # rotation -> [L, H, d, d] float64: R^T C_Q R
for rn, rk in ROTS.items():
    m = []
    for layer in range(L):
        c = cal.target(layer, "key", per_head=True)
        r = rk[layer].to(torch.float64).expand(H, d, d)
        m.append(r.transpose(-1, -2) @ c @ r)
    METRIC[rn] = torch.stack(m)


def channel_gptq(x, factor):
    """Channel-wise g64 INT2 of ``x: [H, T, d]`` (T % 64 == 0) by GPTQ across channels."""
    w = x.float().clone()
    u = factor.float()
    out = torch.empty_like(w)
    hh, t, _ = w.shape
    for j in range(d):
        col = w[..., j].reshape(hh, t // G, G)
        lo = col.amin(-1, keepdim=True)
        s = (col.amax(-1, keepdim=True) - lo).clamp_min(1e-8) / 3
        q = (torch.floor((col - lo) / s + 0.5).clamp(0, 3) * s + lo).reshape(hh, t)
        out[..., j] = q
        err = (w[..., j] - q) / u[:, j, j][:, None]
        w[..., j + 1 :] -= err[..., None] * u[:, None, j, j + 1 :]
    return out


ref = texts.paper()
ids = tok(ref.text, return_tensors="pt").input_ids[0]
held = [ids[256 : 256 + 2048], ids[256 + 2048 : 256 + 4096]]
err = {}  # (rotation, variant) -> [L, clips or 1] squared error
norm = torch.zeros(L, dtype=torch.float64)


def add(key, layer, j, value, width):
    e = err.setdefault(key, torch.zeros(L, width, dtype=torch.float64))
    e[layer, j] += value


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
        if rn == "none":
            norm[layer] += float(exact.double().square().sum())
        metric = METRIC[rn][layer]  # [H, d, d]
        factor = gptq_factor(metric).float()

        def error(kq):
            out = _causal_attention(qs, kb, vb, positions, scaling, kq=kq, window=window)
            return float((out - exact).double().square().sum())

        best_err, best_kq = None, None
        for j, p in enumerate(CLIPS):
            f = QuantFormat(2, "token", G, None if p == 1.0 else p)
            add((rn, "token nearest"), layer, j, error(_fake_quantize(kb, f)), len(CLIPS))
            c, s, z = quantize_gptq(kb.to(torch.bfloat16), f, factor)
            kq = dequantize(c, s, z, f)
            add((rn, "token GPTQ"), layer, j, error(kq), len(CLIPS))
            e = (kq - kb).double()
            me = torch.einsum("htd,hde,hte->ht", e, metric, e)  # [H, T]
            if best_err is None:
                best_err, best_kq = me, kq
            else:
                better = me < best_err
                best_err = torch.where(better, me, best_err)
                best_kq = torch.where(better[..., None], kq, best_kq)
        add((rn, "token GPTQ, clip per token"), layer, 0, error(best_kq), 1)
        fc = QuantFormat(2, "channel", G)
        add((rn, "channel nearest"), layer, 0, error(_fake_quantize(kb, fc)), 1)
        add((rn, "channel GPTQ"), layer, 0, error(channel_gptq(kb, factor)), 1)


with capture_attention(model, measure):
    for i, s in enumerate(held):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
        print(f"held-out sequence {i + 1}/{len(held)}, {time.perf_counter() - t0:.0f}s", flush=True)

result = {"clips": CLIPS, "windows": WINDOWS, "group_size": G, "rows": {}}
print(f"{'rotation':10s} {'variant':28s} error (mean over layers; per-layer best clip)")
for (rn, var), e in err.items():
    best = (e / norm[:, None]).sqrt().min(1).values
    result["rows"][f"{rn}/{var}"] = {"per_layer": best.tolist(), "mean": float(best.mean())}
    print(f"{rn:10s} {var:28s} {best.mean():.4f}")
json.dump(result, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
