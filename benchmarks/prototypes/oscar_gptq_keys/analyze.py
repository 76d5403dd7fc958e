# ruff: noqa: E402, E501, E701, E741, F841, I001
import sys
import torch
r = torch.load(sys.argv[1], weights_only=False)
cands, VARS, wins, L, role = r["cands"], r["vars"], r["windows"], r["L"], r["role"]
fit, held = r["fit"], r["held"]
def rel(a, e="err", n="norm"):
    nn = a[n] if a[n].dim() == 1 else a[n]
    return (a[e] / nn[None, None, :, None]).sqrt()  # [w, var, L, clip]
metric = ("err", "norm") if role == "key" else ("err", "norm2")
print(f"role {role}, calibration tokens {r['tokens']}, clip fit on first {r['fit_seqs']} cal seqs, layers {L}")
print("metric:", "rel. attention-output error" if role == "key" else "rel. error after o_proj (sum over heads of o_h W_h)")
def table(metric, label):
    F, Hh = rel(fit, *metric), rel(held, *metric)
    objF = (fit["obj"] / fit["objn"][None, :, None])
    objH = (held["obj"] / held["objn"][None, :, None])
    for w, wn in enumerate(wins):
        best = F[w].argmin(-1)  # [var, L]
        h = Hh[w].gather(-1, best[..., None])[..., 0]  # [var, L]
        print(f"\n=== {label}, windows {wn}: held-out error at the clip fitted per layer/variant ===")
        for rot in ("full", "no-u"):
            base = VARS.index((rot, "rtn"))
            print(f"-- rotation {rot}: RTN mean err {h[base].mean():.4f}")
            for iv, (rr, m) in enumerate(VARS):
                if rr != rot or iv == base: continue
                ratio = h[iv] / h[base]
                ob = (objH[iv].gather(-1, best[iv][:, None])[:, 0] / objH[base].gather(-1, best[base][:, None])[:, 0])
                print(f"{m:8s} ratio mean {ratio.mean():.3f} median {ratio.median():.3f} min {ratio.min():.3f} max {ratio.max():.3f}; improved {(ratio<1).sum()}/{L}; >15% {(ratio<0.85).sum()}/{L}; >20% {(ratio<0.8).sum()}/{L}; mean-err ratio {h[iv].mean()/h[base].mean():.3f}; e'He ratio (held, fitted clips) mean {ob.mean():.3f}")
        if len(sys.argv) > 2:
            pick = sys.argv[2]
            for rot in ("full", "no-u"):
                b, g = VARS.index((rot, "rtn")), VARS.index((rot, pick))
                print(f"per layer {rot}: layer RTN {pick} ratio clipRTN clip{pick}")
                print("  " + "; ".join(f"{l}:{h[b,l]:.4f}/{h[g,l]:.4f}={h[g,l]/h[b,l]:.3f} c{cands[int(best[b,l])]}/{cands[int(best[g,l])]}" for l in range(L)))
table(metric, "primary")
if role == "value":
    table(("err2", "norm"), "plain attention-output error (V)")
