# ruff: noqa: E402
"""`foscar eval` with GPTQ keys refined (prototype): what does run.py's lower key error buy?

run.py measured, offline, that after GPTQ a few passes of coordinate descent on the codes (+-1
where e^T H e falls) alternating with a least-squares refit of each token's scale and offset
under H lower the held-out attention error of INT2 keys by 7.7% on average and 14% in the six
worst layers. This runs `foscar eval` unchanged but for `foscar.quantize.quantize_gptq`, here
followed by that refinement wherever the library calls it (the cache's prefill and demotion
writes, the clip fits of the calibration); decode steps take the torch write, since the fused
Triton write does not refine. Stored format and kernels are unchanged. One group per token
(group size = head_dim) only: the refit is a 2 x 2 system per token.

    python benchmarks/prototypes/oscar_gptq_refine/eval.py [foscar eval arguments]
"""

import os
import sys

import torch

import foscar.cache as cache_module
import foscar.oscar.calibrate as calibrate_module
import foscar.quantize as quantize_module
from foscar.cli import main

PASSES = int(os.environ.get("REFINE_PASSES", "4"))
REFIT = os.environ.get("REFINE_REFIT", "1") == "1"
_gptq = quantize_module.quantize_gptq


def metric_of(factor: torch.Tensor) -> torch.Tensor:
    """H (damped) from GPTQ's factor U: U^T U = H^-1. ``factor: [H, D, D]`` -> ``[H, D, D]``."""
    u = factor.to(torch.float64)
    h = torch.cholesky_inverse(u, upper=True)  # (U^T U)^-1
    h = (h + h.transpose(-1, -2)) / 2
    return h / torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)[:, None, None]


def refine(x, codes, scale, lo, hmat, levels):
    """Coordinate descent on the codes, alternating with LS refits of (scale, offset) under H.

    ``x: [H, T, D]`` (unclipped), ``codes [H, T, D]``, ``scale, lo [H, T, 1]``,
    ``hmat [H, D, D]``; returns refined ``(codes uint8, scale, lo)``."""
    c = codes.float()
    s, z = scale.float().clone(), lo.float().clone()
    xf = x.float()
    hm = hmat.to(device=x.device, dtype=torch.float32)
    diag = torch.diagonal(hm, dim1=-2, dim2=-1)[:, None, :]  # [H, 1, D]
    h1 = hm.sum(-1)[:, None, :]  # [H, 1, D]: H 1
    a22 = h1.sum(-1, keepdim=True)  # [H, 1, 1]: 1^T H 1
    hx = xf @ hm
    b2 = hx.sum(-1, keepdim=True)
    for _ in range(PASSES):
        if REFIT:
            # min over (s, z) of (x - s c - z 1)^T H (x - s c - z 1): the 2 x 2 normal equations
            hc = c @ hm
            a11 = (hc * c).sum(-1, keepdim=True)
            a12 = hc.sum(-1, keepdim=True)
            b1 = (hx * c).sum(-1, keepdim=True)
            det = a11 * a22 - a12 * a12
            s_new = (b1 * a22 - a12 * b2) / det
            z_new = (a11 * b2 - a12 * b1) / det
            ok = (det.abs() > 1e-9 * (a11 * a22).abs()) & (s_new > 0) & torch.isfinite(s_new)
            s = torch.where(ok, s_new, s)
            z = torch.where(ok, z_new, z)
        he = (xf - (c * s + z)) @ hm  # H e, kept current as codes move
        for j in range(x.shape[-1]):
            best_gain = torch.zeros_like(he[..., j])
            best_delta = torch.zeros_like(best_gain)
            for delta in (-1.0, 1.0):
                valid = (c[..., j] + delta >= 0) & (c[..., j] + delta <= levels)
                step = delta * s[..., 0]
                gain = 2 * step * he[..., j] - step * step * diag[..., j]  # fall of e^T H e
                take = valid & (gain > best_gain)
                best_gain = torch.where(take, gain, best_gain)
                best_delta = torch.where(take, torch.full_like(gain, delta), best_delta)
            c[..., j] += best_delta
            he -= (best_delta * s[..., 0])[..., None] * hm[:, j, :][:, None, :]
    return c.to(torch.uint8), s.to(scale.dtype), z.to(lo.dtype)


def quantize_gptq_refined(x, fmt, factor):
    codes, scale, lo = _gptq(x, fmt, factor)
    if fmt.group_size != x.shape[-1] or x.shape[-2] == 0:
        return codes, scale, lo
    return refine(x, codes, scale, lo, metric_of(factor), fmt.levels)


for module in (quantize_module, cache_module, calibrate_module):
    module.quantize_gptq = quantize_gptq_refined
# decode steps through the torch write (the fused Triton write rounds by plain GPTQ)
cache_module.QuantizedKVCache._fused_write = lambda self, layer: False
print(f"GPTQ refined: {PASSES} passes, LS refit {REFIT}", flush=True)
sys.exit(main(["eval", *sys.argv[1:]]))
