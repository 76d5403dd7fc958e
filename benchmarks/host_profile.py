"""Where the host time of one decode call goes (H200): cProfile over 300 eager calls of
``decode_attention(backend="gluon")`` at B=1, L=32K for token-wise K/V (two kernels per call)
and channel-wise V (three: the split kernel, the Triton window program, the merge), the GPU
kept busy so that no call waits for it. Prints the calls' mean host time and the top functions
by own time.

    python benchmarks/host_profile.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from foscar import decode_attention
from foscar.bench.grid import Shape, random_cache
from foscar.formats import KVFormat, QuantFormat


def main(calls=300):
    shape = Shape()
    for v_axis in ("token", "channel"):
        fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, v_axis, 128))
        cache, plan = random_cache(fmt, 1, 32768, shape, "cuda")
        q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for _ in range(5):
            decode_attention(q, cache, plan, backend="gluon", out=out)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU work ahead: the calls only enqueue
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            decode_attention(q, cache, plan, backend="gluon", out=out)
        prof.disable()
        host_us = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        print(
            f"=== KtV{v_axis[0]} INT2 B=1 L=32K: {host_us:.0f} us of host time per call (profiled)"
        )
        print("\n".join(s.getvalue().splitlines()[6:34]))


if __name__ == "__main__":
    main()
