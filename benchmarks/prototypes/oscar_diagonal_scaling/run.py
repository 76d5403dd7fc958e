# ruff: noqa: E402, E501, E741
"""Non-orthogonal OSCAR (EVAL_NOTES 12): A = U D H P_br with a diagonal D in the U basis (keys
k A, queries q A^-T; values v A, output o A^-1), predicted against measured attention-output
error at INT2, one 64-channel token-wise group per row, SmolLM2-135M, on CPU (~5 min, 1 thread):

    OMP_NUM_THREADS=1 python run.py 8192 2 2048 diag_scaling.pt full   # slots D^0, D^0.5, D^1
    OMP_NUM_THREADS=1 python run.py 8192 2 2048 diag_noU.pt no-u       # slots H P_br, D^0, D^1
    python analyze.py diag_scaling.pt; python analyze_noU.py diag_noU.pt

Arguments: calibration tokens, calibration sequences the clips are fitted on, held-out sequence
length, output file, variant. Written by a helper in session 11 (outside the package on
purpose: a measured negative result, not a feature).
"""

import json
import sys
import time

import torch

torch.set_num_threads(1)
from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.formats import QuantFormat
from foscar.oscar.calibrate import CLIP_CANDIDATES, _fake_quantize, calibrate, default_sequences
from foscar.oscar.capture import capture_attention
from foscar.oscar.rotation import bit_reversal, eigenbasis, hadamard

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
FIT_SEQS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
HELD = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
OUTP = sys.argv[4] if len(sys.argv) > 4 else "diag_scaling.pt"
VARIANT = sys.argv[5] if len(sys.argv) > 5 else "full"
NQ = 64
WINDOWS = {"nowin": (0, 0), "win64_256": (64, 256)}
ALPHAS = (0.0, 0.5, 1.0)  # strength of D: d_i ** alpha (0 = current OSCAR)
CANDS = [float(p) for p in CLIP_CANDIDATES]

t0 = time.perf_counter()
model, tok = load_model()
ref = texts.python_reference()
seqs = default_sequences(tok, TOKENS, min(2048, TOKENS), ref.text)
print(
    f"loaded {time.perf_counter() - t0:.0f}s; calibrating on {TOKENS} tokens, {len(seqs)} seqs",
    flush=True,
)
cal = calibrate(model, seqs, log=lambda s: print(s, flush=True))
L, d = cal.num_layers, cal.head_dim
H = hadamard(d)
br = bit_reversal(d)
FULL = cal.rotations("full")


def floor(x):
    return x.clamp_min(1e-6 * float(x.max()))


def gmean_norm(x):
    return x / x.log().mean().exp()


mats = []  # per layer: dict alpha -> (Ak, Aq, Av, Avinv) float64
pred = []
for l in range(L):
    cq = cal.target(l, "key")[0]
    ck = cal.target(l, "kk")[0]
    cs = cal.target(l, "value")[0]
    cv = cal.target(l, "vv")[0]
    uk, _ = eigenbasis(cq)
    uv, _ = eigenbasis(cs)
    lam = floor(torch.diagonal(uk.T @ cq @ uk))
    kap = floor(torch.diagonal(uk.T @ ck @ uk))
    nu = floor(torch.diagonal(uv.T @ cv @ uv))
    dk = gmean_norm((lam / kap) ** 0.25)
    dv = gmean_norm(nu**-0.25)
    gk = float(kap.sum() * lam.sum() / (lam * kap).sqrt().sum() ** 2)
    gv = float(d * nu.sum() / nu.sqrt().sum() ** 2)
    # predicted gain of the half-strength variant
    dk5, dv5 = dk.sqrt(), dv.sqrt()
    gk5 = float(kap.sum() * lam.sum() / ((dk5**2 * kap).sum() * (lam / dk5**2).sum()))
    gv5 = float(nu.sum() * d / ((dv5**2 * nu).sum() * (1 / dv5**2).sum()))
    pred.append(
        dict(
            gk=gk,
            gv=gv,
            gk_half=gk5,
            gv_half=gv5,
            dk_range=float(dk.max() / dk.min()),
            dv_range=float(dv.max() / dv.min()),
        )
    )
    per = {}
    for a in ALPHAS:
        da, db = dk**a, dv**a
        ak = (uk @ torch.diag(da) @ H)[:, br]
        aq = (uk @ torch.diag(1 / da) @ H)[:, br]  # = A_K^{-T}
        av = (uv @ torch.diag(db) @ H)[:, br]
        avinv = torch.linalg.inv(av)
        per[a] = (ak, aq, av, avinv)
    # D = I must be exactly the repo's rotation
    assert torch.allclose(per[0.0][0], FULL.key[l, 0], atol=1e-12), l
    assert torch.allclose(per[0.0][2], FULL.value[l, 0], atol=1e-12), l
    if VARIANT == "no-u":  # slot 0.0 = H*P_br alone (the "no-u" recipe), 0.5 = full D=I, 1.0 = D
        per[0.5] = per[0.0]
        hb = H[:, br].contiguous()
        per[0.0] = (hb, hb, hb, hb.T.contiguous())
    mats.append(per)

