"""One Gluon decode call with an explicit launch config, for compute-sanitizer (racecheck,
memcheck) on the H200: the configs the GPU test suite does not launch (channel-wise K at 2
CTAs per SM, whose outputs changed from call to call: benchmarks/NOTES.md 15).

    compute-sanitizer --tool racecheck python benchmarks/sanitize_gluon.py \\
        --k-axis channel --tile-pages 1 --ctas 2 --tokens 32768
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kernel_cases import build_cache, queries, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402
from foscar.configs import gluon_decode_config  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--k-axis", default="channel")
ap.add_argument("--v-axis", default="token")
ap.add_argument("--bits", type=int, default=2)
ap.add_argument("--tile-pages", type=int, default=1)
ap.add_argument("--ctas", type=int, choices=[1, 2], default=2, help="CTAs per SM of the config")
ap.add_argument("--tokens", type=int, default=32768)
ap.add_argument("--calls", type=int, default=1)
args = ap.parse_args()

cfg = gluon_decode_config(args.k_axis, args.tile_pages)
if args.ctas != cfg.ctas_per_sm:  # the registers and limits of the other axis's config
    other = gluon_decode_config("token" if args.ctas == 2 else "channel", args.tile_pages)
    limits = ("maxnreg", "ctas_per_sm", "consumer_regs", "producer_regs")
    cfg = dataclasses.replace(cfg, **{f: getattr(other, f) for f in limits})
fmt = KVFormat(QuantFormat(args.bits, args.k_axis, 128), QuantFormat(args.bits, args.v_axis, 128))
cache, batch = build_cache(fmt, (args.tokens,), num_kv_heads=8, device="cuda", seed=2)
q = queries(batch, 32, 128, "cuda")
sm = 128**-0.5
ref, _ = attend_dequantized(q.double(), cache, batch, sm)
for _ in range(args.calls):
    o = gluon_backend.decode(q, cache, batch, sm, config=cfg)
    print(f"{cfg}: rel L2 {rel_l2(o[0], ref[0]):.2e}", flush=True)
