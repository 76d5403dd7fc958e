# ruff: noqa: E402, E501
"""Do INT2 keys need calibration statistics taken at the positions they are served at? (EVAL_NOTES 23)

Section 22 found that the same 8,192 calibration tokens read as one 8,192-token sequence instead
of four of 2,048 take the 8K perplexity gap of INT2 keys from +27% to +9%, but not the 4K gap.
One reading: post-RoPE keys and queries at positions 4-8K sit at other phases of RoPE's slow
channels than at 0-2K, so rotations and GPTQ factors taken at 0-2K describe the wrong vectors.

A RoPE shift tests that reading without longer sequences. Rotating a sequence's post-RoPE q and
k together by RoPE(delta) (as if every token sat delta positions later) leaves every score q.k,
so the attention, unchanged, but moves the vectors the quantizer sees to the phases of
positions t + delta. Statistics over shifted copies of short sequences are statistics at the
shifted positions.

Key statistics (per layer and KV head: C_Q pooled over the group's query heads, K^T K) from:
- "2k": 4 x 2,048 tokens (the default calibration), positions 0-2K;
- "2k+shift4k": the same sequences at shifts 0 and 2,048 (positions 0-4K);
- "2k+shift8k": shifts 0, 2,048, 4,096, 6,144 (positions 0-8K);
- "4k": 2 x 4,096 (the same tokens); "8k": 1 x 8,192 (section 22's calibration).
For each: the rotation (U*H*P_br of K^T K per KV head, the shipped row's choice in 22 of 30
layers, and of C_Q per KV head) and GPTQ factors of C_Q in the rotated basis.

Held out (the FOSCAR paper): 2 sequences of 4,096 and 1 of 8,192 tokens; 64 query positions in
the last 512 of each; K alone INT2 token g64 (GPTQ keys), V exact, BF16 64/256 windows exact;
relative error of the attention output at the per-layer best clip (1.0 ... 0.85), mean over the
30 layers.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prototypes/oscar_rope_positions/run.py OUT.json
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
from foscar.oscar.calibrate import _causal_attention, _rotate, _window_mask, default_sequences
from foscar.oscar.capture import capture_attention, model_shapes
from foscar.oscar.rotation import RECIPES, rotation
from foscar.quantize import dequantize, gptq_factor, quantize_gptq

OUT = sys.argv[1] if len(sys.argv) > 1 else "rope_positions.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85)
WINDOWS = (64, 256)
NQ = 64
VARIANTS = {  # name -> (sequence length, shifts)
    "2k": (2048, (0,)),
    "2k+shift4k": (2048, (0, 2048)),
    "2k+shift8k": (2048, (0, 2048, 4096, 6144)),
    "4k": (4096, (0,)),
    "8k": (8192, (0,)),
}

t0 = time.perf_counter()
model, tok = load_model()
shapes = model_shapes(model)
L, H, d = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
rotary = model.model.rotary_emb


def rope_shift(x: torch.Tensor, delta: int) -> torch.Tensor:
    """Post-RoPE rows ``x: [heads, T, d]`` moved ``delta`` positions later (HF's rotate_half
    convention: channel i pairs with i + d/2)."""
    if delta == 0:
        return x
    pos = torch.tensor([[delta]])
    cos, sin = rotary(x[None].float(), pos)  # [1, 1, d]
    xf = x.float()
    half = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], dim=-1)
    return xf * cos[0] + half * sin[0]


ref = texts.python_reference().text
stats = {n: {"qq": torch.zeros(L, H, d, d, dtype=torch.float64), "kk": torch.zeros(L, H, d, d, dtype=torch.float64)} for n in VARIANTS}


def accumulate(names):
    def add(layer, q, k, v, scaling):
        g = q.shape[0] // H
        for n in names:
            for delta in VARIANTS[n][1]:
                qs = rope_shift(q, delta).double().reshape(H, -1, d)
                ks = rope_shift(k, delta).double()
                stats[n]["qq"][layer] += (qs.transpose(1, 2) @ qs) / g
                stats[n]["kk"][layer] += ks.transpose(1, 2) @ ks

    return add


for seq_len in sorted({v[0] for v in VARIANTS.values()}):
    names = [n for n, v in VARIANTS.items() if v[0] == seq_len]
    seqs = default_sequences(tok, 8192, seq_len, ref)
    with capture_attention(model, accumulate(names)):
        for s in seqs:
            model(input_ids=s[None], use_cache=False, logits_to_keep=1)
    print(f"statistics of {names}: {time.perf_counter() - t0:.0f}s", flush=True)

full = RECIPES["full"]
ROT, FACT = {}, {}
for n, st in stats.items():
    for target in ("kk", "qq"):
        rots, facts = [], []
        for layer in range(L):
            c = st[target][layer]
            c = (c + c.transpose(1, 2)) / 2
            r = rotation(c, full)  # [H, d, d]
            cq = st["qq"][layer]
            rots.append(r.float())
            facts.append(gptq_factor(r.transpose(-1, -2) @ ((cq + cq.transpose(1, 2)) / 2) @ r).float())
        ROT[n, target] = torch.stack(rots)
        FACT[n, target] = torch.stack(facts)

ids = tok(texts.paper().text, return_tensors="pt").input_ids[0]
HELD = {"4k": [ids[256 : 256 + 4096], ids[256 + 4096 : 256 + 8192]], "8k": [ids[256 + 8192 : 256 + 16384]]}
err = {}
norm = {}


def measure(length_name):
    def fn(layer, q, k, v, scaling):
        t = k.shape[1]
        positions = torch.linspace(t - 512, t - 1, NQ).round().long()
        window = _window_mask(positions, t, WINDOWS)
        vb = v.to(torch.bfloat16).float()
        for (n, target), rk in ROT.items():
            r = rk[layer]
            qs = _rotate(q[:, positions], r)
            kb = _rotate(k, r).to(torch.bfloat16).float()
            exact = _causal_attention(qs, kb, vb, positions, scaling)
            nm = norm.setdefault((length_name, n, target), torch.zeros(L, dtype=torch.float64))
            nm[layer] += float(exact.double().square().sum())
            e = err.setdefault((length_name, n, target), torch.zeros(L, len(CLIPS), dtype=torch.float64))
            for j, p in enumerate(CLIPS):
                f = QuantFormat(2, "token", 64, None if p == 1.0 else p)
                kq = dequantize(*quantize_gptq(kb.to(torch.bfloat16), f, FACT[n, target][layer]), f)
                out = _causal_attention(qs, kb, vb, positions, scaling, kq=kq, window=window)
                e[layer, j] += float((out - exact).double().square().sum())

    return fn


for length_name, seqs in HELD.items():
    with capture_attention(model, measure(length_name)):
        for s in seqs:
            model(input_ids=s[None], use_cache=False, logits_to_keep=1)
    print(f"held-out {length_name}: {time.perf_counter() - t0:.0f}s", flush=True)

result = {"clips": CLIPS, "windows": WINDOWS, "variants": {n: list(v[1]) + [v[0]] for n, v in VARIANTS.items()}, "rows": {}}
print(f"{'held':5s} {'calibration':12s} {'rotation':8s} key error (mean over layers)  vs 2k")
for (ln, n, target), e in err.items():
    best = (e / norm[ln, n, target][:, None]).sqrt().min(1).values
    be = err[ln, "2k", target]
    base = (be / norm[ln, "2k", target][:, None]).sqrt().min(1).values
    result["rows"][f"{ln}/{n}/{target}"] = {
        "per_layer": best.tolist(),
        "mean": float(best.mean()),
        "ratio_to_2k": float((best / base).mean()),
        "layers_better": int((best < base).sum()),
    }
    print(f"{ln:5s} {n:12s} {target:8s} {best.mean():.4f}  {(best / base).mean():.3f} ({int((best < base).sum())}/{L} better)", flush=True)
json.dump(result, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