# exactness in float64 on captured data of layer 0 of the first held-out tokens done below

paper_ids = tok(texts.paper().text, add_special_tokens=False)["input_ids"]
held = [torch.tensor(paper_ids[256 + i * HELD : 256 + (i + 1) * HELD]) for i in range(2)]
fit = seqs[:FIT_SEQS]


# err[set][win][role][layer][alpha][clip], norm[set][win][layer]
def zeros():
    return dict(
        err=torch.zeros(len(WINDOWS), 2, L, len(ALPHAS), len(CANDS), dtype=torch.float64),
        norm=torch.zeros(len(WINDOWS), L, dtype=torch.float64),
    )


exact_check = {}


def heads(x, g):
    return x.repeat_interleave(g, 0)


def make_cb(acc):
    @torch.no_grad()
    def cb(layer, q, k, v, scaling):
        hq, t, _ = q.shape
        g = hq // k.shape[0]
        n = min(NQ, t - t // 2)
        pos = torch.linspace(t // 2, t - 1, n).round().long()
        qs = q[:, pos].float()
        k, v = k.float(), v.float()
        vh = heads(v, g)
        s_exact = torch.einsum("hnd,htd->hnt", qs, heads(k, g)) * scaling
        visible = torch.arange(t) <= pos[:, None]
        masks = []
        for sink, recent in WINDOWS.values():
            if not sink and not recent:
                masks.append(None)
            else:
                j = torch.arange(t)
                masks.append((j < sink) | (j >= pos[:, None] + 1 - recent))
        p_exact = torch.softmax(s_exact.masked_fill(~visible, float("-inf")), -1)
        exact = p_exact @ vh
        for w in range(len(masks)):
            acc["norm"][w, layer] += float(exact.double().square().sum())
        if layer == 0 and "done" not in exact_check:
            ak, aq, _, _ = mats[layer][1.0]
            q64, k64 = qs.double(), heads(k, g).double()
            ref_s = torch.einsum("hnd,htd->hnt", q64, k64)
            new_s = torch.einsum("hnd,htd->hnt", q64 @ aq, k64 @ ak)
            exact_check["max_abs_diff"] = float((new_s - ref_s).abs().max())
            exact_check["max_abs_score"] = float(ref_s.abs().max())
            _, _, av, avinv = mats[layer][1.0]
            o64 = p_exact.double() @ heads(v, g).double()
            o2 = (p_exact.double() @ (heads(v, g).double() @ av)) @ avinv
            exact_check["value_max_abs_diff"] = float((o2 - o64).abs().max())
            exact_check["done"] = True
        for ia, a in enumerate(ALPHAS):
            ak, aq, av, avinv = (m.float() for m in mats[layer][a])
            qr = qs @ aq
            kr = k @ ak
            vr = v @ av
            for ic, p in enumerate(CANDS):
                f = QuantFormat(2, "token", d, None if p == 1.0 else p)
                kq = _fake_quantize(kr, f)
                vq = _fake_quantize(vr, f) @ avinv  # back to the original value space
                sq = torch.einsum("hnd,htd->hnt", qr, heads(kq, g)) * scaling
                vqh = heads(vq, g)
                for w, m in enumerate(masks):
                    s = sq if m is None else torch.where(m, s_exact, sq)
                    pk = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
                    ek = pk @ vh
                    if m is None:
                        ev = p_exact @ vqh
                    else:
                        ev = (p_exact * m) @ vh + (p_exact * ~m) @ vqh
                    acc["err"][w, 0, layer, ia, ic] += float((ek - exact).double().square().sum())
                    acc["err"][w, 1, layer, ia, ic] += float((ev - exact).double().square().sum())

    return cb


def run(name, ss):
    acc = zeros()
    t1 = time.perf_counter()
    with capture_attention(model, make_cb(acc)), torch.no_grad():
        for i, s in enumerate(ss):
            model(input_ids=s[None], use_cache=False, logits_to_keep=1)
            print(f"{name}: seq {i + 1}/{len(ss)} {time.perf_counter() - t1:.0f}s", flush=True)
    return acc


fit_acc = run("fit", fit)
held_acc = run("held-out", held)
torch.save(
    dict(
        pred=pred,
        fit=fit_acc,
        held=held_acc,
        exact=exact_check,
        cands=CANDS,
        alphas=ALPHAS,
        windows=list(WINDOWS),
        tokens=TOKENS,
        fit_seqs=FIT_SEQS,
    ),
    OUTP,
)
print("exactness:", json.dumps(exact_check))
print(f"total {time.perf_counter() - t0:.0f}s")
