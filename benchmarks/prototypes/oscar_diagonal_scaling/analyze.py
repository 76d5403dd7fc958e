# ruff: noqa: E402, E501, E741
import sys

import torch

r = torch.load(sys.argv[1] if len(sys.argv) > 1 else "diag_scaling.pt", weights_only=False)
pred, cands, alphas, wins = r["pred"], r["cands"], r["alphas"], r["windows"]
L = len(pred)


def rel(acc):
    return (acc["err"] / acc["norm"][:, None, :, None, None]).sqrt()  # [w, role, L, alpha, clip]


fit, held = rel(r["fit"]), rel(r["held"])
print(
    f"calibration tokens {r['tokens']}, clip fit on first {r['fit_seqs']} calibration seqs; exactness {r['exact']}"
)
for w, wn in enumerate(wins):
    best = fit[w].argmin(-1)  # [role, L, alpha]
    h = held[w].gather(-1, best[..., None])[..., 0]  # held-out error at fitted clip
    ho = held[w].min(-1).values  # held-out oracle clip
    print(
        f"\n=== windows {wn}: held-out rel. attention-output error at clip fitted on calibration ==="
    )
    print(
        "layer | predGainK (errRatio) | K: D=I  D^.5/I  D/I | clipK I,.5,1 | predGainV (errRatio) | V: D=I  D^.5/I  D/I | clipV I,.5,1"
    )
    for l in range(L):
        p = pred[l]
        ck = [cands[int(best[0, l, a])] for a in range(3)]
        cv = [cands[int(best[1, l, a])] for a in range(3)]
        print(
            f"{l:2d} | {p['gk']:.3f} ({p['gk'] ** -0.5:.3f}) | {h[0, l, 0]:.4f} {h[0, l, 1] / h[0, l, 0]:.3f} {h[0, l, 2] / h[0, l, 0]:.3f} | {ck} | "
            f"{p['gv']:.3f} ({p['gv'] ** -0.5:.3f}) | {h[1, l, 0]:.4f} {h[1, l, 1] / h[1, l, 0]:.3f} {h[1, l, 2] / h[1, l, 0]:.3f} | {cv}"
        )
    for role, rn, g in ((0, "K", "gk"), (1, "V", "gv")):
        pg = torch.tensor([p[g] for p in pred])
        for a in (1, 2):
            ratio = h[role, :, a] / h[role, :, 0]
            oratio = ho[role, :, a] / ho[role, :, 0]
            print(
                f"{rn} alpha={alphas[a]}: ratio mean {ratio.mean():.3f} median {ratio.median():.3f} "
                f"min {ratio.min():.3f} max {ratio.max():.3f}; layers improved {(ratio < 1).sum()}/{L}, "
                f">15% better {(ratio < 0.85).sum()}/{L}; mean-error ratio {h[role, :, a].mean() / h[role, :, 0].mean():.3f}; "
                f"oracle-clip ratio mean {oratio.mean():.3f}"
            )
        print(
            f"{rn} predicted gain mean {pg.mean():.3f} median {pg.median():.3f}; predicted error ratio 1/sqrt(gain) mean {(pg**-0.5).mean():.3f}; "
            f"mean held-out error D=I {h[role, :, 0].mean():.4f}"
        )
        gh = torch.tensor([p[g + "_half"] for p in pred])
        print(f"{rn} predicted gain at half strength mean {gh.mean():.3f}")
        ratio = h[role, :, 2] / h[role, :, 0]
        c = torch.corrcoef(torch.stack([pg.log(), ratio.log()]))[0, 1]
        print(f"{rn} corr(log predicted gain, log measured ratio) = {c:.3f}")
print("\nd ranges (max/min) K:", [round(p["dk_range"], 1) for p in pred])
print("d ranges (max/min) V:", [round(p["dv_range"], 1) for p in pred])
