"""Host time of one serving decode step's page bookkeeping (``PagedKV.begin_step``), by pool size.

A decode step of ``--requests`` requests that each hold ``--context`` tokens in engine blocks of
64 tokens, in pools of ``--blocks`` blocks (INT2, 2 layers: the bookkeeping does not depend on
the layers' bytes). Host work only, so any machine measures it; on a GPU it is time the eager
step spends before its first kernel. From the repository root:

    python benchmarks/tools/serve_step_host.py [--blocks 2634 6168 65536] [--steps 100]

(2634 and 6168 blocks: INT2's pools at 8K and 32K in ``run_device.sh serve-qwen3``.)
"""

from __future__ import annotations

import argparse
import time

import torch

from foscar.serving import PagedKV, StepRow
from foscar.serving.kv_spec import default_format

BLOCK = 64


def begin_step_ms(num_blocks: int, requests: int, context: int, steps: int) -> float:
    """Median milliseconds of ``begin_step`` over ``steps`` decode steps."""
    fmt = default_format(2, 64)
    kv = PagedKV(fmt, num_layers=2, num_kv_heads=1, head_dim=64, num_blocks=num_blocks,
                 block_size=BLOCK, max_requests=requests)
    per_request = -(-(context + steps + 1) // BLOCK)
    if per_request * requests > num_blocks:
        raise SystemExit(f"--blocks {num_blocks}: {requests} requests of {context} tokens need "
                         f"{per_request * requests}")
    blocks = {r: tuple(range(r * per_request, (r + 1) * per_request)) for r in range(requests)}
    # the requests' history, as a prefill would leave it (marked, not written)
    kv.begin_step([StepRow(r, 0, context, blocks[r][: -(-context // BLOCK)])
                   for r in range(requests)])
    for r in range(requests):
        kv.cache._assume_appended(r, context)
    times, length = [], context
    for _ in range(steps):
        rows = [StepRow(r, length, 1, blocks[r][: -(-(length + 1) // BLOCK)])
                for r in range(requests)]
        start = time.perf_counter()
        kv.begin_step(rows)
        times.append(time.perf_counter() - start)
        kv.cache.record_replayed_step(kv._step.planned)  # the step's layers, as written
        length += 1
    return 1e3 * sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[2634, 6168, 65536])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=100)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"begin_step of a decode step, {a.requests} requests of {a.context} tokens "
          f"(median of {a.steps}):")
    for n in a.blocks:
        print(f"  {n:6d} blocks: {begin_step_ms(n, a.requests, a.context, a.steps):.3f} ms")


if __name__ == "__main__":
    main()
