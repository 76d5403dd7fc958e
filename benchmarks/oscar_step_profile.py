"""Where an OSCAR decode step's extra time goes (H200): ``foscar bench --e2e``'s Qwen3-8B-shaped
model at 32K-token synthetic prompts, ``foscar-int2`` against ``foscar-oscar-int2`` (the same
format with OSCAR's rotations, clips and GPTQ keys, ``foscar.bench.e2e.synthetic_oscar``).

For each method and batch: the mean wall time of 30 decode steps (after 8 warm-up steps), then
cProfile over 10 more, printing the functions with the most own time and the cumulative time of
foscar's functions, so the difference between the two methods can be read function by function.

    python benchmarks/oscar_step_profile.py [--batches 1 32]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
    args = ap.parse_args()
    model = e2e.build_model(torch.device("cuda"))
    for batch in args.batches:
        for method in ("foscar-int2", "foscar-oscar-int2"):
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


if __name__ == "__main__":
    main()
