"""The extend kernel (foscar.backends.extend) beside FlashInfer's BF16 paged prefill, at
Qwen3-8B's attention shape (32 query / 8 KV heads, head_dim 128), one process, one GPU:

    python benchmarks/tools/extend_bench.py --out DIR      # run_device.sh extend

1. correctness: the kernel against the torch path (the history dequantized in fp32, then SDPA)
   on a small chunk and history, per format (relative L2 error);
2. a launch-config sweep of the kernel at the first format, chunk and history;
3. one chunk (default 8192 tokens) on histories of 8K to 32K: the kernel with the best config of
   the sweep, FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` over BF16 pages holding the
   history and the chunk (causal, bottom-right), and the torch path it replaces (``--torch-path``
   histories only: it takes seconds); medians of CUDA-event times with the L2 flushed;
4. one prompt (default 32K tokens) in chunks (default 8K), one layer: per chunk its attention and
   its write into the cache (foscar: SDPA on the first chunk, as the serving core, then the kernel,
   each chunk quantized on write by ``QuantizedKVCache.append``; FlashInfer: its prefill on BF16
   pages the chunk is copied into), and the sum; times the model's layer count, the attention
   part of the prompt's time to first token (the rest of the model is the same for both);
5. (``--sections model``, a call of its own) the time to first token of that prompt through a
   random-weight Qwen3-8B (serve_random_model.py's preset): FoscarCache (the kernel on its extend
   path) beside the model's BF16 DynamicCache with SDPA attention.

Formats: ``int2`` and ``int4`` (the serving engine's: token-wise groups of 128, BF16 sink 64 and
recent 256 windows, foscar.serving.kv_spec.default_format) and ``kivi2``/``kivi4`` (channel-wise
K, token-wise V, groups of 128, the same windows). Writes ``extend_bench.json`` and
``extend_bench.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.backends.extend import ExtendConfig, attend_chunk, extend_attention, extend_config
from foscar.bench.grid import Shape, random_cache
from foscar.bench.timing import bench_stats
from foscar.serving.kv_spec import default_format

SHAPE = Shape(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64)
LAYERS = 36  # Qwen3-8B
SECTIONS = ("correctness", "sweep", "chunk", "prompt", "model")
DEFAULT_SECTIONS = ("correctness", "sweep", "chunk", "prompt")
#: the configs swept (each compiles for tens of seconds): query columns 16 to 128 at GQA 4; at
#: 32 columns and more 4 warps hit 255 registers (benchmarks/tools/extend_sass.py), so 8 warps too
SWEEP = [
    ExtendConfig(block_t=4, block_n=64),
    ExtendConfig(block_t=8, block_n=32),
    ExtendConfig(block_t=8, block_n=64),
    ExtendConfig(block_t=8, block_n=64, num_warps=8),
    ExtendConfig(block_t=16, block_n=64, num_warps=8),
    ExtendConfig(block_t=16, block_n=64, block_window=64, num_warps=8),
    ExtendConfig(block_t=32, block_n=64, num_warps=8),
]


def formats() -> dict[str, KVFormat]:
    int2, int4 = default_format(2, SHAPE.head_dim), default_format(4, SHAPE.head_dim)
    windows = dict(sink_tokens=int2.sink_tokens, recent_tokens=int2.recent_tokens)
    kivi2 = KVFormat(QuantFormat(2, "channel", 128), QuantFormat(2, "token", 128), **windows)
    kivi4 = KVFormat(QuantFormat(4, "channel", 128), QuantFormat(4, "token", 128), **windows)
    return {"int2": int2, "int4": int4, "kivi2": kivi2, "kivi4": kivi4}


def chunk_tensors(t: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=g)
    k = torch.randn(t, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", generator=g)
    v = torch.randn(t, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def timed(fn, iters: int) -> float:
    return float(bench_stats(fn, iters=iters, warmup=2, spin_us=0)["median_ms"])


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def sm_scale() -> float:
    return 1.0 / math.sqrt(SHAPE.head_dim)


# ---------------------------------------------------------------------------- FlashInfer
class FlashInferPrefill:
    """FlashInfer's BF16 paged prefill of one request: ``kv_len`` tokens on pages in order, the
    last ``t`` of them the chunk's (causal, bottom-right)."""

    def __init__(self, t: int, kv_len: int, seed: int = 1):
        import flashinfer

        self.version = flashinfer.__version__
        ps, h, d = SHAPE.page_size, SHAPE.num_kv_heads, SHAPE.head_dim
        pages = math.ceil(kv_len / ps)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.k_cache = torch.randn(pages, ps, h, d, device="cuda", generator=g).bfloat16()
        self.v_cache = torch.randn(pages, ps, h, d, device="cuda", generator=g).bfloat16()
        self.workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        i32 = dict(dtype=torch.int32, device="cuda")
        self.wrapper.plan(
            torch.tensor([0, t], **i32),
            torch.tensor([0, pages], **i32),
            torch.arange(pages, **i32),
            torch.tensor([kv_len - (pages - 1) * ps], **i32),
            SHAPE.num_q_heads,
            SHAPE.num_kv_heads,
            d,
            ps,
            causal=True,
            sm_scale=sm_scale(),
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )
        self.kv_len, self.t = kv_len, t

    def write(self, k, v) -> None:
        """The chunk's K/V copied into its slots (the last ``t`` positions)."""
        h, d = SHAPE.num_kv_heads, SHAPE.head_dim
        start = self.kv_len - self.t
        self.k_cache.view(-1, h, d)[start : self.kv_len] = k
        self.v_cache.view(-1, h, d)[start : self.kv_len] = v

    def run(self, q):
        return self.wrapper.run(q, (self.k_cache, self.v_cache))


