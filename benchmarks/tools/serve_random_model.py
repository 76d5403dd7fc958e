"""``foscar.serving.bench`` on a random-weight model (no checkpoint needed on a GPU machine without
network): the engine's BF16 paged cache beside foscar's caches in the same KV memory, one process.

    python benchmarks/tools/serve_random_model.py --out DIR                  # run_device.sh serve
    python benchmarks/tools/serve_random_model.py --preset qwen3-8b --out DIR \\
        [--contexts 8192 32768] [--cuda-graphs off on]                 # run_device.sh serve-qwen3
    python benchmarks/tools/serve_random_model.py --preset qwen3-8b --decode-phase --out DIR \\
        --contexts 32768                                               # run_device.sh serve-decode
    python benchmarks/tools/serve_random_model.py --preset qwen3-8b --long-answers --out DIR \\
        --contexts 32768                                               # run_device.sh serve-trace
    python benchmarks/tools/serve_random_model.py --preset qwen3-8b --decode-phase --profile \\
        --out DIR                                                     # run_device.sh serve-profile
    python benchmarks/tools/serve_random_model.py --preset qwen3-8b --shared-prefix-tokens 4096 \\
        --out DIR                                                      # run_device.sh serve-prefix

Presets:

* ``llama-d128`` (default): Llama-3/Qwen3-8B's attention shape (32 query / 8 KV heads, head_dim
  128) and hidden size, 4 layers and a narrow MLP, so that a step's time is mostly attention and
  the engine; one trace of 24 requests at once, prompts 1024-3072 tokens. Writes
  ``serve_bench.{json,md,png}``.
* ``qwen3-8b``: Qwen3-8B's shapes (36 layers, hidden 4096, MLP 12288, 32 query / 8 KV heads,
  head_dim 128, vocabulary 151936; about 16 GB of bf16 weights). One trace per ``--contexts``
  value (prompts within 1/16 of the context, answers of ``--output-tokens``, all arriving at
  once), KV memory for ``--bf16-requests`` requests of the context in a BF16 cache
  (BF16 queues the rest; foscar's smaller tokens hold several times more), every method once per
  ``--cuda-graphs`` setting, after a warm-up that replays the trace untimed (``--warm-up``).
  Methods: ``flashinfer-bf16`` and ``flashinfer-fp8`` (FlashInfer's paged kernels over BF16 and
  FP8 pages, what vLLM and SGLang users run), ``sdpa-bf16`` (the engine's own cache and paged
  SDPA path; ``bf16`` is the same), ``int4``, ``int2`` and ``oscar``: OSCAR's
  per-layer recipe (INT4 keys in half the layers and INT4 values in a third, as the 15:10 row of
  ``eval_smollm2`` on SmolLM2's 30 layers, INT2 elsewhere; per-KV-head rotations, fitted clips
  and GPTQ keys) from a calibration file of random orthogonal rotations and GPTQ factors of
  random metrics: its speed is a calibrated file's, its tokens mean nothing. A method the engine
  refuses (e.g. CUDA graphs with a channel-wise format) is recorded as ``refused: <reason>``. Writes
  ``serve_qwen3_8b.{json,md,png}``; ``--merge`` folds in the runs of earlier results files
  (e.g. the other context, measured in another call).

  ``--long-answers``: the trace a long-context service sees instead: ``--requests`` (6) prompts
  within 1/16 of the context, answers of 512-1024 tokens, Poisson arrivals at ``--rate`` per
  second (seeded); writes ``serve_trace_qwen3_8b.*``.

  ``--decode-phase``: :mod:`foscar.serving.decode_bench` per context: every request prefilled
  first (untimed), then ``--steps`` timed decode steps after ``--warmup-steps``; step time
  (median, p99), tokens/s and the step's byte limit at the copy bandwidth measured in the
  process, for ``--comparisons same-memory`` (the KV memory of ``--bf16-requests`` BF16
  requests, as many requests as each cache holds, at most ``--max-batch``) and ``same-batch``
  (``--batch`` requests each). ``--profile``: a torch profile of the timed steps per row,
  summarized in ``profile_*.md`` (top kernels, host time). Writes
  ``serve_decode_qwen3_8b.{json,md,png}`` (with ``--profile``: ``serve_profile_qwen3_8b.*``).

``--shared-prefix-tokens N``: one trace of ``--requests`` (32) prompts that all start with the
same N-token system prompt, then ``--prompt-tokens`` (128-512) of their own, all arriving at
once, answers of ``--output-tokens``; each foscar method (``int4 int2``) runs once per
``--prefix-sharing`` setting (``off on``: ``build_manager``'s ``prefix_sharing``), in the default
KV memory (a quarter of the trace's tokens in BF16), graphs on. The results name the pages each
run held at its peak and the prompt tokens its requests adopted. Writes
``serve_prefix_qwen3_8b.{json,md,png}`` (``serve_prefix.*`` for llama-d128).

The tokens are meaningless; memory and timing are not. ``--device cpu`` with a tiny shape
(``--layers 2 --hidden 128 ...``) runs the same path on a CPU (the tests do).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from foscar.results import results_json
from foscar.serving import bench, decode_bench

PRESETS = {
    "llama-d128": dict(arch="llama", layers=4, hidden=4096, intermediate=2048, heads=32,
                       kv_heads=8, head_dim=128, vocab=32000, positions=8192),
    "qwen3-8b": dict(arch="qwen3", layers=36, hidden=4096, intermediate=12288, heads=32,
                     kv_heads=8, head_dim=128, vocab=151936, positions=40960),
}
#: the OSCAR recipe's share of INT4 layers (keys, values): the 15:10 row on SmolLM2's 30 layers
OSCAR_INT4_SHARE = (15 / 30, 10 / 30)
GRAPHS = {"off": False, "on": True, "auto": None}


def build_model(shape: dict, device: str, dtype: torch.dtype):
    """A random-weight causal LM of ``shape`` (Qwen3 when this transformers has it, else
    Llama), built on ``device`` in ``dtype`` (no fp32 copy on the host)."""
    import transformers

    kw = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
              intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
              num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
              head_dim=shape["head_dim"], max_position_embeddings=shape["positions"])
    qwen3 = shape["arch"] == "qwen3" and hasattr(transformers, "Qwen3ForCausalLM")
    if qwen3:
        cfg, cls = transformers.Qwen3Config(**kw), transformers.Qwen3ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval(), "qwen3" if qwen3 else "llama"


def int4_layers(num_layers: int, share: float) -> list[int]:
    """``round(share * num_layers)`` layers spread evenly over the stack."""
    n = round(share * num_layers)
    return sorted({math.floor(i * num_layers / n) for i in range(n)}) if n else []


def random_oscar_file(path: Path, *, num_layers: int, num_kv_heads: int, head_dim: int,
                      group_size: int, seed: int = 0) -> Path:
    """An OSCAR calibration file with the shipped recipe's layout and no calibration: random
    orthogonal per-KV-head rotations, GPTQ factors of random metrics, clip ratios of the size
    fitted ones have, INT4 keys in half the layers and INT4 values in a third (the 15:10 row
    scaled to ``num_layers``), INT2 elsewhere. Its speed is a calibrated file's."""
    from foscar.oscar import OscarRotations
    from foscar.quantize import gptq_factor

    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_kv_heads, head_dim, head_dim)

    def orthogonal():
        q, r = torch.linalg.qr(torch.randn(shape, generator=g, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)

    a = torch.randn(shape, generator=g, dtype=torch.float64)
    metric = a @ a.transpose(-1, -2) / head_dim
    k4, v4 = (int4_layers(num_layers, s) for s in OSCAR_INT4_SHARE)
    header = {
        "model": "random weights (no calibration: rotations, metrics and clips are random)",
        "recipe": f"INT4 keys in {len(k4)} of {num_layers} layers, INT4 values in {len(v4)}, "
        "INT2 elsewhere; per-KV-head rotations, GPTQ keys",
        "key_bits": [4 if i in k4 else 2 for i in range(num_layers)],
        "value_bits": [4 if i in v4 else 2 for i in range(num_layers)],
        "group_size": group_size,
        "windows": [64, 256],
    }
    clips = {(bits, role): torch.full((num_layers,), p, dtype=torch.float64)
             for (bits, role), p in {(2, "key"): 0.92, (2, "value"): 0.95, (4, "key"): 0.99,
                                     (4, "value"): 0.99}.items()}
    rot = OscarRotations(orthogonal(), orthogonal(), clips, header,
                         gptq_factor(metric).to(torch.float32))
    rot.save(path)
    return path


def set_markdown(results: dict) -> str:
    """Every run of a results set in one table, the conditions above it."""
    env = results["env"]
    lines = [
        f"# Serving benchmark: {results['model']}",
        "",
        f"Device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"foscar {env['foscar']}. Random weights: the tokens mean nothing, memory and timing "
        "do not depend on them. " + results.get("note", ""),
        "",
        "| context | CUDA graphs | KV cache | done | answer tok/s | all tok/s | TTFT median (ms) "
        "| TTFT p99 (ms) | TPOT median (ms) | TPOT p99 (ms) | peak requests | pool tokens "
        "| device peak (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = bench.cell
    for run in results["runs"]:
        graphs = {True: "on", False: "off", None: "auto"}[run["cuda_graphs"]]
        for m in run["methods"]:
            head = f"| {run['context']} | {graphs} | {m['kv']} |"
            if bench.not_measured(m):
                lines.append(head + f" {bench.not_measured(m)} |" + " |" * 9)
                continue
            peak = m.get("device_peak_bytes")
            lines.append(
                head + f" {m['completed']}/{m['requests']} | {f(m['output_tokens_per_s'])} "
                f"| {f(m['total_tokens_per_s'])} | {f(m['ttft_median_s'], 1e3, 0)} "
                f"| {f(m['ttft_p99_s'], 1e3, 0)} | {f(m['tpot_median_s'], 1e3, 1)} "
                f"| {f(m['tpot_p99_s'], 1e3, 1)} | {m['peak_concurrent_requests']} "
                f"| {m['pool']['max_tokens']} | {f(peak and peak / 2**30, 1, 2)} |"
            )
    methods = [m for run in results["runs"] for m in run["methods"]]
    kinds = {m["kv"]: m for m in methods if m.get("attention")}  # one per cache
    if kinds:
        lines += ["", bench.attention_line(list(kinds.values()))]
    lines += ["", "Traces (answers run to their length):", ""]
    seen = set()
    for run in results["runs"]:
        t = run["trace"]
        if run["context"] in seen:
            continue
        seen.add(run["context"])
        arrivals = (f"Poisson arrivals at {t['rate']}/s" if t["rate"] else "all at once")
        lines.append(
            f"- context {run['context']}: {t['num_requests']} requests ({arrivals}), prompts "
            f"{t['prompt_tokens'][0]}-{t['prompt_tokens'][1]} tokens, answers "
            f"{t['output_tokens'][0]}-{t['output_tokens'][1]} (seed {t['seed']}); KV memory "
            f"{run['memory_bytes'] / 1e9:.3f} GB for every method ({run['bf16_requests']} "
            "requests of the context in the engine's BF16 cache); at most "
            f"{run['max_seconds']:.0f} s per method (requests left then count as not done)."
            + (f" Warm-up of each method: {run['warm_up']}." if run.get("warm_up") else "")
        )
    lines += [
        "",
        "done: requests finished in the time, over which the rates and latencies count; "
        "TTFT: arrival to first answer token; TPOT: first to last answer token over the tokens "
        "between; peak requests: most requests holding KV blocks at once; device peak: "
        "torch's peak allocation during the method (weights included).",
    ]
    if results.get("command"):
        lines += ["", f"Command: `{results['command']}`"]
    return "\n".join(lines) + "\n"


def set_plot(results: dict, path: Path) -> bool:
    """One row of panels per context: answer tokens/s, TTFT and TPOT medians, peak concurrent
    requests; bars per KV cache, one per CUDA-graphs setting. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    contexts = sorted({r["context"] for r in results["runs"]})
    panels = [("answer tokens / s", "output_tokens_per_s", 1.0),
              ("TTFT median (ms)", "ttft_median_s", 1e3),
              ("TPOT median (ms)", "tpot_median_s", 1e3),
              ("peak concurrent requests", "peak_concurrent_requests", 1.0)]
    fig, axes = plt.subplots(len(contexts), 4, figsize=(17, 3.6 * len(contexts)), squeeze=False)
    for row, context in zip(axes, contexts):
        runs = [r for r in results["runs"] if r["context"] == context]
        names = list(dict.fromkeys(m["kv"] for r in runs for m in r["methods"]))
        width = 0.8 / len(runs)
        for ax, (title, key, scale) in zip(row, panels):
            for j, run in enumerate(runs):
                by_kv = {m["kv"]: m for m in run["methods"]}
                values = [
                    0.0 if n not in by_kv or bench.not_measured(by_kv[n])
                    else (by_kv[n][key] or 0) * scale
                    for n in names
                ]
                graphs = {True: "graphs on", False: "graphs off", None: "graphs auto"}
                offset = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(names))]
                ax.bar(offset, values, width, label=graphs[run["cuda_graphs"]])
            ax.set_title(f"{title}, context {context}", fontsize=9)
            ax.set_xticks(range(len(names)), names, rotation=20)
            if len(runs) > 1:
                ax.legend(fontsize=7)
    fig.suptitle(f"{results['model']} on {results['env']['device']} (no bar: refused)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def fold_earlier(runs: list[dict], run: dict) -> list[dict]:
    """``runs`` with ``run`` in: an earlier run of the same context and CUDA-graphs setting
    gives up its place, and its methods that ``run`` did not measure join ``run`` where both
    replayed the same trace in the same memory (so one call can measure some methods and a
    later one, with ``--merge``, the others); under another trace ``run`` replaces it."""
    key = (run["context"], run["cuda_graphs"])

    def settings(r):  # as JSON holds them: a fresh run's tuples equal a loaded run's lists
        return json.dumps([r.get(k) for k in ("trace", "memory_bytes", "max_seconds")],
                          sort_keys=True)

    kept = []
    for old in runs:
        if (old["context"], old["cuda_graphs"]) != key:
            kept.append(old)
        elif settings(old) == settings(run):
            measured = {m["kv"] for m in run["methods"]}
            run["methods"] = [m for m in old["methods"] if m["kv"] not in measured] + run[
                "methods"]
    return sorted([*kept, run], key=lambda r: (r["context"], str(r["cuda_graphs"])))


def write_set(results: dict, out: Path, name: str) -> None:
    (out / f"{name}.json").write_text(results_json(results))
    (out / f"{name}.md").write_text(set_markdown(results))
    set_plot(results, out / f"{name}.png")


METHODS = ["flashinfer-bf16", "flashinfer-fp8", "sdpa-bf16", "bf16", "int4", "int2", "oscar"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder of the results")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-d128",
                   help="model shape and defaults (llama-d128)")
    for flag, key in (("--layers", "layers"), ("--hidden", "hidden"),
                      ("--intermediate", "intermediate"), ("--heads", "heads"),
                      ("--kv-heads", "kv_heads"), ("--head-dim", "head_dim"), ("--vocab", "vocab"),
                      ("--positions", "positions")):
        p.add_argument(flag, type=int, default=None, dest=key, help="override the preset's")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="KV caches (llama-d128: bf16 int4 int2; qwen3-8b: flashinfer-bf16 "
                   "flashinfer-fp8 sdpa-bf16 int4 int2 oscar; --long-answers: flashinfer-bf16 "
                   "flashinfer-fp8 int2; --decode-phase: flashinfer-bf16 flashinfer-fp8 int4 "
                   "int2; --profile: sdpa-bf16 flashinfer-bf16 int2)")
    p.add_argument("--contexts", type=int, nargs="*", default=None,
                   help="qwen3-8b: one trace per context (8192 32768; --profile: 8192); none: "
                   "only --merge")
    p.add_argument("--requests", type=int, nargs="+", default=None,
                   help="requests per trace, one value or one per context (llama-d128: 24; "
                   "qwen3-8b: 32 at 8K, 6 at 32K; --long-answers: 6)")
    p.add_argument("--bf16-requests", type=int, nargs="+", default=None,
                   help="qwen3-8b: KV memory in requests of the context a BF16 cache "
                   "holds, one value or one per context (4 at 8K, 2 at 32K; --decode-phase: 8 "
                   "at 8K, 2 at 32K)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=None,
                   help="llama-d128 and --shared-prefix-tokens: prompt lengths, uniform in [MIN, "
                   "MAX] (1024 3072; after the system prompt: 128 512)")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                   help="one trace whose prompts all start with the same N-token system prompt, "
                   "all arriving at once, each foscar method once per --prefix-sharing setting")
    p.add_argument("--prefix-sharing", nargs="+", choices=("off", "on"), default=None,
                   help="--shared-prefix-tokens: build_manager's prefix_sharing per run of each "
                   "foscar method (off on)")
    p.add_argument("--output-tokens", type=int, nargs=2, default=None,
                   help="answer lengths, uniform in [MIN, MAX] (llama-d128: 32 64; qwen3-8b: "
                   "64 128; --long-answers: 512 1024)")
    p.add_argument("--cuda-graphs", nargs="+", choices=sorted(GRAPHS), default=None,
                   help="the engine's CUDA graphs, each method once per setting (llama-d128: "
                   "auto; qwen3-8b: off on; --long-answers and --decode-phase: on; --profile: "
                   "off on)")
    p.add_argument("--max-seconds", type=float, nargs="+", default=None,
                   help="per method and setting, one value or one per context (llama-d128: 60; "
                   "qwen3-8b: 75 at 8K, 120 at 32K; --long-answers, --decode-phase: 240; "
                   "--shared-prefix-tokens: 120)")
    p.add_argument("--warm-up", choices=sorted(bench.WARM_UPS), default=None,
                   help="before each method's timed replay (llama-d128: short; qwen3-8b: trace)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="the engine's tokens per forward (its default if not given)")
    p.add_argument("--long-answers", action="store_true",
                   help="qwen3-8b: the long-answer trace with Poisson arrivals")
    p.add_argument("--rate", type=float, default=0.25,
                   help="--long-answers: mean arrivals per second (0.25)")
    p.add_argument("--decode-phase", action="store_true",
                   help="qwen3-8b: the decode-phase benchmark instead of a trace")
    p.add_argument("--comparisons", nargs="+", choices=decode_bench.COMPARISONS, default=None,
                   help="--decode-phase: same-memory same-batch (--profile: same-batch)")
    p.add_argument("--batch", type=int, nargs="+", default=None,
                   help="--decode-phase same-batch: requests, one value or one per context (16 "
                   "at 8K, 4 at 32K)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="--decode-phase same-memory: at most this many requests (64)")
    p.add_argument("--steps", type=int, default=32, help="--decode-phase: timed steps (32)")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="--decode-phase: untimed full-batch steps before them (8)")
    p.add_argument("--profile", action="store_true",
                   help="--decode-phase: a torch profile of each row's timed steps, summarized "
                   "in profile_*.md under --out")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (64)")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="qwen3-8b: results files of earlier calls: their runs join the set, "
                   "and a run of a context and graphs setting this call measures again keeps the "
                   "methods this call does not measure (same trace and memory)")
    p.add_argument("--name", default=None,
                   help="result file stem (serve_bench; qwen3-8b: serve_qwen3_8b, "
                   "serve_trace_qwen3_8b, serve_decode_qwen3_8b or serve_profile_qwen3_8b)")
    a = p.parse_args(argv)
    _defaults(p, a)
    return a


def _defaults(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The preset's and the mode's defaults, and the checks between arguments."""
    qwen = a.preset == "qwen3-8b"
    if a.profile:
        a.decode_phase = True
    if (a.long_answers or a.decode_phase) and not qwen:
        p.error("--long-answers and --decode-phase belong to --preset qwen3-8b")
    if a.long_answers and a.decode_phase:
        p.error("give --long-answers or --decode-phase, not both")
    if a.shared_prefix_tokens < 0:
        p.error(f"--shared-prefix-tokens must be >= 0, got {a.shared_prefix_tokens}")
    if a.shared_prefix_tokens and (a.long_answers or a.decode_phase or a.contexts or a.merge):
        p.error("--shared-prefix-tokens is a trace of its own: no --long-answers, "
                "--decode-phase, --contexts or --merge")
    if a.prefix_sharing and not a.shared_prefix_tokens:
        p.error("--prefix-sharing belongs to --shared-prefix-tokens")
    mode = ("prefix" if a.shared_prefix_tokens else "profile" if a.profile else
            "decode" if a.decode_phase else "trace" if a.long_answers else
            "qwen" if qwen else "llama")
    a.prefix_sharing = a.prefix_sharing or ["off", "on"]
    a.prompt_tokens = a.prompt_tokens or ([128, 512] if mode == "prefix" else [1024, 3072])
    a.shape = {**PRESETS[a.preset],
               **{k: getattr(a, k) for k in PRESETS[a.preset] if getattr(a, k, None) is not None}}
    a.methods = a.methods or {
        "llama": ["bf16", "int4", "int2"],
        "qwen": ["flashinfer-bf16", "flashinfer-fp8", "sdpa-bf16", "int4", "int2", "oscar"],
        "trace": ["flashinfer-bf16", "flashinfer-fp8", "int2"],
        "decode": ["flashinfer-bf16", "flashinfer-fp8", "int4", "int2"],
        "profile": ["sdpa-bf16", "flashinfer-bf16", "int2"],
        "prefix": ["int4", "int2"],
    }[mode]
    a.output_tokens = a.output_tokens or ([512, 1024] if mode == "trace" else
                                          [64, 128] if qwen else [32, 64])
    a.cuda_graphs = a.cuda_graphs or {"llama": ["auto"], "qwen": ["off", "on"], "trace": ["on"],
                                      "decode": ["on"], "profile": ["off", "on"],
                                      "prefix": ["on"] if qwen else ["auto"]}[mode]
    a.warm_up = a.warm_up or ("trace" if qwen else "short")
    a.comparisons = a.comparisons or (["same-batch"] if mode == "profile"
                                      else list(decode_bench.COMPARISONS))
    a.mode = mode
    a.name = a.name or {"llama": "serve_bench", "qwen": "serve_qwen3_8b",
                        "trace": "serve_trace_qwen3_8b", "decode": "serve_decode_qwen3_8b",
                        "profile": "serve_profile_qwen3_8b",
                        "prefix": "serve_prefix_qwen3_8b" if qwen else "serve_prefix"}[mode]
    if mode == "prefix":
        a.contexts = None
    elif not qwen:
        for flag in ("contexts", "bf16_requests", "merge"):
            if getattr(a, flag):
                p.error(f"--{flag.replace('_', '-')} belongs to --preset qwen3-8b")
        a.contexts = None
    elif a.contexts is None:
        a.contexts = [8192] if mode == "profile" else [8192, 32768]
    if a.merge and mode == "trace":
        p.error("--merge belongs to the all-at-once traces and --decode-phase")
    n = len(a.contexts or [None])

    def per_context(name, values, default):
        if values is None:
            return [default(c) for c in (a.contexts or [None])]
        if len(values) not in (1, n):
            p.error(f"--{name} takes one value or one per context ({n}), got {values}")
        return values * n if len(values) == 1 else values

    def small(c):
        return c is None or c <= 8192

    # 32K: the engine's BF16 cache takes about 25 s per pair of requests on an H100
    a.requests = per_context("requests", a.requests, lambda c: (
        32 if mode == "prefix" else 24) if c is None else (
        6 if mode == "trace" else 32 if small(c) else 6))
    a.bf16_requests = per_context("bf16-requests", a.bf16_requests, lambda c: (
        8 if small(c) else 2) if mode in ("decode", "profile") else (4 if small(c) else 2))
    a.batch = per_context("batch", a.batch, lambda c: 16 if small(c) else 4)
    a.max_seconds = per_context("max-seconds", a.max_seconds, lambda c: (
        120.0 if mode == "prefix" else 60.0) if c is None else (
        240.0 if mode in ("trace", "decode", "profile") else 75.0 if small(c) else 120.0))
    for name in ("requests", "bf16_requests", "batch"):
        if any(v < 1 for v in getattr(a, name)):
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("steps", "max_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup_steps < 0 or not a.rate > 0:
        p.error("--warmup-steps must be >= 0 and --rate > 0")
    if any(c < 2 * a.output_tokens[1] for c in a.contexts or []):
        p.error(f"--contexts must be at least twice the longest answer, got {a.contexts}")
    if qwen and a.contexts and max(a.contexts) > a.shape["positions"]:
        p.error(f"--contexts {max(a.contexts)} exceeds the model's {a.shape['positions']} "
                "positions (--positions)")


def _kvs(a, scratch: str) -> list:
    """``build_manager``'s kv of each method (OSCAR: a random calibration file in ``scratch``)."""
    s, kvs = a.shape, []
    for method in a.methods:
        if method == "oscar":
            kvs.append(str(random_oscar_file(Path(scratch) / "random.safetensors",
                                             num_layers=s["layers"], num_kv_heads=s["kv_heads"],
                                             head_dim=s["head_dim"],
                                             group_size=min(s["head_dim"], 128))))
        else:
            kvs.append(method)
    return kvs


def main(argv=None) -> None:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    if a.decode_phase and a.merge and not a.contexts:  # the rows of per-context processes
        sets = [json.loads(Path(path).read_text()) for path in a.merge]
        results = {**sets[0], "rows": [r for found in sets for r in found["rows"]],
                   "commands": [found.get("command") for found in sets]}
        write_decode_set(results, out, a.name)
        log(f"wrote {out / a.name}.json, .md, .png ({len(sets)} sets merged)")
        return
    merged = []
    for path in a.merge:
        for run in json.loads(Path(path).read_text()).get("runs", []):
            merged = fold_earlier(merged, run)
    if a.preset == "qwen3-8b" and not a.contexts and a.mode != "prefix":
        if not merged:
            sys.exit("serve_random_model.py: no --contexts and nothing to --merge")
        earlier = json.loads(Path(a.merge[0]).read_text())
        results = {**earlier, "runs": merged}
        write_set(results, out, a.name)
        log(f"wrote {out / a.name}.json, .md, .png ({len(merged)} runs merged)")
        return
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    model, arch = build_model(a.shape, a.device, dtype)
    s = a.shape
    model_name = (f"random-{arch}-{s['layers']}L-h{s['hidden']}-{s['heads']}q{s['kv_heads']}kv-"
                  f"d{s['head_dim']}")
    params = sum(p.numel() for p in model.parameters())
    log(f"built {model_name}: {params / 1e9:.2f} B parameters in {dtype}, "
        f"{time.perf_counter() - start:.0f} s")
    kvs = _kvs(a, tempfile.mkdtemp(prefix="foscar-oscar-"))  # not under --out: results only
    if a.contexts is None:  # the single-trace layout of serve_bench.*
        spec = bench.TraceSpec(num_requests=a.requests[0], rate=0.0,
                               prompt_tokens=tuple(a.prompt_tokens),
                               output_tokens=tuple(a.output_tokens), seed=0,
                               shared_prefix_tokens=a.shared_prefix_tokens)
        sharing = tuple(dict.fromkeys(v == "on" for v in a.prefix_sharing))
        for graphs in a.cuda_graphs:
            bench.run_benchmark(model, kvs, spec, out=out, model_name=model_name,
                                max_seconds=a.max_seconds[0], cuda_graphs=GRAPHS[graphs],
                                block_size=a.block_size, name=a.name, warm_up=a.warm_up,
                                max_batch_tokens=a.max_batch_tokens,
                                prefix_sharing=sharing if a.shared_prefix_tokens else (False,),
                                log=log)
        return
    results = {
        "model": model_name,
        "env": bench.run_environment(model),
        "note": "The oscar method's calibration file is random (orthogonal per-KV-head "
        "rotations, GPTQ factors of random metrics, fixed clips; INT4 keys in half the layers, "
        "INT4 values in a third, as the 15:10 row of eval_smollm2): its speed is a calibrated "
        "file's, its accuracy means nothing." if "oscar" in a.methods else "",
        "command": " ".join(["python", *sys.argv]),
        "runs": list(merged),
    }
    if a.decode_phase:
        decode_set(model, kvs, a, results, out, log, start)
    else:
        trace_set(model, kvs, a, results, out, log, start)
    log(f"wrote {out / a.name}.json, .md, .png in {time.perf_counter() - start:.0f} s")


def trace_set(model, kvs, a, results: dict, out: Path, log, start: float) -> None:
    """One trace per context (all at once, or ``--long-answers``), every method once per CUDA
    graphs setting, in ``results["runs"]``, written after each."""
    s = a.shape
    bf16_per_token = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * model.dtype.itemsize
    for i, context in enumerate(a.contexts):
        hi = context - a.output_tokens[1]
        spec = bench.TraceSpec(num_requests=a.requests[i],
                               rate=a.rate if a.long_answers else 0.0,
                               prompt_tokens=(min(context - context // 16, hi), hi),
                               output_tokens=tuple(a.output_tokens), seed=0)
        memory = a.bf16_requests[i] * context * bf16_per_token
        for graphs in a.cuda_graphs:
            log(f"context {context}, CUDA graphs {graphs}: {spec.num_requests} requests, KV "
                f"memory {memory / 1e9:.2f} GB ({a.bf16_requests[i]} BF16 requests), at most "
                f"{a.max_seconds[i]:.0f} s per method ({time.perf_counter() - start:.0f} s so far)")
            run = bench.run_benchmark(model, kvs, spec, out=None, model_name=results["model"],
                                      memory_bytes=memory, max_seconds=a.max_seconds[i],
                                      cuda_graphs=GRAPHS[graphs], request_tokens=context,
                                      block_size=a.block_size, warm_up=a.warm_up,
                                      max_batch_tokens=a.max_batch_tokens, log=log)
            run.update(context=context, bf16_requests=a.bf16_requests[i],
                       max_seconds=a.max_seconds[i])
            del run["env"]
            results["runs"] = fold_earlier(results["runs"], run)
            write_set(results, out, a.name)


def decode_set(model, kvs, a, results: dict, out: Path, log, start: float) -> None:
    """The decode-phase benchmark per context, every row in ``results["rows"]``, written after
    each row (a call cut at its time limit keeps the rows it measured)."""
    s = a.shape
    bf16_per_token = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * model.dtype.itemsize
    results.update(rows=[], decode={"steps": a.steps, "warmup_steps": a.warmup_steps,
                                    "max_batch": a.max_batch})
    del results["runs"]
    for i, context in enumerate(a.contexts):
        memory = a.bf16_requests[i] * context * bf16_per_token
        log(f"context {context}: same-memory {memory / 1e9:.2f} GB ({a.bf16_requests[i]} BF16 "
            f"requests), same-batch {a.batch[i]} ({time.perf_counter() - start:.0f} s so far)")

        def write_row(row, memory=memory, i=i):
            row.update(memory_bytes=memory if row["comparison"] == "same-memory" else None,
                       bf16_requests=a.bf16_requests[i])
            results["rows"].append(row)
            if "copy_bandwidth" in row:  # a measured row (a refused one has neither)
                results.update(copy_bandwidth=row["copy_bandwidth"],
                               weight_bytes=row["weight_bytes"])
            if "copy_bandwidth" in results:
                write_decode_set(results, out, a.name)

        found = decode_bench.run_decode_benchmark(
            model, kvs, context=context, comparisons=a.comparisons, memory_bytes=memory,
            batch=a.batch[i], max_batch=a.max_batch, steps=a.steps, warmup_steps=a.warmup_steps,
            block_size=a.block_size, cuda_graphs=[GRAPHS[g] for g in a.cuda_graphs],
            max_batch_tokens=a.max_batch_tokens, max_seconds=a.max_seconds[i],
            profile_dir=out if a.profile else None, log=log, on_row=write_row)
        results.update(copy_bandwidth=found["copy_bandwidth"], weight_bytes=found["weight_bytes"])
        write_decode_set(results, out, a.name)


def decode_markdown(results: dict) -> str:
    """The decode-phase rows in one table, the conditions above it."""
    env = results["env"]
    d = results["decode"]
    lines = [
        f"# Decode phase: {results['model']}",
        "",
        f"Device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"foscar {env['foscar']}. Random weights: the tokens mean nothing, memory and timing "
        "do not depend on them. " + results.get("note", ""),
        "",
        f"Every request prefilled first (untimed); then {d['warmup_steps']} untimed decode steps "
        f"of the whole batch (the engine's CUDA graph of that batch is captured, the kernels "
        f"compiled), then {d['steps']} timed steps: the interval between the starts of "
        "consecutive steps (the engine's whole step). Byte limit: (weight bytes "
        f"{results['weight_bytes'] / 1e9:.2f} GB + the KV bytes the step reads) / the copy "
        f"bandwidth measured in the process, {results['copy_bandwidth'] / 1e12:.2f} TB/s. "
        "same-memory: the KV memory of the BF16 requests named below, as many requests as each "
        f"cache holds (at most {d['max_batch']}); same-batch: the same requests for every cache.",
        "",
        *decode_bench.markdown_rows(results["rows"]),
        "",
    ]
    contexts = sorted({r["context"] for r in results["rows"]})
    for c in contexts:
        row = next(r for r in results["rows"] if r["context"] == c)
        lines.append(f"- context {c}: same-memory KV of {row['bf16_requests']} BF16 requests of "
                     f"the context.")
    attention = {r["kv"]: r["attention"] for r in results["rows"] if r.get("attention")}
    if attention:
        lines += ["", "Attention: " + "; ".join(f"{k}: {v}" for k, v in attention.items()) + "."]
    profiles = [r["profile"] for r in results["rows"] if r.get("profile")]
    if profiles:
        lines += ["", "Profiles of the timed steps: " + ", ".join(profiles) + "."]
    commands = results.get("commands") or [results.get("command")]
    lines += [""] + [f"Command: `{c}`" for c in commands if c]
    return "\n".join(lines) + "\n"


def decode_plot(results: dict, path: Path) -> bool:
    """Tokens/s and step time against the byte limit, per context and comparison. False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results["rows"] if not bench.not_measured(r)]
    groups = sorted({(r["context"], r["comparison"]) for r in rows})
    if not groups:
        return False
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.4 * len(groups)), squeeze=False)
    for (context, comparison), (left, right) in zip(groups, axes):
        mine = [r for r in rows if r["context"] == context and r["comparison"] == comparison]
        names = [f"{r['kv']}\n(B={r['batch']}, graphs {r['cuda_graphs']})" for r in mine]
        x = range(len(mine))
        left.bar(x, [r["tokens_per_s"] for r in mine])
        left.set_title(f"tokens/s, context {context}, {comparison}", fontsize=9)
        right.bar([i - 0.2 for i in x], [r["step_median_s"] * 1e3 for r in mine], 0.4,
                  label="step median")
        right.bar([i + 0.2 for i in x], [r["byte_limit_s"] * 1e3 for r in mine], 0.4,
                  label="byte limit")
        right.set_title(f"step time (ms), context {context}, {comparison}", fontsize=9)
        right.legend(fontsize=7)
        for ax in (left, right):
            ax.set_xticks(list(x), names, fontsize=7)
    fig.suptitle(f"{results['model']} on {results['env']['device']}: decode phase")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_decode_set(results: dict, out: Path, name: str) -> None:
    (out / f"{name}.json").write_text(results_json(results))
    (out / f"{name}.md").write_text(decode_markdown(results))
    decode_plot(results, out / f"{name}.png")


if __name__ == "__main__":
    main()
