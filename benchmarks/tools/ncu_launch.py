"""Five decode calls of one backend at one grid point, for profiling under ncu (no timing).

    python benchmarks/tools/ncu_launch.py BATCH TOKENS BACKEND [K_AXIS V_AXIS] [--bits 2]

Token-wise INT2 K and V unless told otherwise, g = 128, 32 query heads over 8 KV heads,
head_dim 128, page 64 (the shape of ``foscar bench``). Under ncu, skip the first launches so
that compilation and first touch stay out of the profile, e.g. the source page that
``ncu_stalls.py`` reads:

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:gluon_decode \\
        --section SourceCounters --section WarpStateStats -o prof \\
        python benchmarks/tools/ncu_launch.py 64 16384 gluon
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
"""

from __future__ import annotations

import argparse

import torch

from foscar import KVFormat, QuantFormat, decode_attention
from foscar.bench.grid import Shape, random_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch", type=int, help="sequences")
    ap.add_argument("tokens", type=int, help="tokens per sequence")
    ap.add_argument("backend", help="a decode_attention backend: gluon, gluon-e4m3, triton, ...")
    ap.add_argument("k_axis", nargs="?", default="token", choices=["token", "channel"])
    ap.add_argument("v_axis", nargs="?", default="token", choices=["token", "channel"])
    ap.add_argument("--bits", type=int, default=2, choices=[2, 4], help="K and V bit width")
    ap.add_argument("--calls", type=int, default=5, help="decode calls (default 5)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    fmt = KVFormat(
        QuantFormat(args.bits, args.k_axis, 128), QuantFormat(args.bits, args.v_axis, 128)
    )
    cache, plan = random_cache(fmt, args.batch, args.tokens, Shape(), "cuda")
    q = torch.randn(args.batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for _ in range(args.calls):
        decode_attention(q, cache, plan, backend=args.backend, out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
