"""The E4M3 paper-shape-with-windows case (tests/test_gluon_kernel.py
test_e4m3_operands_paper_shape_and_windows) under each launch variant, twice per variant: the
error against fp64 over the dequantized cache, the emulation bar, the LSE deviations, and whether
the two calls agree bit for bit. Session 8 saw the [2-True] and [4-True] cases fail at commit
7369d93 without a message (the run's time limit cut pytest's report).

    python benchmarks/diagnose_e4m3_windows.py
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kernel_cases import build_cache, e4m3_torch_attention, queries, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402


def main():
    cols = ["bits", "variant", "call", "error vs fp64", "emulation bar", "lse dev"]
    cols += ["emulation lse dev", "same bits as call 0"]
    print("| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for bits in (2, 4):
        fmt = KVFormat(
            QuantFormat(bits, "token", 128),
            QuantFormat(bits, "token", 128),
            sink_tokens=64,
            recent_tokens=256,
        )
        cache, batch = build_cache(fmt, (32768, 4099, 1), num_kv_heads=8, device="cuda", seed=bits)
        q = queries(batch, 32, 128, "cuda")
        scale = 128**-0.5
        ref, ref_lse = attend_dequantized(q.double(), cache, batch, scale)
        emu, emu_lse = e4m3_torch_attention(q, cache, batch, scale)
        bar = rel_l2(emu, ref)
        emu_dev = float((emu_lse.double() - ref_lse).abs().max())
        base = gluon_backend.gluon_decode_config("token")
        for name, opt in (("qc", base.opt | 2048), ("base", base.opt & ~2048)):
            cfg = dataclasses.replace(base, opt=opt | 512)
            first = None
            for call in range(3):
                out = torch.full_like(q, math.nan)
                lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device="cuda")
                gluon_backend.decode(
                    q,
                    cache,
                    batch,
                    scale,
                    out=out,
                    lse=lse,
                    return_lse=True,
                    config=cfg,
                    operands="e4m3",
                )
                torch.cuda.synchronize()
                err = rel_l2(out, ref)
                dev = float((lse.double() - ref_lse).abs().max())
                same = "" if first is None else str(torch.equal(first, out))
                first = out.clone() if first is None else first
                row = [bits, name, call, f"{err:.3e}", f"{bar:.3e}", f"{dev:.3e}"]
                row += [f"{emu_dev:.3e}", same]
                print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
