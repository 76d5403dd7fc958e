"""Host time of a serving decode step's bookkeeping: ``PagedKV.begin_step`` by pool size, and the
kernel backends' coverage check, which ``decode_attention`` asks up to twice per layer.

``begin_step``: a decode step of ``--requests`` requests that each hold ``--context`` tokens in
engine blocks of 64 tokens, in pools of ``--blocks`` blocks (INT2, 2 layers: the bookkeeping does
not depend on the layers' bytes). The coverage check: ``supports`` of the ``gluon`` and
``triton`` backends for a 36-layer cache of Qwen3-8B's KV shape with two formats. Host work
only, so any machine measures it; on a GPU it is time the eager step spends before its first
kernel. From the repository root:

    python benchmarks/tools/serve_step_host.py [--blocks 2634 6168 65536] [--steps 100]

(2634 and 6168 blocks: INT2's pools at 8K and 32K in ``run_device.sh serve-qwen3``.)
"""

from __future__ import annotations

import argparse
import time

import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache, backends
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
        kv.cache.assume_appended(r, context)
    times, length = [], context
    for _ in range(steps):
        rows = [StepRow(r, length, 1, blocks[r][: -(-(length + 1) // BLOCK)])
                for r in range(requests)]
        start = time.perf_counter()
        kv.begin_step(rows)
        times.append(time.perf_counter() - start)
        kv.cache.record_replayed_step(kv.planned_step)  # the step's layers, as written
        length += 1
    return 1e3 * sorted(times)[len(times) // 2]


def coverage_us(name: str, calls: int = 2000) -> float:
    """Microseconds of one ``supports`` call of backend ``name`` (a 36-layer cache, INT2 and
    INT4-key layers alternating, 8 KV heads of 128, 32 query heads)."""
    int2 = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128), sink_tokens=64,
                    recent_tokens=256)
    int4_keys = KVFormat(QuantFormat(4, "token", 128), QuantFormat(2, "token", 128),
                         sink_tokens=64, recent_tokens=256)
    cache = QuantizedKVCache([int2, int4_keys] * 18, num_layers=36, num_kv_heads=8,
                             head_dim=128, num_pages=8, max_seqs=2)
    backend = backends.get(name)
    backend.supports(cache, 32)
    start = time.perf_counter()
    for _ in range(calls):
        backend.supports(cache, 32)
    return 1e6 * (time.perf_counter() - start) / calls


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
    print("a kernel backend's coverage check of a 36-layer cache, per call:")
    for name in ("gluon", "triton"):
        print(f"  {name}: {coverage_us(name):.2f} us")


if __name__ == "__main__":
    main()
