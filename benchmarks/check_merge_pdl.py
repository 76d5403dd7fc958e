"""The Gluon split kernel with the merge as a programmatic dependent launch (kernel OPT 8192,
the default since session 8) against the plain launch (the bit cleared), the split workspace
NaN-filled before each eager call: bit-identical outputs and LSEs over split counts, both operand
mappings, eager and in a CUDA-graph replay (H200). Prints one line per case.

    python benchmarks/check_merge_pdl.py
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kernel_cases import build_cache, queries  # noqa: E402

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402


def decode(q, cache, batch, cfg, operands, splits, out, lse):
    gluon_backend.decode(
        q,
        cache,
        batch,
        128**-0.5,
        out=out,
        lse=lse,
        return_lse=True,
        config=cfg,
        splits=splits,
        operands=operands,
    )


def main():
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    cache, batch = build_cache(fmt, (1, 700, 4097, 33000), num_kv_heads=8, device="cuda")
    q = queries(batch, 32, 128, "cuda")
    default = gluon_backend.gluon_decode_config("token")
    base = dataclasses.replace(default, opt=default.opt & ~gluon_backend.MERGE_PDL)
    pdl = dataclasses.replace(default, opt=default.opt | gluon_backend.MERGE_PDL)
    for operands in ("bf16", "e4m3"):
        for splits in (2, 7, 33):
            res = []
            for cfg in (base, pdl):
                # stale partials of the other launch must not pass for this one's
                for o_part, lse_part in batch.__dict__.get("_workspaces", {}).values():
                    o_part.fill_(math.nan)
                    lse_part.fill_(math.nan)
                out = torch.full_like(q, math.nan)
                lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device="cuda")
                decode(q, cache, batch, cfg, operands, splits, out, lse)
                res.append((out, lse))
            same = torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
            print(f"eager {operands} splits={splits}: identical={same}")
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
        decode(q, cache, batch, pdl, operands, None, out, lse)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode(q, cache, batch, pdl, operands, None, out, lse)
        ok = True
        for seed in range(3):
            q.copy_(queries(batch, 32, 128, "cuda", seed=10 + seed))
            out.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            want = torch.empty_like(q)
            want_lse = torch.empty_like(lse)
            decode(q, cache, batch, base, operands, None, want, want_lse)
            ok = ok and torch.equal(out, want) and torch.equal(lse, want_lse)
        print(f"graph {operands}: identical over 3 replays={ok}")


if __name__ == "__main__":
    main()
