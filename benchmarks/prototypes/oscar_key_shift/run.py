# ruff: noqa: E402, E501
"""Does subtracting a calibrated mean key before quantizing lower INT2 keys' attention error?

Softmax ignores a shift shared by all keys of a head (q.(k - m) = q.k - q.m, the same for every
key a query reads), so the cache may store k - m for every token (windows too) and decode
attention is unchanged in exact arithmetic; only the quantization sees rows without their
common part. After the rotation the mean key m R is a fixed pattern over the row's channels that
every token's min-max range must cover (SmolLM2's post-RoPE keys have a large, nearly constant
low-frequency channel per head).

Offline (EVAL_NOTES 15): calibrate (8,192 tokens of the Python reference, as `foscar eval
--oscar`), m = mean post-RoPE key per layer and KV head over the calibration tokens, then on
held-out text (2 x 2,048 tokens of the FOSCAR paper) the relative error of the attention output
with K alone quantized (INT2 token-wise g 64, BF16 64/256 windows left exact, 64 queries in each
sequence's second half), per layer best clip of a candidate list (the same oracle for every
variant), for rotations x rounding (nearest, GPTQ) x shift (none, calibration mean, the
held-out sequence's own mean as an upper bound).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prototypes/oscar_key_shift/run.py OUT.json
"""

import json
import sys
import time

import torch

torch.set_num_threads(1)
from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.oscar.calibrate import (
    _causal_attention,
    _fake_quantize,
    _rotate,
    _window_mask,
    calibrate,
    default_sequences,
    gptq_factors,
)
from foscar.oscar.capture import capture_attention
from foscar.oscar.policy import OscarRotations
from foscar.oscar.rotation import RECIPES, rotation
from foscar.formats import QuantFormat

OUT = sys.argv[1] if len(sys.argv) > 1 else "key_shift.json"
CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85, 0.8, 0.75)
WINDOWS = (64, 256)
NQ = 64

t0 = time.perf_counter()
model, tok = load_model()
seqs = default_sequences(tok, 8192, 2048, texts.python_reference().text)
cal = calibrate(model, seqs)
L, d, H = cal.num_layers, cal.head_dim, cal.num_kv_heads

# mean post-RoPE key per layer and KV head over the calibration tokens
ksum = torch.zeros(L, H, d, dtype=torch.float64)
count = [0]


def accumulate(layer, q, k, v, scaling):
    ksum[layer] += k.double().sum(1).cpu()
    if layer == 0:
        count[0] += k.shape[1]


with capture_attention(model, accumulate):
    for s in seqs:
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
mean = ksum / count[0]
print(f"calibrated {time.perf_counter() - t0:.0f}s", flush=True)


def centered_plain(layer):  # K^T K / n - m m^T per head: the keys' covariance
    kk = cal.target(layer, "kk", per_head=True)
    return kk - mean[layer][:, :, None] * mean[layer][:, None, :]


ROTS = {
    "full": cal.rotations("full"),
    "kvh-plain": cal.rotations("full", key_target="plain", per_head=True),
    "kvh-plain-centered": OscarRotations(
        torch.stack([rotation(centered_plain(i), RECIPES["full"]) for i in range(L)]),
        cal.rotations("full", per_head=True).value,
        {},
        {},
    ),
}
GPTQ = {n: gptq_factors(cal, r) for n, r in ROTS.items()}

ref = texts.paper()
ids = tok(ref.text, return_tensors="pt").input_ids[0]
held = [ids[256 : 256 + 2048], ids[256 + 2048 : 256 + 4096]]

SHIFTS = ("none", "calibration", "own")
err = {}  # (rot, rounding, shift) -> [L, clip] squared error
norm = torch.zeros(L, dtype=torch.float64)


def measure(layer, q, k, v, scaling):
    t = k.shape[1]
    positions = torch.linspace(t // 2, t - 1, NQ).round().long()
    window = _window_mask(positions, t, WINDOWS)
    own = k.double().mean(1)  # [H, d]
    for rn, rot in ROTS.items():
        rk = rot.key[layer]
        qs = _rotate(q[:, positions], rk)
        kr = _rotate(k, rk)
        kb = kr.to(torch.bfloat16).float()
        vb = v.to(torch.bfloat16).float()
        exact = _causal_attention(qs, kb, vb, positions, scaling)
        if rn == "full":
            norm[layer] += float(exact.double().square().sum())
        for rounding in ("nearest", "gptq"):
            factor = GPTQ[rn][layer] if rounding == "gptq" else None
            for shift in SHIFTS:
                m = {"none": None, "calibration": mean[layer], "own": own}[shift]
                mr = 0 if m is None else _rotate(m[:, None, :].float(), rk)  # [H, 1, d]
                e = err.setdefault((rn, rounding, shift), torch.zeros(L, len(CLIPS), dtype=torch.float64))
                for j, p in enumerate(CLIPS):
                    f = QuantFormat(2, "token", 64, None if p == 1.0 else p)
                    kq = _fake_quantize(kb - mr, f, factor) + mr
                    out = _causal_attention(qs, kb, vb, positions, scaling, kq=kq, window=window)
                    e[layer, j] += float((out - exact).double().square().sum())


with capture_attention(model, measure):
    for i, s in enumerate(held):
        model(input_ids=s[None], use_cache=False, logits_to_keep=1)
        print(f"held-out sequence {i + 1}/{len(held)}, {time.perf_counter() - t0:.0f}s", flush=True)

# how large the mean is against the keys: |m|^2 / E|k|^2 per layer (mean over heads)
kk = torch.stack([cal.target(i, "kk", per_head=True).diagonal(dim1=-2, dim2=-1).sum(-1) for i in range(L)])
share = (mean.square().sum(-1) / kk).mean(1)
result = {"clips": CLIPS, "windows": WINDOWS, "mean_energy_share": share.tolist(), "rows": {}}
print(f"|m|^2 / E|k|^2 per layer: mean {share.mean():.3f}, range {share.min():.3f}-{share.max():.3f}")
print(f"{'rotation':20s} {'rounding':8s} {'shift':12s} best-clip error (mean over layers)  vs none")
for (rn, rounding, shift), e in err.items():
    rel = (e / norm[:, None]).sqrt()
    best = rel.min(1).values
    base = (err[(rn, rounding, "none")] / norm[:, None]).sqrt().min(1).values
    result["rows"][f"{rn}/{rounding}/{shift}"] = {
        "per_layer_best": best.tolist(),
        "mean": float(best.mean()),
        "ratio_to_no_shift": float((best / base).mean()),
        "layers_better": int((best < base).sum()),
    }
    print(f"{rn:20s} {rounding:8s} {shift:12s} {best.mean():.4f}  {(best / base).mean():.3f} ({int((best < base).sum())}/{L} better)")
json.dump(result, open(OUT, "w"), indent=1)
print(f"done {time.perf_counter() - t0:.0f}s")
