"""Device probes of the Gluon kernel (H200): split-count rules, and single launches for ncu.

    python benchmarks/gluon_probe.py splits          # split counts around the rule, timed
    python benchmarks/gluon_probe.py launch B L BACKEND [K_AXIS V_AXIS]  # 5 calls, for ncu

`bash benchmarks/h200_run.sh gluon-probe` runs both, the second under ncu (stall reasons,
issue-slot use, achieved occupancy) for the Gluon and Triton kernels; results in $OUT.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from foscar import KVFormat, QuantFormat, decode_attention
from foscar.backends import gluon as gb
from foscar.bench.grid import Shape, foscar_kv_bytes, random_cache
from foscar.bench.timing import L2Flusher, bench_stats


def _setup(batch, tokens, k_axis="token", v_axis="token", bits=2):
    fmt = KVFormat(QuantFormat(bits, k_axis, 128), QuantFormat(bits, v_axis, 128))
    cache, plan = random_cache(fmt, batch, tokens, Shape(), "cuda")
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    return fmt, cache, plan, q


def splits(out_dir):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flusher = L2Flusher()
    cfg = gb.gluon_decode_config()
    rows = []
    for batch, tokens in ((1, 32768), (1, 131072), (8, 32768), (8, 131072)):
        fmt, cache, plan, q = _setup(batch, tokens)
        out = torch.empty_like(q)
        rule = gb.num_splits(batch, 8, tokens, cfg, sms)
        floor = max(1, (cfg.ctas_per_sm * sms) // (batch * 8))
        for s in sorted({rule, floor, rule * 2, max(1, rule // 2)}):

            def step(s=s, q=q, cache=cache, plan=plan, out=out):
                return gb.decode(q, cache, plan, 1 / math.sqrt(128), out=out, splits=s)

            step()
            us = bench_stats(step, iters=30, warmup=5, flusher=flusher)["median_ms"] * 1e3
            nbytes = foscar_kv_bytes(fmt, batch, tokens, Shape())
            rows.append(dict(batch=batch, tokens=tokens, splits=s, rule=rule, us=us))
            print(
                f"B={batch} L={tokens} splits={s:3d} (rule {rule}, floor {floor}) "
                f"{us:8.1f} us {nbytes / us / 1e6:.2f} TB/s",
                flush=True,
            )
        cache = plan = q = out = step = None
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gluon_splits.json"), "w") as f:
        json.dump(rows, f, indent=1)


def launch(batch, tokens, backend, k_axis="token", v_axis="token"):
    _, cache, plan, q = _setup(int(batch), int(tokens), k_axis, v_axis)
    out = torch.empty_like(q)
    for _ in range(5):
        decode_attention(q, cache, plan, backend=backend, out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1] == "splits":
        splits(os.environ.get("OUT", "/tmp/out"))
    else:
        launch(*sys.argv[2:])
