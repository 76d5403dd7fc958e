# ruff: noqa: E402, E501
"""Which layers' INT2 keys cost the model most: the logits' KL, against the fitted-error ranking.

Section 17 of EVAL_NOTES gives INT4 keys to the layers whose fitted attention-output error
falls most from INT2 to INT4 (`e2^2 - e4^2`, `foscar.oscar.layers_by_key_gain`), and section 15
found that this error does not predict perplexity well. Here each layer in turn gets INT2 keys
(the others exact, values exact) and the cost is measured where the model pays it: the KL of
the next-token distribution from the exact model's, on calibration text.

Offline (EVAL_NOTES 19): calibrate (8,192 tokens of the Python reference), rotation K^TK per
KV head with GPTQ keys under C_Q (the shipped row's most chosen candidate), INT2 token-wise g 64
and BF16 64/256 windows (each query reads its own 64 sink and 256 recent keys exact, as the
cache's decode does), per-layer clips fitted as `foscar eval --oscar` fits them (one
calibration sequence); then per layer the mean KL over positions 512..2047 of two calibration
sequences, and the fitted `e2^2 - e4^2`.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/prototypes/oscar_layer_sensitivity/run.py OUT.json

With ``screen`` after OUT.json: the four layers of largest KL only, each with other key
formats (INT2 g 32 and g 16 with GPTQ, INT4 g 64), their clips fitted the same way, to see
whether any INT2 format closes most of INT4's gain there (EVAL_NOTES 19).
"""

import json
import sys
import time
from contextlib import contextmanager

import torch

torch.set_num_threads(1)
from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.formats import QuantFormat
from foscar.oscar.calibrate import (
    _fake_quantize,
    _rotate,
    _window_mask,
    calibrate,
    default_sequences,
    fit_clips,
    gptq_factors,
)
from foscar.oscar.capture import attention_implementation

OUT = sys.argv[1] if len(sys.argv) > 1 else "layer_sensitivity.json"
SCREEN = len(sys.argv) > 2 and sys.argv[2] == "screen"
SCREEN_LAYERS = (18, 20, 7, 23)  # the largest KL of the full run, largest first
WINDOWS = (64, 256)
FIRST = 512  # positions scored: FIRST .. T-1

t0 = time.perf_counter()
model, tok = load_model()
seqs = default_sequences(tok, 8192, 2048, texts.python_reference().text)
cal = calibrate(model, seqs)
L = cal.num_layers
rot = cal.rotations("full", key_target="plain", per_head=True)
rot.key_gptq = gptq_factors(cal, rot)
fit_clips(model, seqs[:1], rot, bits=(2, 4), windows=WINDOWS)
fit = rot.header["clip_fit"]
e2 = torch.tensor(fit["int2.key"]["fitted_relative_error"])
e4 = torch.tensor(fit["int4.key"]["fitted_relative_error"])
gain = e2.square() - e4.square()
clips2 = rot.clips[(2, "key")]
# key formats: (bits, group) -> per-layer clips
CLIPS = {(2, 64): rot.clips[(2, "key")].clone(), (4, 64): rot.clips[(4, "key")].clone()}
if SCREEN:
    for g in (32, 16):
        fit_clips(model, seqs[:1], rot, bits=(2,), group_size=g, windows=WINDOWS)
        CLIPS[(2, g)] = rot.clips[(2, "key")].clone()
print(f"calibrated and fitted {time.perf_counter() - t0:.0f}s", flush=True)

NAME = "foscar_layer_sensitivity"
state = {"layer": None, "bits": 2, "group": 64}