# ---------------------------------------------------------------------------- measurements
def check_correctness(fmts: dict, t: int, history: int) -> dict:
    """The kernel against the torch path on one small case per format."""
    rows = {}
    for name, fmt in fmts.items():
        cache, batch = random_cache(fmt, 1, history, SHAPE, "cuda", seed=3)
        q, k, v = chunk_tensors(t, seed=4)
        o_kernel = extend_attention(q, k, v, cache, batch, 0, sm_scale(), path="triton")
        o_torch = extend_attention(q, k, v, cache, batch, 0, sm_scale(), path="torch")
        rows[name] = {"rel_l2_vs_torch": rel_l2(o_kernel, o_torch),
                      "finite": bool(torch.isfinite(o_kernel).all())}  # fmt: skip
        print(f"correctness {name} T={t} L={history}: {rows[name]}", flush=True)
    return rows


def sweep(fmt: KVFormat, t: int, history: int, iters: int) -> list[dict]:
    cache, batch = random_cache(fmt, 1, history, SHAPE, "cuda", seed=5)
    q, k, v = chunk_tensors(t)
    rows = []
    for cfg in SWEEP:
        row = {"config": cfg.__dict__.copy()}
        try:
            start = time.perf_counter()
            extend_attention(q, k, v, cache, batch, 0, sm_scale(), path="triton", config=cfg)
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - start
            row["ms"] = timed(
                lambda cfg=cfg: extend_attention(
                    q, k, v, cache, batch, 0, sm_scale(), path="triton", config=cfg
                ),
                iters,
            )
        except Exception as exc:  # a config that does not compile or run is a row, not a stop
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(f"sweep {row}", flush=True)
        rows.append(row)
    return rows


def one_chunk(fmts, cfg_for, t: int, histories, torch_histories, iters: int) -> list[dict]:
    rows = []
    q, k, v = chunk_tensors(t)
    for history in histories:
        fi = FlashInferPrefill(t, history + t)
        fi_ms = timed(lambda: fi.run(q), iters)
        row = {"chunk": t, "history": history, "flashinfer_bf16_ms": fi_ms, "formats": {}}
        del fi
        for name, fmt in fmts.items():
            cache, batch = random_cache(fmt, 1, history, SHAPE, "cuda", seed=6)
            cfg = cfg_for(fmt)
            ms = timed(
                lambda: extend_attention(
                    q, k, v, cache, batch, 0, sm_scale(), path="triton", config=cfg
                ),
                iters,
            )
            entry = {"foscar_ms": ms, "over_flashinfer": ms / fi_ms, "config": cfg.__dict__}
            if history in torch_histories:
                entry["torch_path_ms"] = timed(
                    lambda: attend_chunk(
                        cache, batch, 0, q.transpose(0, 1), k.transpose(0, 1),
                        v.transpose(0, 1), sm_scale(),
                    ),
                    2,
                )  # fmt: skip
            row["formats"][name] = entry
            del cache, batch
            torch.cuda.empty_cache()
            print(f"chunk T={t} L={history} {name}: {entry} (flashinfer {fi_ms:.3f} ms)",
                  flush=True)  # fmt: skip
        rows.append(row)
    return rows


