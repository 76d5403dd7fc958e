# ruff: noqa: E402, E501, E741
import sys

import torch

r = torch.load(sys.argv[1] if len(sys.argv) > 1 else "diag_noU.pt", weights_only=False)
cands, wins = r["cands"], r["windows"]
L = len(r["pred"])


def rel(acc):
    return (acc["err"] / acc["norm"][:, None, :, None, None]).sqrt()


fit, held = rel(r["fit"]), rel(r["held"])
print("slots: 0 = H*P_br (no-u), 1 = full U*H*P_br (D=I), 2 = U*D*H*P_br (optimal D)")
for w, wn in enumerate(wins):
    best = fit[w].argmin(-1)
    fiterr = fit[w].min(-1).values  # [role, L, slot]
    h = held[w].gather(-1, best[..., None])[..., 0]
    print(f"\n=== windows {wn} ===")
    for role, rn in ((0, "K"), (1, "V")):
        sel = torch.where(fiterr[role, :, 0] < fiterr[role, :, 1], h[role, :, 0], h[role, :, 1])
        nsel = int((fiterr[role, :, 0] < fiterr[role, :, 1]).sum())
        # selection among all three (what a 'select' option with D would do)
        sel3 = h[role].gather(-1, fiterr[role].argmin(-1, keepdim=True))[:, 0]
        print(
            f"{rn} per-layer held-out error: no-u / full / optD / select(no-u,full) / select(all 3)"
        )
        for l in range(L):
            print(
                f"  {l:2d} {h[role, l, 0]:.4f} {h[role, l, 1]:.4f} {h[role, l, 2]:.4f} {sel[l]:.4f} {sel3[l]:.4f}  optD/sel {h[role, l, 2] / sel[l]:.3f}"
            )
        for name, x in (
            ("full/no-u", h[role, :, 1] / h[role, :, 0]),
            ("optD/no-u", h[role, :, 2] / h[role, :, 0]),
            ("optD/select(no-u,full)", h[role, :, 2] / sel),
            ("select3/select2", sel3 / sel),
        ):
            print(
                f"{rn} {name}: mean {x.mean():.3f} median {x.median():.3f} improved {(x < 1).sum()}/{L} >15% {(x < 0.85).sum()}/{L}"
            )
        print(
            f"{rn} mean errors: no-u {h[role, :, 0].mean():.4f} full {h[role, :, 1].mean():.4f} optD {h[role, :, 2].mean():.4f} "
            f"select2 {sel.mean():.4f} (no-u chosen in {nsel}/{L}) select3 {sel3.mean():.4f}"
        )
