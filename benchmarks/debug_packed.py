"""Where the packed-heads E4M3 kernel (kernel OPT 262144) goes wrong: per case and head, the
error against fp64 over the dequantized cache, next to the one-page E4M3 kernel and two debug
orders of the packed tile (OPT 524288: INT4's serial order for every width; 1048576: page b's
QK product in its own accumulator). H200 only.

    python benchmarks/debug_packed.py
"""

from __future__ import annotations

import dataclasses
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
        packed = configs.gluon_e4m3_packed_config(bits, bits)
        variants = {
            "one-page": None,
            "packed": packed,
            "serial": dataclasses.replace(packed, opt=packed.opt | 524288),
            "split-qk": dataclasses.replace(packed, opt=packed.opt | 1048576),
        }
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