def event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def prompt_foscar(fmt, cfg_for, prompt: int, chunk: int, repeats: int) -> dict:
    """Per chunk: attention and write of one layer, median over ``repeats`` prompts."""
    n_chunks = math.ceil(prompt / chunk)
    cache = QuantizedKVCache(
        fmt, num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim,
        num_pages=math.ceil(prompt / SHAPE.page_size) + 2, max_seqs=1,
        page_size=SHAPE.page_size, device="cuda", check_finite=False,
    )  # fmt: skip
    chunks = [chunk_tensors(min(chunk, prompt - c * chunk), seed=10 + c) for c in range(n_chunks)]
    cfg = cfg_for(fmt)
    times = []
    for _ in range(repeats + 1):  # the first prompt compiles
        seq = cache.add_sequence()
        per_chunk = []
        for c, (q, k, v) in enumerate(chunks):
            def attend(c=c, q=q, k=k, v=v):
                if c == 0:
                    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                    return torch.nn.functional.scaled_dot_product_attention(
                        qh, kh, vh, is_causal=True, scale=sm_scale(), enable_gqa=True
                    )
                batch = cache.plan([seq], 0)
                return extend_attention(q, k, v, cache, batch, 0, sm_scale(), config=cfg)

            attn = event_ms(attend)
            write = event_ms(lambda k=k, v=v: cache.append([seq], k, v, [k.shape[0]]))
            per_chunk.append({"attention_ms": attn, "write_ms": write})
        cache.free(seq)
        times.append(per_chunk)
    return _median_prompt(times[1:])


def prompt_flashinfer(prompt: int, chunk: int, repeats: int) -> dict:
    n_chunks = math.ceil(prompt / chunk)
    chunks = [chunk_tensors(min(chunk, prompt - c * chunk), seed=10 + c) for c in range(n_chunks)]
    prefills = [FlashInferPrefill(q.shape[0], c * chunk + q.shape[0]) for c, (q, _, _) in
                enumerate(chunks)]  # fmt: skip
    times = []
    for _ in range(repeats + 1):
        per_chunk = []
        for fi, (q, k, v) in zip(prefills, chunks):
            write = event_ms(lambda fi=fi, k=k, v=v: fi.write(k, v))
            attn = event_ms(lambda fi=fi, q=q: fi.run(q))
            per_chunk.append({"attention_ms": attn, "write_ms": write})
        times.append(per_chunk)
    return _median_prompt(times[1:])


