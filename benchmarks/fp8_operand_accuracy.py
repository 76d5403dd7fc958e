"""Accuracy of the FP8 (E4M3) operand path of issue 4 against the bf16 path, modelled on the CPU.

Both paths read the same token-wise INT2/INT4 cache (g = D = 128) and fold as design.md says;
they differ in the matrix-unit operands:
    bf16: K/V operands y = q + 128 (exact), Q bf16 (exact), P' = bf16(P s'_V)
    e4m3: K/V operands y = q * 2^-9 (exact in E4M3), Q and P' rounded to E4M3 after a per-row
          power-of-two scale that puts the row's largest magnitude at or under 448 (the paper's
          Blackwell kernel); offsets computed from the rounded operands (Note [offset
          cancellation]), products accumulated in fp64 here (the model isolates operand rounding)
Prints the relative L2 error of each path's output against fp64 attention over the dequantized
cache (and, for scale, that of the quantization itself against the unquantized cache), for
zero-mean Gaussian K/V at the paper shape (32 query heads over 8 KV heads, 32K tokens) and the
same with a 10x outlier channel in K (post-RoPE keys of real models have one).

    python benchmarks/fp8_operand_accuracy.py
"""

import math

import torch

from foscar.formats import QuantFormat
from foscar.quantize import dequantize, quantize


def e4m3_rows(x, dim):
    """x rounded to E4M3 after scaling each row (reduced over ``dim``) by a power of two that
    puts its largest magnitude at or under 448; returns the rounded values in x's units."""
    amax = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-30)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (x * scale).to(torch.float8_e4m3fn).double() / scale


def attention(q, k, v, sm_scale, p_round):
    """q: [H, D], k/v: [L, D] -> o: [H, D]; p_round rounds P * s'_V (here: P) per head."""
    s = (q @ k.T) * sm_scale
    p = torch.softmax(s, dim=-1)
    return p_round(p) @ v / p.sum(-1, keepdim=True)


def run(bits, outlier, L=32768, H_Q=32, H_KV=8, D=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = QuantFormat(bits, "token", 128)
    errs = {"bf16": [], "e4m3": [], "quantization": []}
    for _ in range(H_KV):
        k = torch.randn(L, D, generator=g, dtype=torch.float64)
        if outlier:
            k[:, 5] *= 10
        v = torch.randn(L, D, generator=g, dtype=torch.float64)
        kx = dequantize(*quantize(k.float(), fmt), fmt).double()  # the cache's values
        vx = dequantize(*quantize(v.float(), fmt), fmt).double()
        q = torch.randn(H_Q // H_KV, D, generator=g).to(torch.bfloat16).double()
        sm = 1 / math.sqrt(D)
        ref = attention(q, kx, vx, sm, lambda p: p)
        exact = attention(q, k, v, sm, lambda p: p)  # the unquantized cache
        errs["quantization"].append(float((ref - exact).norm() / exact.norm()))
        # bf16 path: Q exact, P' = bf16(P s'_V): model the rounding as relative bf16 on P
        bf16 = attention(q, kx, vx, sm, lambda p: p.to(torch.bfloat16).double())
        # e4m3 path: Q rounded per query head row, P rounded per head row (offsets from the
        # rounded operands make the result that of attention with these rounded operands)
        q8 = e4m3_rows(q, dim=1)
        e4m3 = attention(q8, kx, vx, sm, lambda p: e4m3_rows(p, dim=1))
        for name, o in (("bf16", bf16), ("e4m3", e4m3)):
            errs[name].append(float((o - ref).norm() / ref.norm()))
    return {k: sum(v) / len(v) for k, v in errs.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for bits in (2, 4):
        for outlier in (False, True):
            r = run(bits, outlier)
            print(
                f"INT{bits} {'10x K outlier channel' if outlier else 'Gaussian K/V'}: "
                f"rel L2 vs fp64  bf16 path {r['bf16']:.2e}  e4m3 path {r['e4m3']:.2e}  "
                f"(the quantization itself, vs the unquantized cache: {r['quantization']:.2e})",
                flush=True,
            )
