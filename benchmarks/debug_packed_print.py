"""device_print of the packed-heads tile's per-column values (kernel debug bit 4194304) for one
one-token sequence: H = 1 INT2, then H = 4 INT4. H200 only."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kernel_cases import build_cache, queries  # noqa: E402

from foscar import KVFormat, QuantFormat, configs  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402

for bits, ratio in ((2, 1), (4, 4)):
    fmt = KVFormat(QuantFormat(bits, "token", 128), QuantFormat(bits, "token", 128))
    cfg = configs.gluon_e4m3_packed_config(bits, bits)
    cfg = dataclasses.replace(cfg, opt=cfg.opt | 4194304)
    cache, batch = build_cache(fmt, (1,), num_kv_heads=1, device="cuda", seed=1, decode_steps=0)
    q = queries(batch, ratio, 128, "cuda")
    print(f"=== INT{bits} H={ratio} q amax per head", q.float().abs().amax(-1).tolist(), flush=True)
    one = configs.gluon_decode_config("token")
    one = dataclasses.replace(one, opt=one.opt | 4194304)
    for name, c in (("packed", cfg), ("one-page", one)):
        out = torch.full_like(q, math.nan)
        gluon_backend.decode(
            q, cache, batch, 128**-0.5, out=out, config=c, operands="e4m3", splits=1
        )
        torch.cuda.synchronize()
        print(f"=== {name} out finite per head", torch.isfinite(out).all(-1).tolist(), flush=True)
