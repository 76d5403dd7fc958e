"""Accuracy of the Gluon kernel's E4M3 operand path (backend "gluon-e4m3") against its bf16 path,
measured on a Hopper GPU (sm_90).

The same token-wise INT2/INT4 cache (g = D = 128) is decoded by both operand mappings; each
output's relative L2 error is taken against fp64 attention over the dequantized cache (what
the kernels compute, so only operand rounding shows) and against fp64 attention over the
unquantized K/V (the whole error a user sees), beside the E4M3 torch bar of the tests
(tests/kernel_cases.e4m3_torch_attention). Paper shape: 32 query heads over 8 KV heads,
D = 128; zero-mean Gaussian K/V (channel spreads as the tests use), the same with a 10x
outlier channel in K (post-RoPE keys of real models have some), and with V rows offset by 20
(offsets far beyond each row's range, where the offset term must not carry P's rounding).

    python benchmarks/tools/e4m3_accuracy.py [--lengths 32768 4099] [--seeds 3]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from kernel_cases import e4m3_torch_attention, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat, QuantizedKVCache, decode_attention  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402

H_Q, H_KV, D = 32, 8, 128


def make(bits, lengths, data, seed):
    """A cache of the given lengths and the unquantized K/V it was filled from."""
    fmt = KVFormat(QuantFormat(bits, "token", 128), QuantFormat(bits, "token", 128))
    g = torch.Generator().manual_seed(seed)
    pages = sum(math.ceil(n / 64) for n in lengths) + 2
    cache = QuantizedKVCache(
        fmt, num_kv_heads=H_KV, head_dim=D, num_pages=pages, max_seqs=len(lengths), device="cuda"
    )
    ids = [cache.add_sequence() for _ in lengths]
    spread = torch.linspace(0.3, 2.0, D)
    k = torch.randn(sum(lengths), H_KV, D, generator=g) * spread
    v = torch.randn(sum(lengths), H_KV, D, generator=g) * spread.flip(0)
    if data == "outlier":
        k[..., 5] *= 10
    if data == "offset":
        v += 20.0
    cache.append(ids, k.cuda(), v.cuda(), list(lengths))
    batch = cache.plan(ids)
    q = torch.randn(len(lengths), H_Q, D, generator=g).to("cuda", torch.bfloat16)
    return cache, batch, q, k.double(), v.double()


def exact_attention(q, k, v, lengths):
    """fp64 attention over the unquantized K/V: [B, H_Q, D]."""
    outs, start = [], 0
    for i, n in enumerate(lengths):
        kk = k[start : start + n].transpose(0, 1).cuda()  # [H_KV, n, D]
        vv = v[start : start + n].transpose(0, 1).cuda()
        qq = q[i].double().reshape(H_KV, H_Q // H_KV, D)
        p = torch.softmax(torch.einsum("hqd,hnd->hqn", qq, kk) / math.sqrt(D), dim=-1)
        outs.append(torch.einsum("hqn,hnd->hqd", p, vv).reshape(H_Q, D))
        start += n
    return torch.stack(outs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 4099])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print("# Gluon kernel: E4M3 operands against bf16 operands\n")
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
        f"lengths {args.lengths}, worst of {args.seeds} seeds. Command: "
        f"`python benchmarks/tools/e4m3_accuracy.py {' '.join(sys.argv[1:])}`\n"
    )
    print(
        "relative L2 error of the output, worst over seeds; 'dequant' = against fp64 attention "
        "over the dequantized cache, 'exact' = against fp64 over the unquantized K/V\n"
    )
    print(
        "| bits | data | gluon bf16 (dequant) | gluon e4m3 (dequant) | e4m3 torch bar | "
        "gluon bf16 (exact) | gluon e4m3 (exact) |"
    )
    print("|---|---|---|---|---|---|---|")
    for bits in (2, 4):
        for data in ("gaussian", "outlier", "offset"):
            worst = [0.0] * 5
            for seed in range(args.seeds):
                cache, batch, q, k, v = make(bits, args.lengths, data, seed)
                ref, _ = attend_dequantized(q.double(), cache, batch)
                exact = exact_attention(q, k, v, args.lengths)
                o_bf16 = decode_attention(q, cache, batch, backend="gluon")
                o_e4m3 = decode_attention(q, cache, batch, backend="gluon-e4m3")
                bar, _ = e4m3_torch_attention(q, cache, batch, 1 / math.sqrt(D))
                errs = (
                    rel_l2(o_bf16, ref),
                    rel_l2(o_e4m3, ref),
                    rel_l2(bar, ref),
                    rel_l2(o_bf16, exact),
                    rel_l2(o_e4m3, exact),
                )
                worst = [max(a, b) for a, b in zip(worst, errs)]
                del cache, batch
                torch.cuda.empty_cache()
            name = {"gaussian": "Gaussian", "outlier": "10x outlier K channel"}.get(
                data, "V rows offset by 20"
            )
            print(f"| INT{bits} | {name} | " + " | ".join(f"{e:.2e}" for e in worst) + " |")


if __name__ == "__main__":
    main()
