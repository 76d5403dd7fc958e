"""Bisect the H200 illegal memory access of INT4 token-wise K with 4+ groups per row.

    python benchmarks/diagnose_int4_groups.py            # every variant, one process each
    python benchmarks/diagnose_int4_groups.py VARIANT    # one variant in this process

The backend refuses this class on the GPU (`foscar/backends/triton.py`, `supports`); this
script calls the kernel launcher directly. A CUDA fault poisons the process, so each variant
runs in its own subprocess and reports ok / error (relative L2 against fp64) / crash.
"""

import math
import os
import subprocess
import sys

import torch

sys.path.insert(0, "tests")
from kernel_cases import build_cache, queries, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.backends import triton as tb  # noqa: E402
from foscar.configs import TritonDecodeConfig as C  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402

DEVICE = os.environ.get("FOSCAR_DIAG_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1

# name: (K bits, K group, V bits, V group, config or None for the default, lengths)
VARIANTS = {
    "K4g32-V2g128": (4, 32, 2, 128, None, (1, 17, 113, 263)),
    "K4g32-V2g128-len1": (4, 32, 2, 128, None, (1,)),
    "K4g32-V2g128-len64": (4, 32, 2, 128, None, (64,)),
    "K4g32-V2g128-len263": (4, 32, 2, 128, None, (263,)),
    "K4g32-V4g128": (4, 32, 4, 128, None, (1, 17, 113, 263)),
    "K4g64-V2g128": (4, 64, 2, 128, None, (1, 17, 113, 263)),
    "K2g32-V2g128": (2, 32, 2, 128, None, (1, 17, 113, 263)),
    "K4g32-V2g128-bn32": (4, 32, 2, 128, C(block_n=32, num_stages=1), (1, 17, 113, 263)),
    "K4g32-V2g128-bn64s1": (4, 32, 2, 128, C(block_n=64, num_stages=1), (1, 17, 113, 263)),
    "K4g32-V2g128-bn128": (4, 32, 2, 128, C(block_n=128, num_stages=1), (1, 17, 113, 263)),
    "K4g32-V2g128-w8": (4, 32, 2, 128, C(block_n=64, num_warps=8, num_stages=1), (1, 263)),
}


def run_one(name: str) -> None:
    kb, kg, vb, vg, cfg, lengths = VARIANTS[name]
    fmt = KVFormat(QuantFormat(kb, "token", kg), QuantFormat(vb, "token", vg))
    cache, batch = build_cache(fmt, lengths, device=DEVICE, seed=0)
    q = queries(batch, 8, 128, DEVICE)
    out = torch.full_like(q, math.nan)
    tb.decode(q, cache, batch, 1 / math.sqrt(128), out=out, config=cfg)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    ref, _ = attend_dequantized(q, cache, batch)
    print(f"{name}: ok, rel L2 {rel_l2(out, ref):.2e}", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        run_one(sys.argv[1])
        return
    for name in VARIANTS:
        r = subprocess.run(
            [sys.executable, __file__, name], capture_output=True, text=True, timeout=300
        )
        if r.returncode == 0:
            print(r.stdout.strip(), flush=True)
        else:
            tail = (r.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{name}: CRASH rc={r.returncode}: {tail[:300]}", flush=True)


if __name__ == "__main__":
    main()
