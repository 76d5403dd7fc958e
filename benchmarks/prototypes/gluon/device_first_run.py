"""Proposed FIRST device run of the Gluon prototype (H200). Not run yet: written on a CPU machine.

From a checkout that has foscar (repository root on PYTHONPATH) and this directory next to it:

    python device_first_run.py --part smoke        # ~1 min: does it launch, is it right at all
    python device_first_run.py --part correct      # ~3 min: ragged lengths x splits x configs
    python device_first_run.py --part time         # ~6 min: grid-lite points, configs, ablations
    compute-sanitizer --tool racecheck  python device_first_run.py --part smoke
    compute-sanitizer --tool synccheck  python device_first_run.py --part smoke

Everything goes to $OUT (default /tmp/out) as .log/.json. What each part checks is in its
docstring; REPORT.md (section "First device script") says what to look at first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
for p in ("/work/main", os.path.join(HERE, "..", "main"), os.getcwd()):
    if os.path.isdir(os.path.join(p, "foscar")):
        sys.path.insert(0, p)
        sys.path.insert(0, os.path.join(p, "tests"))
        break

import torch  # noqa: E402

import foscar_gluon_proto as G  # noqa: E402
from foscar import KVFormat, QuantFormat  # noqa: E402

FMT = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
OUT = os.environ.get("OUT", "/tmp/out")

# launch configurations: (name, kwargs of G.decode, resident CTAs per SM it is meant for)
CONFIGS = {
    "1cta_spc2": (dict(opt=5, spc=2, consumer_regs=232, producer_regs=40), 1),
    "1cta_spc4": (dict(opt=5, spc=4, consumer_regs=232, producer_regs=40), 1),
    "2cta_spc2": (dict(opt=5, spc=2, consumer_regs=112, producer_regs=24, maxnreg=80), 2),
    "2cta_spc4": (dict(opt=5, spc=4, consumer_regs=112, producer_regs=24, maxnreg=80), 2),
    "1cta_opt0": (dict(opt=0, spc=2, consumer_regs=232, producer_regs=40), 1),  # generic max, fdiv
}


def log(f, *a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    f.write(s + "\n")
    f.flush()


def splits_for(batch, hkv, tokens, ctas_per_sm, sms):
    tiles = math.ceil(tokens / 64)
    wanted = math.ceil(ctas_per_sm * sms / (batch * hkv))
    return max(1, min(wanted, max(1, tiles // 2), tiles))


def part_smoke(f):
    """One small launch per config: finite, close to fp64 over the dequantized cache, and equal
    to the CPU emulation of the same algorithm (emulate_split_kernel) to ~1e-5 (only the fp32
    summation order of the tensor core differs). A NaN here with a finite emulation points at
    synchronisation (ring phases, merge barrier) rather than at the math."""
    from kernel_cases import build_cache, check_against_reference, queries

    cache, batch = build_cache(FMT, [1000, 130], num_kv_heads=2, device="cuda")
    q = queries(batch, 8, 128, "cuda")
    for name, (kw, _) in CONFIGS.items():
        for ns in (1, 3):
            t0 = time.time()
            o, lse = G.decode(q, cache, batch, ns, return_lse=True, **kw)
            torch.cuda.synchronize()
            err, bar = check_against_reference(o, lse, q, cache, batch)
            oe, _ = G.emulate_split_kernel(q.cpu(), cache, batch, ns)
            emu = float((o.float().cpu() - torch.from_numpy(oe)).norm() / torch.from_numpy(oe).norm())
            log(f, f"smoke {name} splits={ns}: rel L2 vs fp64 {err:.2e} (bar {bar:.2e}), "
                   f"vs CPU emulation {emu:.1e}, first call {time.time() - t0:.1f}s")


def part_correct(f):
    """Ragged batches with lengths around page multiples (partial last page, exact multiples,
    1-token sequences, empty splits), several split counts (1 .. more splits than tiles), NaN-
    NaN-poisoned split workspaces,
    shuffled pages, and agreement with foscar's Triton backend."""
    from kernel_cases import build_cache, check_against_reference, queries

    import foscar

    cases = [[1, 2, 63, 64, 65], [4095, 4096, 4097], [32768 + 17], [700] * 8]
    for lengths in cases:
        cache, batch = build_cache(FMT, lengths, num_kv_heads=2, device="cuda", seed=len(lengths))
        q = queries(batch, 8, 128, "cuda")
        ref_triton = foscar.decode_attention(q, cache, batch, backend="triton")
        for name, (kw, _) in CONFIGS.items():
            for ns in (1, 2, 5, 64):
                try:
                    o, lse = G.decode(q, cache, batch, ns, return_lse=True, poison=True, **kw)
                    torch.cuda.synchronize()
                    err, bar = check_against_reference(o, lse, q, cache, batch)
                    dt = float((o.float() - ref_triton.float()).norm() / ref_triton.float().norm())
                    log(f, f"ok   {name} lengths={lengths[:5]}.. splits={ns}: err {err:.2e} "
                           f"(bar {bar:.2e}), vs triton backend {dt:.1e}")
                except AssertionError as e:
                    log(f, f"FAIL {name} lengths={lengths[:5]}.. splits={ns}: {e}")


