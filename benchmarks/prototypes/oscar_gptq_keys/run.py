# ruff: noqa: E402, E501, E701, E741, F841, I001
"""GPTQ-style (error-feedback) rounding of OSCAR-rotated INT2 token-wise K or V vs RTN
(EVAL_NOTES 13; written by a helper in session 11, before foscar.quantize.quantize_gptq, which
implements its "g.01u" variant; outputs in benchmarks/results/cpu/oscar_gptq_keys/).

Same stored format (codes, per-token scale/offset from min-max of the clipped row); only the
codes change (and, for '+ls' variants, scale/offset are re-fitted by least squares under H).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python run.py key   8192 2 2048 key.pt
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python run.py value 8192 2 2048 value.pt

K: H = R^T C_Q[h] R per KV head (query covariance, 'key' target, rotated basis).
V: H = R^T (sum_{q heads of h} W_q W_q^T) R, W_q = o_proj.weight[:, q cols]^T ([64, hidden]).
"""

import sys
import time

import torch

torch.set_num_threads(1)
from foscar.eval import texts
from foscar.eval.model import load_model
from foscar.oscar.calibrate import CLIP_CANDIDATES, calibrate, default_sequences
from foscar.oscar.capture import capture_attention

ROLE = sys.argv[1] if len(sys.argv) > 1 else "key"
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
FIT_SEQS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
HELD = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
OUTP = sys.argv[5] if len(sys.argv) > 5 else f"{ROLE}.pt"
MAXL = int(sys.argv[6]) if len(sys.argv) > 6 else 10**9  # debug: only the first MAXL layers
NQ = 64
WINDOWS = {"nowin": (0, 0), "win64_256": (64, 256)}
CANDS = [float(p) for p in CLIP_CANDIDATES]
ROTS = ("full", "no-u")
# method: (kind, damp, act_order, target_unclipped, ls_refit)
METHODS = {
    "rtn": ("rtn", 0, False, False, False),
    "rtn+ls": ("rtn", 0, False, False, True),
    "g.01": ("gptq", 0.01, False, False, False),
    "g.1": ("gptq", 0.1, False, False, False),
    "g.01a": ("gptq", 0.01, True, False, False),
    "g.1a": ("gptq", 0.1, True, False, False),
    "g.01u": ("gptq", 0.01, False, True, False),
    "g.01+ls": ("gptq", 0.01, False, False, True),
}
import os
if os.environ.get("METHODS"):
    METHODS = {k: METHODS[k] for k in os.environ["METHODS"].split(",")}
VARS = [(r, m) for r in ROTS for m in METHODS]

t0 = time.perf_counter()
model, tok = load_model()
ref = texts.python_reference()
seqs = default_sequences(tok, TOKENS, min(2048, TOKENS), ref.text)
print(f"loaded {time.perf_counter() - t0:.0f}s; calibrating on {TOKENS} tokens, {len(seqs)} seqs", flush=True)
cal = calibrate(model, seqs, log=lambda s: print(s, flush=True))
L, d, HKV = cal.num_layers, cal.head_dim, cal.num_kv_heads
L = min(L, MAXL)
ROTM = {r: cal.rotations(r) for r in ROTS}
HQ = model.config.num_attention_heads
G = HQ // HKV

# per layer: output-projection slices Wt [HQ, d, hidden]
WT = []
for l in range(L):
    w = model.model.layers[l].self_attn.o_proj.weight.detach().double()  # [hidden, HQ*d]
    WT.append(w.T.reshape(HQ, d, -1))

# Hessians in the rotated basis, per layer/rot: H [HKV, d, d] float64
HESS = {}
for l in range(L):
    for r in ROTS:
        if ROLE == "key":
            R = ROTM[r].key[l, 0]
            c = cal.target(l, "key", per_head=True)  # [HKV, d, d]
        else:
            R = ROTM[r].value[l, 0]
            m = torch.einsum("hde,hfe->hdf", WT[l], WT[l])  # W W^T per q head [HQ, d, d]
            c = m.unflatten(0, (HKV, G)).sum(1)
        HESS[l, r] = (R, R.T @ c @ R)

PREP = {}


def prep(l, r, damp, act):
    key = (l, r, damp, act)
    if key not in PREP:
        _, h = HESS[l, r]
        dg = torch.diagonal(h, dim1=-2, dim2=-1)
        if act:
            perm = torch.stack([torch.argsort(x, descending=True) for x in dg])  # [HKV, d]
        else:
            perm = torch.arange(d).expand(HKV, d)
        hp = torch.stack([h[i][perm[i]][:, perm[i]] for i in range(HKV)])
        hd = hp + damp * dg.mean(-1)[:, None, None] * torch.eye(d, dtype=h.dtype)
        hinv = torch.cholesky_inverse(torch.linalg.cholesky(hd))
        u = torch.linalg.cholesky(hinv, upper=True)
        inv = torch.argsort(perm, dim=-1)
        PREP[key] = (u.float(), perm, inv)
    return PREP[key]


def clip_rows(x, p):
    if p == 1.0:
        return x
    idx = min(int(p * d), d - 1)
    tau = torch.kthvalue(x.abs(), idx + 1, dim=-1, keepdim=True).values
    return torch.maximum(torch.minimum(x, tau), -tau)


