"""Host time of one eager decode call: how long a held ``foscar.DecodePlan``'s ``run`` takes to
return (the GPU kernels run behind it; at these sizes they take less than the host's work),
with the plan's launches bound (Note [bound launches] in foscar.triton_runtime: every call
after the second replays) and unbound (the plan's bindings dropped before each call: triton's
JIT every time).
GPU only. From the repository root:

    python benchmarks/tools/host_time.py [--backends gluon triton auto] [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from foscar import DecodePlan, KVFormat, QuantFormat
from foscar.bench.grid import Shape, random_cache
from foscar.results import results_json

INT2 = QuantFormat(2, "token", 128)
FORMATS = {
    "int2": KVFormat(INT2, INT2),
    "int2-kivi": KVFormat(QuantFormat(2, "channel", 128), INT2),
}


def host_us(q, cache, batch, backend: str, calls: int, bound: bool) -> float:
    """Median microseconds for a DecodePlan's run to return, over ``calls`` calls."""
    plan = DecodePlan(cache, batch, num_q_heads=q.shape[1], backend=backend)
    times = []
    for i in range(calls + 10):
        if not bound:
            plan.backend_plan.bound.clear()
        if i % 50 == 0:
            torch.cuda.synchronize()  # keep the queue short, outside the timed calls
        t0 = time.perf_counter()
        plan.run(q)
        t1 = time.perf_counter()
        if i >= 10:  # the first calls compile and record
            times.append((t1 - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["gluon", "triton", "auto"])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.formats:
        for b in args.batch:
            cache, batch = random_cache(FORMATS[name], b, args.length, Shape(), "cuda")
            q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
            for backend in args.backends:
                unbound = host_us(q, cache, batch, backend, args.calls, False)
                bound = host_us(q, cache, batch, backend, args.calls, True)
                row = {"format": name, "batch": b, "length": args.length, "backend": backend,
                       "unbound_us": round(unbound, 1), "bound_us": round(bound, 1)}
                rows.append(row)
                print(f"{name:10s} B={b:<3d} L={args.length} {backend:7s} host per call: "
                      f"unbound {unbound:7.1f} us, bound {bound:7.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(results_json({"gpu": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