def part_time(f, iters=20):
    """Median of `iters` cold-L2 calls (foscar.bench.timing) at the grid-lite points that
    bracket the regimes (few CTAs / many tokens, many CTAs): every config with the split count
    for its CTAs/SM, foscar-triton and FlashInfer BF16 (if importable) in the same process,
    and the two ablations: memory-only (OPT|32: the TMA ring streams, consumers do no math)
    and compute-only (OPT|64: consumers recompute stale stages, no HBM traffic). Bytes are the
    stored codes and scales (80 B per token and KV head)."""
    from foscar.bench import baselines
    from foscar.bench.grid import Shape, foscar_kv_bytes, random_cache
    from foscar.bench.timing import L2Flusher, bench_stats

    import foscar

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flusher = L2Flusher()
    shape = Shape()
    rows = []
    for bsz, L in ((1, 32768), (1, 131072), (8, 32768), (8, 131072), (64, 16384), (64, 131072)):
        cache, batch = random_cache(FMT, bsz, L, shape, "cuda")
        q = torch.randn(bsz, 32, 128, device="cuda", dtype=torch.bfloat16)
        nbytes = foscar_kv_bytes(FMT, bsz, L, shape)

        def record(method, fn):
            fn()
            torch.cuda.synchronize()
            st = bench_stats(fn, iters=iters, warmup=3, flusher=flusher)
            us = st["median_ms"] * 1e3
            row = dict(method=method, B=bsz, L=L, us=us, tbps=nbytes / us / 1e6)
            rows.append(row)
            log(f, f"B={bsz:3d} L={L:7d} {method:28s} {us:9.1f} us  {row['tbps']:.2f} TB/s "
                   f"({100 * row['tbps'] / 4.8:.0f}% of 4.8)")

        for name, (kw, cps) in CONFIGS.items():
            ns = splits_for(bsz, 8, L, cps, sms)
            for label, opt in ((name, kw["opt"]), (name + "+memonly", kw["opt"] | 32),
                               (name + "+computeonly", kw["opt"] | 64)):
                if label != name and name not in ("1cta_spc2", "2cta_spc2"):
                    continue
                k2 = dict(kw, opt=opt)
                record(f"gluon-{label}-s{ns}", lambda k2=k2, ns=ns: G.decode(q, cache, batch, ns, **k2))
        record("foscar-triton", lambda: foscar.decode_attention(q, cache, batch, backend="triton"))
        try:
            step, _ = baselines.make_flashinfer_bf16(bsz, L)
            record("flashinfer-bf16", step)
            step.close()
        except Exception as e:  # not installed, or out of memory at the large points
            log(f, f"flashinfer-bf16 skipped: {type(e).__name__}: {e}")
        cache = batch = q = None  # free the pools before the next point
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(OUT, "gluon_time.json"), "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["smoke", "correct", "time", "all"], default="smoke")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"gluon_{a.part}.log"), "w") as f:
        log(f, torch.cuda.get_device_name(0), "torch", torch.__version__)
        for name, (kw, _) in CONFIGS.items():  # registers and spills as compiled for this GPU
            ck = G.compile_proto(HS=8, SPC=kw["spc"], consumer_regs=kw["consumer_regs"],
                                 producer_regs=kw["producer_regs"], maxnreg=kw.get("maxnreg"),
                                 opt=kw["opt"])
            log(f, name, G.sass_report(ck, name).splitlines()[0])
        if a.part in ("smoke", "all"):
            part_smoke(f)
        if a.part in ("correct", "all"):
            part_correct(f)
        if a.part in ("time", "all"):
            part_time(f)


if __name__ == "__main__":
    main()
