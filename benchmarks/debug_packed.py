"""The packed-heads E4M3 kernel (kernel OPT 262144) beside the one-page E4M3 kernel: per case
and query head, the error against fp64 over the dequantized cache, non-finite outputs and the
LSE's deviation, at one split and at the split rule's count. H200 only. (Session 10's first
version also ran two debug orders of the packed tile, kernel bits since removed; its output,
results/h200/session10/debug/, located the fault in Q's zero halves: benchmarks/NOTES.md 20.)

    python benchmarks/debug_packed.py
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kernel_cases import build_cache, queries, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat, configs  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402


def main():
    torch.manual_seed(0)
    for bits in (2, 4):
        fmt = KVFormat(QuantFormat(bits, "token", 128), QuantFormat(bits, "token", 128))
        packed = configs.gluon_packed_config(bits, bits)
        variants = {"one-page": None, "packed": packed}
        for lengths in ((128,), (64,), (1,), (256,), (4099,), (1, 17, 63, 64, 65, 263, 4099)):
            for ratio in (1, 4):
                cache, batch = build_cache(fmt, lengths, num_kv_heads=2, device="cuda", seed=1)
                q = queries(batch, 2 * ratio, 128, "cuda")
                ref, ref_lse = attend_dequantized(q.double(), cache, batch, 128**-0.5)
                for splits in (1, None):
                    cells = []
                    for name, cfg in variants.items():
                        out = torch.full_like(q, math.nan)
                        lse = torch.full(q.shape[:2], math.nan, device="cuda")
                        kw = {} if cfg is None else {"config": cfg}
                        gluon_backend.decode(
                            q,
                            cache,
                            batch,
                            128**-0.5,
                            out=out,
                            lse=lse,
                            return_lse=True,
                            operands="e4m3",
                            splits=splits,
                            **kw,
                        )
                        torch.cuda.synchronize()
                        nan = int((~torch.isfinite(out)).sum())
                        o = torch.nan_to_num(out.double())
                        per_head = [rel_l2(o[:, h], ref[:, h]) for h in range(q.shape[1])]
                        dl = float((torch.nan_to_num(lse.double()) - ref_lse).abs().max())
                        cells.append(
                            f"{name}: err {rel_l2(o, ref):.1e} nan {nan} dlse {dl:.2f} "
                            f"heads {' '.join(f'{e:.0e}' for e in per_head[: 2 * ratio])}"
                        )
                    print(
                        f"INT{bits} L={lengths} ratio {ratio} splits {splits}\n  "
                        + "\n  ".join(cells),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