def _median_prompt(runs: list[list[dict]]) -> dict:
    per_chunk = []
    for c in range(len(runs[0])):
        per_chunk.append({key: sorted(r[c][key] for r in runs)[len(runs) // 2]
                          for key in ("attention_ms", "write_ms")})  # fmt: skip
    total = sum(p["attention_ms"] + p["write_ms"] for p in per_chunk)
    return {"per_chunk": per_chunk, "layer_ms": total, "model_ms": total * LAYERS}


def model_ttft(fmts: dict, prompt: int, chunk: int, repeats: int) -> dict:
    """Time to first token of one prompt of random ids prefilled in chunks by a random-weight
    Qwen3-8B (benchmarks/tools/serve_random_model.py's preset, bf16): the model's BF16 cache
    (transformers' DynamicCache, SDPA attention) beside FoscarCache (its extend path: the
    kernel), median seconds over ``repeats`` after one untimed prompt."""
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_random_model import PRESETS, build_model
    from transformers import DynamicCache

    from foscar.integrations.transformers import FoscarCache, cache_kwarg, use_foscar_attention

    shape = PRESETS["qwen3-8b"]
    model, _ = build_model(shape, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (1, prompt), device="cuda", generator=g)

    @torch.no_grad()
    def seconds(make_cache) -> float:
        kw = {cache_kwarg(model): make_cache()}
        torch.cuda.synchronize()
        start = time.perf_counter()
        for pos in range(0, prompt, chunk):
            out = model(input_ids=ids[:, pos : pos + chunk], use_cache=True, logits_to_keep=1,
                        **kw)  # fmt: skip
        int(out.logits[0, -1].argmax())
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def median(make_cache) -> float:
        times = [seconds(make_cache) for _ in range(repeats + 1)][1:]
        return sorted(times)[len(times) // 2]

    def bf16_cache():
        try:
            return DynamicCache(config=model.config)
        except TypeError:
            return DynamicCache()

    rows = {}
    model.set_attn_implementation("sdpa")
    rows["bf16-sdpa"] = median(bf16_cache)
    print(f"model TTFT bf16-sdpa: {rows['bf16-sdpa']:.3f} s", flush=True)
    use_foscar_attention(model)
    for name, fmt in fmts.items():
        rows[f"foscar-{name}"] = median(
            lambda fmt=fmt: FoscarCache(fmt, model.config, max_cache_len=prompt + 1,
                                        page_size=SHAPE.page_size)  # fmt: skip
        )
        print(f"model TTFT foscar-{name}: {rows[f'foscar-{name}']:.3f} s", flush=True)
    del model
    torch.cuda.empty_cache()
    return {"seconds": rows, "layers": shape["layers"]}


# ---------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    lines = [
        "# Extend kernel beside FlashInfer's BF16 paged prefill",
        "",
        f"{result['gpu']}; torch {result['torch']}, triton {result['triton']}, flashinfer "
        f"{result['flashinfer']}. Qwen3-8B attention shape (32 / 8 heads, head_dim 128), pages of "
        f"{SHAPE.page_size}. Command: `{result['command']}`. Launch config of the kernel: "
        f"{result['best_config'] or 'extend_config default'}.",
    ]
    if "one_chunk" in result:
        names = result["formats"]
        lines += ["", "## One chunk (median ms, L2 flushed; foscar over FlashInfer in brackets)",
                  "", "| chunk | history | FlashInfer BF16 | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]  # fmt: skip
        for row in result["one_chunk"]:
            cells = []
            for name in names:
                e = row["formats"][name]
                cell = f"{e['foscar_ms']:.2f} ({e['over_flashinfer']:.2f}x)"
                if "torch_path_ms" in e:
                    cell += f"; torch path {e['torch_path_ms']:.1f}"
                cells.append(cell)
            lines.append(f"| {row['chunk']} | {row['history']} | {row['flashinfer_bf16_ms']:.2f} "
                         "| " + " | ".join(cells) + " |")  # fmt: skip
    if "prompt_runs" in result:
        lines += ["", f"## One prompt of {result['prompt']} tokens in chunks of "
                  f"{result['chunk']}, one layer", "", "| method | per chunk: attention + write "
                  f"(ms) | layer ms | x {LAYERS} layers ms |", "|---|---|---|---|"]  # fmt: skip
        for name, p in result["prompt_runs"].items():
            chunks = ", ".join(f"{c['attention_ms']:.1f}+{c['write_ms']:.1f}"
                               for c in p["per_chunk"])  # fmt: skip
            lines.append(f"| {name} | {chunks} | {p['layer_ms']:.1f} | {p['model_ms']:.0f} |")
    if "model_ttft" in result:
        lines += ["", f"## Time to first token, random-weight Qwen3-8B, {result['prompt']} tokens "
                  f"in chunks of {result['chunk']}", "", "| cache | seconds |", "|---|---|"]
        for name, sec in result["model_ttft"]["seconds"].items():
            lines.append(f"| {name} | {sec:.3f} |")
    if result.get("sweep"):
        lines += ["", "## Config sweep", "", "| config | ms | first call s |", "|---|---|---|"]
        for row in result["sweep"]:
            ms = f"{row['ms']:.3f}" if "ms" in row else row.get("error", "")
            lines.append(f"| {row['config']} | {ms} | {row.get('first_call_s', 0):.1f} |")
    if "correctness" in result:
        lines += ["", "## Correctness (kernel against the torch path)", ""]
        for name, r in result["correctness"].items():
            lines.append(f"- {name}: relative L2 {r['rel_l2_vs_torch']:.2e}, finite {r['finite']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder of the results")
    p.add_argument("--name", default="extend_bench", help="results file name (no suffix)")
    p.add_argument("--chunk", type=int, default=8192, help="chunk tokens (8192)")
    p.add_argument("--histories", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--torch-path", type=int, nargs="*", default=[8192],
                   help="histories at which the torch path is timed too (8192)")
    p.add_argument("--formats", nargs="+", default=["int2", "int4", "kivi2", "kivi4"],
                   choices=sorted(formats()))
    p.add_argument("--prompt", type=int, default=32768, help="prompt tokens (32768)")
    p.add_argument("--no-sweep", action="store_true", help="use extend_config's defaults")
    p.add_argument("--sections", nargs="+", default=list(DEFAULT_SECTIONS), choices=SECTIONS,
                   help="what to measure (default: " + " ".join(DEFAULT_SECTIONS) + "; model "
                   "builds a 16 GB random Qwen3-8B: run it in a call of its own)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--config", default=None, metavar="K=V,...",
                   help="the kernel's config instead of the sweep's best, e.g. "
                   "block_t=16,block_n=64,num_warps=8 (ExtendConfig fields)")
    args = p.parse_args(argv)
    forced = None
    if args.config:
        fields = {f.name: f.type for f in dataclasses.fields(ExtendConfig)}
        forced = {}
        for item in args.config.split(","):
            key, _, value = item.partition("=")
            ok = key in fields and (value.isdigit() or fields[key] == "bool")
            if not ok:
                p.error(f"--config: {item!r} is not FIELD=INT of ExtendConfig "
                        f"({', '.join(fields)})")  # fmt: skip
            forced[key] = value.lower() == "true" if fields[key] == "bool" else int(value)
        forced = ExtendConfig(**forced).__dict__.copy()
    if not torch.cuda.is_available():
        print("extend_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    fmts = {name: formats()[name] for name in args.formats}
    result = {
        "command": "python benchmarks/tools/extend_bench.py " + " ".join(argv or sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "formats": list(fmts),
        "chunk": args.chunk,
        "prompt": args.prompt,
    }
    try:
        import flashinfer

        result["flashinfer"] = flashinfer.__version__
    except ImportError:
        print("extend_bench: needs flashinfer (its wheel in .whl/)", file=sys.stderr)
        return 2
    if "correctness" in args.sections:
        result["correctness"] = check_correctness(fmts, 300, 2000)
    first = next(iter(fmts.values()))
    sweep_on = "sweep" in args.sections and not args.no_sweep
    result["sweep"] = sweep(first, args.chunk, args.histories[0], 3) if sweep_on else []
    timed_rows = [r for r in result["sweep"] if "ms" in r]
    best = min(timed_rows, key=lambda r: r["ms"])["config"] if timed_rows else None
    if forced is not None:
        best = forced

    def cfg_for(fmt):
        if best is None:
            return extend_config(fmt, SHAPE.head_dim, SHAPE.num_q_heads // SHAPE.num_kv_heads)
        return ExtendConfig(**best)

    result["best_config"] = best
    if "chunk" in args.sections:
        result["one_chunk"] = one_chunk(fmts, cfg_for, args.chunk, args.histories,
                                        args.torch_path, args.iters)  # fmt: skip
    if "prompt" in args.sections:
        result["prompt_runs"] = {"flashinfer-bf16": prompt_flashinfer(args.prompt, args.chunk, 2)}
        for name, fmt in fmts.items():
            try:
                result["prompt_runs"][f"foscar-{name}"] = prompt_foscar(
                    fmt, cfg_for, args.prompt, args.chunk, 2
                )
            except Exception:
                traceback.print_exc()
    if "model" in args.sections:
        result["model_ttft"] = model_ttft(fmts, args.prompt, args.chunk, 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
