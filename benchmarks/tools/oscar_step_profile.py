"""Where an OSCAR decode step's time goes on a GPU: ``foscar bench --e2e``'s Qwen3-8B-shaped model
(random weights) over 32K-token synthetic prompts, ``foscar-int2`` against ``foscar-oscar-int2``
(the same format with OSCAR's rotations, clips and GPTQ keys) or any other e2e methods.

Default: for each method and batch, the mean wall time of 30 decode steps (after 8 warm-up
steps), then cProfile over 10 more, printing the functions with the most own time and the
cumulative time of foscar's functions, so two methods compare function by function.

    python benchmarks/tools/oscar_step_profile.py [--batches 1 32]

``--reps N`` times instead of profiling: every method's cache is built first, then ``N``
rounds each run ``--steps`` decode steps of every method in turn, so slow drifts of the host's
speed (eager transformers is host-bound here) fall on every method alike;
prints each round's ms per step and the medians.

    python benchmarks/tools/oscar_step_profile.py --reps 7 --batches 1 16 \
        --methods foscar-int2 foscar-oscar-int2 foscar-oscar-folded-int2

``--gpu-time`` sums the GPU's kernel time per step under ``torch.profiler`` instead: the host
drops out, leaving the work a CUDA-graph decode (as serving engines run it) pays. Prints each
method's kernel milliseconds and launches per step and its kernels with the most time.

    python benchmarks/tools/oscar_step_profile.py --gpu-time --batches 1 16 32 \
        --methods foscar-int2 foscar-int4 foscar-oscar-int2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from foscar.bench import e2e
from foscar.integrations.transformers import cache_kwarg


@torch.no_grad()
def steps(model, cache, batch, context, n, start):
    kw = cache_kwarg(model)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=model.device)
    for step in range(n):
        pos = torch.full((batch, 1), context + start + step, device=model.device)
        out = model(
            input_ids=tokens, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache}
        )
        tokens = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--methods", nargs="+", default=["foscar-int2", "foscar-oscar-int2"])
    ap.add_argument("--reps", type=int, default=0, help="interleaved timing rounds (0: profile)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per method and round")
    ap.add_argument("--gpu-time", action="store_true", help="kernel time per step (profiler)")
    args = ap.parse_args()
    model = e2e.build_model(torch.device("cuda"))
    model.set_attn_implementation("foscar")
    if args.gpu_time:
        for batch in args.batches:
            gpu_time(model, args.methods, batch, args.context, args.steps)
        return
    if args.reps:
        for batch in args.batches:
            interleaved(model, args.methods, batch, args.context, args.reps, args.steps)
        return
    for batch in args.batches:
        for method in args.methods:
            model.set_attn_implementation("foscar")
            cache = e2e.make_cache(method, model, batch, args.context, 64, seed=0)
            steps(model, cache, batch, args.context, 8, 0)
            t0 = time.perf_counter()
            steps(model, cache, batch, args.context, 30, 8)
            ms = (time.perf_counter() - t0) / 30 * 1e3
            prof = cProfile.Profile()
            prof.enable()
            steps(model, cache, batch, args.context, 10, 38)
            prof.disable()
            print(f"\n## {method}, B={batch}: {ms:.1f} ms per step (mean of 30)")
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s).sort_stats("tottime")
            st.print_stats(18)
            print("\n".join(s.getvalue().splitlines()[-26:]))
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s).sort_stats("cumulative")
            st.print_stats("foscar", 22)
            print("\n".join(s.getvalue().splitlines()[-28:]))
            del cache
            torch.cuda.empty_cache()


def interleaved(model, methods, batch, context, reps, n):
    caches = {m: e2e.make_cache(m, model, batch, context, 8 + reps * n, seed=0) for m in methods}
    for cache in caches.values():
        steps(model, cache, batch, context, 8, 0)
    times = {m: [] for m in methods}
    for r in range(reps):
        for m in methods:
            t0 = time.perf_counter()
            steps(model, caches[m], batch, context, n, 8 + r * n)
            times[m].append((time.perf_counter() - t0) / n * 1e3)
    print(f"\n## B={batch}, {context} tokens: ms per step, {reps} rounds x {n} steps, interleaved")
    for m in methods:
        rounds = " ".join(f"{t:.1f}" for t in times[m])
        print(f"{m:28s} median {statistics.median(times[m]):6.1f}   rounds: {rounds}")
    del caches
    torch.cuda.empty_cache()


def gpu_time(model, methods, batch, context, n, top=8):
    """Per method: GPU kernel ms and kernel launches per decode step over ``n`` steps, and the
    ``top`` kernels by total time (ms per step, launches per step)."""
    from torch.profiler import ProfilerActivity, profile

    print(f"\n## B={batch}, {context} tokens: GPU kernel time per step over {n} steps")
    for m in methods:
        cache = e2e.make_cache(m, model, batch, context, 8 + n, seed=0)
        steps(model, cache, batch, context, 8, 0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(model, cache, batch, context, n, 8)
        kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in kernels) / n / 1e3
        launches = sum(e.count for e in kernels) / n
        print(f"{m:28s} {total:7.2f} ms  {launches:6.0f} kernels per step")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
            ms = e.self_device_time_total / n / 1e3
            print(f"    {ms:7.3f} ms  {e.count / n:5.0f}x  {e.key[:90]}")
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