@contextmanager
def quantized_keys_in(model):
    """Within the block, layer ``state['layer']``'s keys outside each query's BF16 windows are
    read INT``state['bits']`` (rotated, GPTQ-rounded, the fitted clip)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        scaling = module.scaling if scaling is None else scaling
        layer = module.layer_idx
        if layer != state["layer"]:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
            )
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        hq, t, d = q.shape
        g = hq // k.shape[0]
        rk = rot.key[layer]
        kr = _rotate(k, rk)
        clip = float(CLIPS[(state["bits"], state["group"])][layer])
        f = QuantFormat(state["bits"], "token", state["group"], None if clip == 1.0 else clip)
        kq = _fake_quantize(kr, f, rot.key_gptq[layer])
        kb = kr.to(torch.bfloat16).float()
        qr = _rotate(q, rk)
        s = torch.einsum("hnd,htd->hnt", qr, kb.repeat_interleave(g, 0))
        sq = torch.einsum("hnd,htd->hnt", qr, kq.repeat_interleave(g, 0))
        i = torch.arange(t)
        s = torch.where(_window_mask(i, t, WINDOWS), s, sq) * scaling
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
        p = torch.softmax(s, -1)
        o = torch.einsum("hnt,htd->hnd", p, v.to(torch.bfloat16).float().repeat_interleave(g, 0))
        return o.transpose(0, 1)[None].to(query.dtype), None

    with attention_implementation(model, NAME, attention):
        yield


scored = seqs[:2]


def sensitivity(layer):
    """(KL, NLL increase) with ``layer``'s keys in ``state``'s format, the rest exact."""
    state["layer"] = layer
    kl = dnll = 0.0
    with quantized_keys_in(model):
        for s, ex, tg in zip(scored, exact, targets):
            lq = torch.log_softmax(model(input_ids=s[None]).logits[0, FIRST:].float(), -1)
            kl += float((ex.exp() * (ex - lq)).sum(-1).mean()) / len(scored)
            n = len(tg)
            dnll += float(
                (lq[:n].gather(1, tg[:, None]) - ex[:n].gather(1, tg[:, None])).neg().mean()
            ) / len(scored)
    return kl, dnll


with torch.no_grad():
    exact = [
        torch.log_softmax(model(input_ids=s[None]).logits[0, FIRST:].float(), -1) for s in scored
    ]
    targets = [s[FIRST + 1 :] for s in scored]
    if SCREEN:
        rows = {}
        for layer in SCREEN_LAYERS:
            for bits, g in CLIPS:
                state.update(bits=bits, group=g)
                k, n = sensitivity(layer)
                rows[f"{layer}/int{bits}/g{g}"] = {
                    "kl": k,
                    "dnll": n,
                    "clip": float(CLIPS[(bits, g)][layer]),
                }
                print(
                    f"layer {layer} INT{bits} g{g}: KL {k:.5f}, NLL +{n:.5f}  {time.perf_counter() - t0:.0f}s",
                    flush=True,
                )
        json.dump(
            {"windows": WINDOWS, "first_scored": FIRST, "rows": rows}, open(OUT, "w"), indent=1
        )
        print(f"done {time.perf_counter() - t0:.0f}s")
        sys.exit(0)
    kl = torch.zeros(L, dtype=torch.float64)
    dnll = torch.zeros(L, dtype=torch.float64)
    for layer in range(L):
        kl[layer], dnll[layer] = sensitivity(layer)
        print(
            f"layer {layer}: KL {kl[layer]:.5f}, NLL +{dnll[layer]:.5f}, e2^2-e4^2 {gain[layer]:.5f}  {time.perf_counter() - t0:.0f}s",
            flush=True,
        )

by_kl = torch.argsort(kl, descending=True).tolist()
by_gain = torch.argsort(gain, descending=True).tolist()
rank = lambda x: torch.argsort(torch.argsort(x)).double()  # noqa: E731
rho = float(torch.corrcoef(torch.stack([rank(kl), rank(gain)]))[0, 1])
print(f"by KL:   {by_kl[:10]}")
print(f"by gain: {by_gain[:10]}")
print(
    f"Spearman rho {rho:.3f}; top-6 overlap {len(set(by_kl[:6]) & set(by_gain[:6]))}, top-10 {len(set(by_kl[:10]) & set(by_gain[:10]))}"
)
print(
    f"KL share of the top 6 by KL {kl[by_kl[:6]].sum() / kl.sum():.3f}, of the top 6 by gain {kl[by_gain[:6]].sum() / kl.sum():.3f}"
)
json.dump(
    {
        "windows": WINDOWS,
        "first_scored": FIRST,
        "kl": kl.tolist(),
        "dnll": dnll.tolist(),
        "gain_e2sq_minus_e4sq": gain.tolist(),
        "int2_key_clips": clips2.tolist(),
        "by_kl": by_kl,
        "by_gain": by_gain,
        "spearman": rho,
    },
    open(OUT, "w"),
    indent=1,
)
print(f"done {time.perf_counter() - t0:.0f}s")
