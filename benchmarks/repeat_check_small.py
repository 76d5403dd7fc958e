"""Are the Gluon kernel's outputs repeatable for the case whose bit-identity check failed in
session 9 (``s9-first``, at 5ba572b: INT2 K / INT4 V both channel-wise, one-page tiles, 3
splits)? Decodes that case (and its neighbours: two-page tiles, token-wise V) 8 times each into
a NaN-poisoned workspace and prints the largest difference between calls (0 when repeatable).

    python benchmarks/repeat_check_small.py
    compute-sanitizer --tool racecheck python benchmarks/repeat_check_small.py --racecheck
    python benchmarks/repeat_check_small.py --ablations   # the failing case, kernel OPT ablations
"""

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kernel_cases import build_cache, queries  # noqa: E402

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402
from foscar.configs import gluon_decode_config  # noqa: E402

LENGTHS = (1, 17, 63, 64, 65, 263, 4099, 9001)  # tests/test_gluon_kernel.py LENGTHS + 9001


CASES = [
    ("channel", "channel", 1),
    ("channel", "channel", 2),
    ("channel", "token", 1),
    ("token", "channel", 1),
]


#: kernel OPT bits that change the one-page KcVc tile (NOTES 19): 32768 = channel-wise V's sum of
#: P' in registers instead of the ones @ P' wgmma, 65536 = the stage released at the tile's end,
#: 131072 = a fence and a barrier at the tile's end
ABLATIONS = {
    "base": 0,
    "sum-in-registers": 32768,
    "release-last": 65536,
    "oversync": 131072,
    "all three": 32768 | 65536 | 131072,
}


def main(calls=8, cases=CASES, split_counts=(1, 3, 33), ablations=None):
    for k_axis, v_axis, tile_pages in cases:
        for name, bits in (ablations or {"": 0}).items():
            check(calls, k_axis, v_axis, tile_pages, split_counts, name, bits)


def check(calls, k_axis, v_axis, tile_pages, split_counts, name="", bits=0):
    fmt = KVFormat(QuantFormat(2, k_axis, 128), QuantFormat(4, v_axis, 128))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda", seed=3)
    q = queries(batch, 8, 128, "cuda")
    cfg = gluon_decode_config(k_axis, tile_pages=tile_pages)
    cfg = dataclasses.replace(cfg, opt=cfg.opt | bits)
    for splits in split_counts:
        outs = []
        for _ in range(calls):
            gluon_backend.decode(q, cache, batch, 128**-0.5, splits=splits, config=cfg)
            for o_part, lse_part in batch._workspaces.values():
                o_part.fill_(math.nan)
                lse_part.fill_(math.nan)
            outs.append(
                gluon_backend.decode(q, cache, batch, 128**-0.5, splits=splits, config=cfg)
                .float()
                .clone()
            )
        diff = max(float((o - outs[0]).abs().max()) for o in outs)
        rows = sorted(
            {i for o in outs for i in (o != outs[0]).any(-1).any(-1).nonzero()[:, 0].tolist()}
        )
        print(
            f"{name + ': ' if name else ''}K {k_axis} V {v_axis} tile_pages {tile_pages} "
            f"splits {splits} "
            f"({cfg.ctas_per_sm} CTA/SM): max diff between calls {diff:.3e}, rows {rows}",
            flush=True,
        )
    del cache, batch
    torch.cuda.empty_cache()


if __name__ == "__main__":
    if "--racecheck" in sys.argv:  # the failing case only, 2 calls (under compute-sanitizer)
        main(calls=2, cases=CASES[:1], split_counts=(1,))
    elif "--ablations" in sys.argv:  # the failing case under each ablation
        main(calls=10, cases=CASES[:1], split_counts=(1, 3), ablations=ABLATIONS)
    else:
        main()
