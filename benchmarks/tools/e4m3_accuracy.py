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

A second table takes the adversarial inputs of the tests (tests/kernel_cases.E4M3_ADVERSARIAL:
peaky and flat softmaxes, keys 100x, rows offset from zero-mean, an outlier key channel, value
rows over decades, an attention sink) over INT4 (V clipped and min-max) and INT2 (V clipped,
with and without BF16 windows), pages of 16 and 64 tokens, GQA 1 and 4, one sequence of
``--adversarial-length`` tokens: gluon bf16 and gluon-e4m3 against fp64 over the dequantized
cache, the torch emulation of the E4M3 path (foscar.kernels.e4m3_emulation) and the tests'
bound from E4M3's unit roundoff (kernel_cases.e4m3_error_bound); the worst gluon-e4m3 error last.

    python benchmarks/tools/e4m3_accuracy.py [--lengths 32768 4099] [--seeds 3]
        [--adversarial-length 2048]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from kernel_cases import (  # noqa: E402
    E4M3_ADVERSARIAL,
    e4m3_adversarial_cache,
    e4m3_emulated_attention,
    e4m3_error_bound,
    e4m3_torch_attention,
    rel_l2,
)

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


#: (bits, V clipped, BF16 windows) of the adversarial table
ADVERSARIAL_FORMATS = ((4, True, False), (4, False, False), (2, True, False), (2, True, True))


def adversarial_table(length):
    """The adversarial inputs' table (module docstring); returns the worst gluon-e4m3 error."""
    sm_scale = 1 / math.sqrt(D)
    print(
        f"\n## Adversarial inputs (tests/kernel_cases.E4M3_ADVERSARIAL), {length} tokens\n\n"
        "relative L2 error against fp64 over the dequantized cache; 'emulation' = "
        "foscar.kernels.e4m3_emulation on the CPU, 'bound' = kernel_cases.e4m3_error_bound\n"
    )
    print("| input | format | page | GQA | gluon bf16 | gluon e4m3 | emulation | bound |")
    print("|---|---|---|---|---|---|---|---|")
    worst = (0.0, "")
    for kind in E4M3_ADVERSARIAL:
        for bits, clip_v, windows in ADVERSARIAL_FORMATS:
            for page_size, ratio in ((64, 4), (16, 1)):
                cache, batch, q = e4m3_adversarial_cache(
                    kind,
                    bits,
                    clip_v=clip_v,
                    windows=windows,
                    page_size=page_size,
                    ratio=ratio,
                    length=length,
                    device="cuda",
                )
                ref, _ = attend_dequantized(q.double(), cache, batch, sm_scale)
                errs = (
                    rel_l2(decode_attention(q, cache, batch, backend="gluon"), ref),
                    rel_l2(decode_attention(q, cache, batch, backend="gluon-e4m3"), ref),
                    rel_l2(e4m3_emulated_attention(q, cache, batch, sm_scale), ref.cpu()),
                    e4m3_error_bound(q, cache, batch, sm_scale),
                )
                fmt = f"INT{bits}{' V clipped' if clip_v else ''}{' + windows' if windows else ''}"
                print(
                    f"| {kind} | {fmt} | {page_size} | {ratio} | "
                    + " | ".join(f"{e:.2e}" for e in errs)
                    + " |",
                    flush=True,
                )
                worst = max(worst, (errs[1], f"{kind}, {fmt}, page {page_size}, GQA {ratio}"))
                del cache, batch
                torch.cuda.empty_cache()
    print(f"\nWorst gluon-e4m3 error over the adversarial inputs: {worst[0]:.2e} ({worst[1]})")
    return worst[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 4099])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--adversarial-length", type=int, default=2048)
    args = ap.parse_args()
    if args.adversarial_length < 1:
        ap.error(f"--adversarial-length takes a positive count, got {args.adversarial_length}")
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
    adversarial_table(args.adversarial_length)


if __name__ == "__main__":
    main()