def quant(xr, p, l, r, meth):
    """xr: [HKV, T, d] rotated fp32. Returns dequantized [HKV, T, d] fp32."""
    kind, damp, act, unclipped, ls = METHODS[meth]
    x = xr.to(torch.bfloat16).float()
    xc = clip_rows(x, p)
    lo = xc.amin(-1, keepdim=True)
    span = (xc.amax(-1, keepdim=True) - lo).clamp_min(1e-8)
    s = span / span.new_full((), 3.0)
    if kind == "rtn":
        codes = torch.floor((xc - lo) / s + 0.5).clamp_(0, 3)
    else:
        u, perm, inv = prep(l, r, damp, act)
        tgt = x if unclipped else xc
        w = torch.gather(tgt, -1, perm[:, None, :].expand_as(tgt)).clone()
        codes = torch.empty_like(w)
        for j in range(d):
            xj = w[..., j : j + 1]
            q = torch.floor((xj - lo) / s + 0.5).clamp_(0, 3)
            codes[..., j : j + 1] = q
            err = (xj - (q * s + lo)) / u[:, j, j][:, None, None]
            if j + 1 < d:
                w[..., j + 1 :] -= err * u[:, None, j, j + 1 :]
        codes = torch.gather(codes, -1, inv[:, None, :].expand_as(codes))
    if ls:  # least-squares (s, z) under H against the unclipped row, codes fixed
        _, h = HESS[l, r]
        hf = h.float()
        hq = torch.einsum("htd,hde->hte", codes, hf)
        h1 = hf.sum(-1)[:, None, :]  # [HKV,1,d]
        a11 = (codes * hq).sum(-1, keepdim=True)
        a12 = (codes * h1).sum(-1, keepdim=True)
        a22 = h1.sum(-1, keepdim=True).expand_as(a11)
        b1 = (hq * x).sum(-1, keepdim=True)
        b2 = (h1 * x).sum(-1, keepdim=True)
        det = a11 * a22 - a12 * a12
        ok = det > 1e-6 * a11 * a22
        dsafe = torch.where(ok, det, torch.ones_like(det))
        s2 = (a22 * b1 - a12 * b2) / dsafe
        z2 = (a11 * b2 - a12 * b1) / dsafe
        s = torch.where(ok, s2, s)
        lo = torch.where(ok, z2, lo)
    return codes * s + lo


paper_ids = tok(texts.paper().text, add_special_tokens=False)["input_ids"]
held = [torch.tensor(paper_ids[256 + i * HELD : 256 + (i + 1) * HELD]) for i in range(2)]
fit = seqs[:FIT_SEQS]
NV, NW, NC = len(VARS), len(WINDOWS), len(CANDS)


def zeros():
    return dict(
        err=torch.zeros(NW, NV, L, NC, dtype=torch.float64),  # K: attn out; V: after o_proj
        err2=torch.zeros(NW, NV, L, NC, dtype=torch.float64),  # V: plain attn out
        obj=torch.zeros(NV, L, NC, dtype=torch.float64),  # sum e^T H e over tokens (H undamped)
        objn=torch.zeros(L, dtype=torch.float64),  # sum x^T H x
        norm=torch.zeros(L, dtype=torch.float64),
        norm2=torch.zeros(L, dtype=torch.float64),
    )


def heads(x):
    return x.repeat_interleave(G, 0)


def make_cb(acc):
    @torch.no_grad()
    def cb(layer, q, k, v, scaling):
        if layer >= L:
            return
        t = q.shape[1]
        n = min(NQ, t - t // 2)
        pos = torch.linspace(t // 2, t - 1, n).round().long()
        qs = q[:, pos].float()
        k, v = k.float(), v.float()
        vh = heads(v)
        s_exact = torch.einsum("hnd,htd->hnt", qs, heads(k)) * scaling
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
        wt = WT[layer].float()
        oexact = torch.einsum("hnd,hde->ne", exact, wt)
        acc["norm"][layer] += float(exact.double().square().sum())
        acc["norm2"][layer] += float(oexact.double().square().sum())
        for iv, (r, meth) in enumerate(VARS):
            R, h = HESS[layer, r]
            Rf, hf = R.float(), h.float()
            xr = (k if ROLE == "key" else v) @ Rf
            if iv == 0:
                acc["objn"][layer] += float(torch.einsum("htd,hde,hte->", xr, hf, xr))
            qr = qs @ Rf
            for ic, p in enumerate(CANDS):
                xq = quant(xr, p, layer, r, meth)
                e = xq - xr
                acc["obj"][iv, layer, ic] += float(torch.einsum("htd,hde,hte->", e, hf, e))
                if ROLE == "key":
                    sq = torch.einsum("hnd,htd->hnt", qr, heads(xq)) * scaling
                    for w, m in enumerate(masks):
                        s = sq if m is None else torch.where(m, s_exact, sq)
                        pk = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
                        ek = pk @ vh
                        acc["err"][w, iv, layer, ic] += float((ek - exact).double().square().sum())
                else:
                    vqh = heads(xq @ Rf.T)
                    for w, m in enumerate(masks):
                        if m is None:
                            ev = p_exact @ vqh
                        else:
                            ev = (p_exact * m) @ vh + (p_exact * ~m) @ vqh
                        de = ev - exact
                        acc["err2"][w, iv, layer, ic] += float(de.double().square().sum())
                        do = torch.einsum("hnd,hde->ne", de, wt)
                        acc["err"][w, iv, layer, ic] += float(do.double().square().sum())

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
    dict(fit=fit_acc, held=held_acc, cands=CANDS, vars=VARS, windows=list(WINDOWS),
         tokens=TOKENS, fit_seqs=FIT_SEQS, role=ROLE, L=L),
    OUTP,
)
print(f"total {time.perf_counter() - t0:.0f}s")
