# ruff: noqa: E402, E501
"""Would GPTQ-rounded INT2 values help, under the output projection's metric? (EVAL_NOTES 16)

Keys' errors reach the output through the scores; values' errors reach the model through
``o_proj``: an error ``e`` of a stored value row (the rotated basis, ``v R``) moves the layer's
output by ``sum_j p_j e R^T W_o,j^T`` (``W_o,j`` the columns of ``o_proj`` that query head ``j``
writes, ``p_j`` its attention on the token). With independent per-token errors what a value
row's error costs is ``e M e^T`` with ``M = sum_{j,j'} c_jj' R^T W_o,j^T W_o,j' R`` over the
query heads of its KV head, ``c_jj'`` how much heads ``j`` and ``j'`` attend to the same
quantized tokens. Rounding to nearest minimises ``|e|^2`` per channel instead. Metrics tried:

- "nearest": rounding to nearest (the cache today);
- "wo": GPTQ under ``sum_j R^T W_o,j^T W_o,j R`` (heads' attention unrelated);
- "wo-c": GPTQ under ``M`` with ``c_jj' = sum_n sum_{i quantized} p_jni p_j'ni`` from the
  calibration text (BF16 64/256 windows exact).

Held-out (the FOSCAR paper, 2 x 2,048 tokens, 64 query positions in each second half): V alone
INT2 token g64 with the BF16 64/256 windows exact, K exact, per-layer best clip; the error of
``o_proj``'s input from attention (``|d y| / |y|``, the measure that matters) and of the
attention output itself (``|d o| / |o|``). Rotation: U*H*P_br per KV head (the value rotation
OSCAR-select per-KV-head keeps in 18 of 30 layers).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prototypes/oscar_value_gptq/run.py OUT.json
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
    _rotate,
    _window_mask,
    calibrate,
    default_sequences,
)
from foscar.oscar.capture import capture_attention
from foscar.quantize import dequantize, gptq_factor, quantize, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "value_gptq.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85)
WINDOWS = (64, 256)
NQ = 64

t0 = time.perf_counter()
model, tok = load_model()
seqs = default_sequences(tok, 8192, 2048, texts.python_reference().text)
cal = calibrate(model, seqs)
L, d, H = cal.num_layers, cal.head_dim, cal.num_kv_heads
HQ = model.config.num_attention_heads
G = HQ // H
print(f"calibrated {time.perf_counter() - t0:.0f}s", flush=True)
ROT = cal.rotations("full", per_head=True).value  # [L, H, d, d] float64
WO = [model.model.layers[i].self_attn.o_proj.weight.detach().double() for i in range(L)]

CO = torch.zeros(L, H, G, G, dtype=torch.float64)  # c_jj' per KV head


def co_attention(layer, q, k, v, scaling):
    t = k.shape[1]
    n = torch.arange(t)
    quantized = (n[None, :] <= n[:, None]) & ~_window_mask(n, t, WINDOWS)
    qg = q.float().reshape(H, G, t, d)
    for a in range(0, t, 512):
        b = min(t, a + 512)
        s = torch.einsum("hgnd,htd->hgnt", qg[:, :, a:b], k.float()) * scaling
        s = s.masked_fill(n[None, :] > n[a:b, None], float("-inf"))
        p = (torch.softmax(s, -1) * quantized[a:b]).double()  # [H, G, n, t]
        CO[layer] += torch.einsum("hjnt,hknt->hjk", p, p)


with capture_attention(model, co_attention):
    for i, s in enumerate(seqs):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
        print(
            f"co-attention: sequence {i + 1}/{len(seqs)}, {time.perf_counter() - t0:.0f}s",
            flush=True,
        )


def metric(layer, cross: bool) -> torch.Tensor:
    """[H, d, d]: the value rows' metric in the stored basis."""
    out = []
    for h in range(H):
        r = ROT[layer, h]
        a = [WO[layer][:, (h * G + j) * d : (h * G + j + 1) * d] @ r for j in range(G)]  # W_o,j R
        c = (
            CO[layer, h] / CO[layer, h].diagonal().mean()
            if cross
            else torch.eye(G, dtype=torch.float64)
        )
        out.append(sum(c[j, k] * a[j].T @ a[k] for j in range(G) for k in range(G)))
    return torch.stack(out)


