"""GPU time of the fused decode-step cache write (``foscar.kernels.cache_write``) per launch, for
the work OSCAR adds to a layer's write: plain INT2, per-token clipping (K and V), clipping with
GPTQ keys. Session 14's ``oscar_step_profile.py --gpu-time`` found the clipped GPTQ write at ~70
us per launch against < 5 us plain, ~5 ms of a 36-layer decode step's GPU time at any batch.

Shapes of ``foscar bench --e2e`` (Qwen3-8B: 8 KV heads, head_dim 128, INT2 token-wise g128,
BF16 sink 64 / recent 256): ``--batch`` sequences past their windows, so every step demotes a
token per sequence and role. Each variant runs ``--steps`` decode steps through
``QuantizedKVCache.append`` under ``torch.profiler``; the kernel's mean GPU time per launch is
printed (K and V launches together), once with a warm L2 and once with a 256 MiB buffer written
between steps (a real step streams the weights and the cache through L2 between two layers'
writes).

    python benchmarks/write_kernel_bench.py [--batch 1 32] [--kernel-file OLD.py --label old]
        [--num-warps 1]

``--kernel-file`` times another version of ``foscar/kernels/cache_write.py`` (e.g.
``git show REV:foscar/kernels/cache_write.py``) through the same launcher; launcher arguments
that version does not take are dropped.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.backends import triton as triton_backend
from foscar.quantize import gptq_factor

HEADS, HEAD_DIM, GROUP, SINK, RECENT, PAGE = 8, 128, 128, 64, 256, 64
VARIANTS = ("plain", "clip", "clip+gptq")


class _Kernels:
    """A cache_write module whose ``decode_write_kernel[grid](**kw)`` keeps the kwargs that
    version takes (``--kernel-file``) and can override the launcher's ``num_warps``."""

    def __init__(self, module, num_warps=None):
        self.module, self.num_warps = module, num_warps
        self.names = set(module.decode_write_kernel.arg_names)
        self.names |= {"num_warps", "enable_fp_fusion"}

    def __getattr__(self, name):
        return getattr(self.module, name)

    @property
    def decode_write_kernel(self):
        outer = self

        class _Grid:
            def __getitem__(self, grid):
                launch = outer.module.decode_write_kernel[grid]

                def run(**kw):
                    kw = {k: v for k, v in kw.items() if k in outer.names}
                    if outer.num_warps:
                        kw["num_warps"] = outer.num_warps
                    return launch(**kw)

                return run

        return _Grid()


def _use_kernels(path: str | None, num_warps: int | None) -> None:
    if path:
        spec = importlib.util.spec_from_file_location("cache_write_under_test", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = triton_backend._cache_write()
    triton_backend._cache_write = lambda: _Kernels(module, num_warps)


def _cache(variant: str, batch: int, steps: int, device) -> tuple[QuantizedKVCache, list]:
    clip = variant != "plain"
    f = QuantFormat(2, "token", GROUP)
    fmt = KVFormat(f, f, sink_tokens=SINK, recent_tokens=RECENT)
    prompt = SINK + RECENT + 77
    pages = batch * (-(-(prompt + steps + 8) // PAGE))
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        num_pages=pages,
        max_seqs=batch,
        page_size=PAGE,
        device=device,
        check_finite=False,
        decode_write="fused",
    )
    gen = torch.Generator().manual_seed(0)
    if clip:
        metric = torch.randn(HEADS, HEAD_DIM, HEAD_DIM, generator=gen, dtype=torch.float64)
        metric = metric @ metric.transpose(-1, -2) / HEAD_DIM + torch.eye(HEAD_DIM)
        gptq = gptq_factor(metric).to(torch.float32) if variant == "clip+gptq" else None
        cache.set_transform(0, key_clip=0.85, value_clip=0.92, key_gptq=gptq)
    ids = [cache.add_sequence() for _ in range(batch)]
    x = torch.randn(batch * prompt, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    cache.append(ids, x, x, [prompt] * batch)
    return cache, ids


def time_variant(variant: str, batch: int, steps: int, flush: bool) -> float:
    """Mean GPU microseconds per decode_write_kernel launch."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    cache, ids = _cache(variant, batch, steps + 4, device)
    new = torch.randn(4 + steps, batch, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    buf = torch.empty(256 << 20, dtype=torch.uint8, device=device) if flush else None
    for i in range(4):
        cache.append(ids, new[i], new[i])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(4, 4 + steps):
            if flush:
                buf.zero_()
            cache.append(ids, new[i], new[i])
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.key.startswith("decode_write_kernel")]
    if not ev or ev[0].count != 2 * steps:
        raise RuntimeError(f"expected {2 * steps} write launches, profiled {ev}")
    return ev[0].self_device_time_total / ev[0].count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kernel-file", help="another cache_write.py to time instead")
    ap.add_argument("--num-warps", type=int, help="instead of the launcher's")
    ap.add_argument("--label", default="this tree")
    args = ap.parse_args()
    _use_kernels(args.kernel_file, args.num_warps)
    warps = f", num_warps={args.num_warps}" if args.num_warps else ""
    print(f"## decode_write_kernel ({args.label}{warps}): GPU us per launch, mean of K and V")
    print(f"{'variant':12s} {'batch':>5s} {'warm L2':>9s} {'flushed':>9s}")
    for batch in args.batch:
        for variant in VARIANTS:
            warm = time_variant(variant, batch, args.steps, flush=False)
            cold = time_variant(variant, batch, args.steps, flush=True)
            print(f"{variant:12s} {batch:5d} {warm:9.1f} {cold:9.1f}", flush=True)


if __name__ == "__main__":
    main()