FACTORS = {
    name: torch.stack([gptq_factor(metric(layer, name == "wo-c")) for layer in range(L)]).float()
    for name in ("wo", "wo-c")
}
METHODS = ("nearest", "wo", "wo-c")

ids = tok(texts.paper().text, return_tensors="pt").input_ids[0]
held = [ids[256 : 256 + 2048], ids[256 + 2048 : 256 + 4096]]
err_y = {m: torch.zeros(L, len(CLIPS), dtype=torch.float64) for m in METHODS}
err_o = {m: torch.zeros(L, len(CLIPS), dtype=torch.float64) for m in METHODS}
norm_y = torch.zeros(L, dtype=torch.float64)
norm_o = torch.zeros(L, dtype=torch.float64)


def measure(layer, q, k, v, scaling):
    t = k.shape[1]
    positions = torch.linspace(t // 2, t - 1, NQ).round().long()
    window = _window_mask(positions, t, WINDOWS)
    r = ROT[layer]
    kb = k.to(torch.bfloat16).float()
    vb = _rotate(v, r).to(torch.bfloat16).float()  # stored rows, [H, T, d]
    qs = q[:, positions].float()
    back = torch.stack(
        [(WO[layer][:, j * d : (j + 1) * d] @ r[j // G]).float() for j in range(HQ)]
    )  # W_o,j R

    def y_of(o):  # [HQ, n, d] in the stored basis -> o_proj's input contribution [n, hidden]
        return torch.einsum("jnd,jhd->nh", o, back)

    exact = _causal_attention(qs, kb, vb, positions, scaling)
    y = y_of(exact)
    norm_y[layer] += float(y.double().square().sum())
    norm_o[layer] += float(exact.double().square().sum())
    for m in METHODS:
        for j, p in enumerate(CLIPS):
            f = QuantFormat(2, "token", 64, None if p == 1.0 else p)
            x = vb.to(torch.bfloat16)
            codes = quantize(x, f) if m == "nearest" else quantize_gptq(x, f, FACTORS[m][layer])
            vq = dequantize(*codes, f)
            out = _causal_attention(qs, kb, vb, positions, scaling, vq=vq, window=window)
            err_o[m][layer, j] += float((out - exact).double().square().sum())
            err_y[m][layer, j] += float((y_of(out) - y).double().square().sum())


with capture_attention(model, measure):
    for i, s in enumerate(held):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
        print(f"held-out sequence {i + 1}/{len(held)}, {time.perf_counter() - t0:.0f}s", flush=True)

result = {"clips": CLIPS, "windows": WINDOWS, "rows": {}}
print(
    f"{'method':8s} |dy|/|y| (per-layer best clip, mean over layers)  vs nearest  |do|/|o| (at that clip)"
)
base = (err_y["nearest"] / norm_y[:, None]).sqrt().min(1).values
for m in METHODS:
    ey = (err_y[m] / norm_y[:, None]).sqrt()
    best, at = ey.min(1)
    eo = (err_o[m] / norm_o[:, None]).sqrt().gather(1, at[:, None])[:, 0]
    result["rows"][m] = {
        "y_per_layer": best.tolist(),
        "y_mean": float(best.mean()),
        "o_mean_at_best_clip": float(eo.mean()),
        "ratio_to_nearest": float((best / base).mean()),
        "layers_better": int((best < base).sum()),
        "clips": [CLIPS[int(i)] for i in at],
    }
    print(
        f"{m:8s} {best.mean():.4f}  {(best / base).mean():.3f} ({int((best < base).sum())}/{L} better)  {eo.mean():.4f}"
    )
json.dump(result, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
