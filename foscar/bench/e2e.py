"""``foscar bench --e2e``: end-to-end decode throughput of a Qwen3-8B-shaped model on one GPU.

The model has Qwen3-8B's shapes (36 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128,
MLP 12288, vocabulary 151936) and random weights in BF16, built from a config (no weights can be
fetched on the GPU machine). Each point decodes ``--e2e-new-tokens`` tokens (after a few
untimed warm-up steps) for ``B`` users whose prompts are ``L`` tokens long, through
transformers' ``generate``-style loop (one ``forward`` per step, greedy argmax), and reports:

* time per output token (TPOT), tokens/s per user (``1 / TPOT``) and aggregate (``B / TPOT``);
* peak GPU memory (``torch.cuda.max_memory_allocated``) and the KV cache's own bytes;
* per method and context, the largest batch whose KV cache fits a fixed budget
  (``--e2e-kv-budget-gib``, computed from each method's bytes per token).

Synthetic prompts: decode cost does not depend on the cached values, so the prompts' K/V are
written straight into the caches instead of running a 100K-token prefill per user: random BF16
K/V for transformers' caches; foscar's pages are taken as an append would take them and filled
with random codes, scales and offsets (``FoscarCache.assume_prompt``). The results say so.

Methods: ``bf16`` (transformers' ``DynamicCache`` with SDPA, the baseline), ``foscar-int4`` and
``foscar-int2`` (token-wise K and V, groups of 128, OSCAR's BF16 windows of 64 sink + 256 recent
tokens; ``FoscarCache`` and the Triton decode kernel), ``foscar-oscar-int2`` (``foscar-int2``
with OSCAR's decode-time work: a rotation per layer and KV head of K and Q, another of V and the
output, per-layer clips and GPTQ-rounded keys in each step's write; random rotations and
factors, :func:`synthetic_oscar`, since decode cost does not depend on their values),
``foscar-oscar-folded-int2`` (the same with the value rotations folded into ``v_proj`` and
``o_proj``, :func:`foscar.oscar.fold_value_rotations`: the cache then rotates K and Q only; the
weights' values change, which a step's cost does not depend on, so only the identity value
rotations folding leaves are set), ``foscar-oscar-k4third-int2`` (``foscar-oscar-int2`` with
INT4 keys in every third layer, one format per layer: the share of layers SmolLM2's best mixed
row took; which layers does not change a step's cost),
``foscar-oscar-k4half-v4third-int2`` (INT4 keys in every other layer and INT4 values in every
third: the shares of SmolLM2's 15:10 row, which matched BF16), and
``hf-quantized-int4/int2``
(transformers' ``QuantizedCache`` with the first importable backend of quanto, hqq; skipped with
the reason when none is). A point that runs out of memory is recorded as such, and larger
batches of that method and context are skipped. ``--e2e-max-seconds`` stops starting points
once the time is spent; results are written after every point.

The plot follows the paper's Fig. 12: aggregate against per-user throughput, one curve per
method through the batch sizes, one panel per context length.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

from .. import __version__
from ..cache import effective_bits
from ..formats import KVFormat, QuantFormat
from ..results import results_json

__all__ = ["run_e2e", "build_model", "QWEN3_8B", "METHODS", "DEFAULT_METHODS"]

QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
METHODS = (
    "bf16",
    "foscar-int4",
    "foscar-int2",
    "foscar-oscar-int2",
    "foscar-oscar-folded-int2",
    "foscar-oscar-k4third-int2",
    "foscar-oscar-k4half-v4third-int2",
    "hf-quantized-int4",
    "hf-quantized-int2",
)
SINK, RECENT, GROUP = 64, 256, 128


#: the methods run by default (OSCAR's on request)
DEFAULT_METHODS = tuple(m for m in METHODS if not m.startswith("foscar-oscar"))


# ---------------------------------------------------------------------------- model and caches
def build_model(device: torch.device, layers: int | None = None, **overrides):
    """A Qwen3-8B-shaped causal LM with random BF16 weights on ``device`` (Llama if transformers
    has no Qwen3). ``overrides`` change config entries (tests build small models)."""
    import transformers

    from ..integrations.transformers import register

    register()
    shape = {**QWEN3_8B, **overrides}
    if layers:
        shape["num_hidden_layers"] = layers
    if hasattr(transformers, "Qwen3ForCausalLM"):
        config, cls = transformers.Qwen3Config(**shape), transformers.Qwen3ForCausalLM
    else:  # same attention and MLP shapes, without Qwen3's q/k norms
        config, cls = transformers.LlamaConfig(**shape), transformers.LlamaForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def foscar_format(bits: int) -> KVFormat:
    f = QuantFormat(bits, "token", GROUP)
    return KVFormat(f, f, sink_tokens=SINK, recent_tokens=RECENT)


def method_formats(method: str, num_layers: int) -> tuple[KVFormat, ...]:
    """One KVFormat per layer of a foscar method: its width everywhere; for ``-k4third`` INT4
    keys in every third layer (layers 1, 4, 7, ...); for ``-k4half-v4third`` INT4 keys in every
    other layer (1, 3, 5, ...) and INT4 values in every third (1, 4, 7, ...)."""
    base = foscar_format(int(method[-1]))
    third = [4 if layer % 3 == 1 else 2 for layer in range(num_layers)]
    from ..oscar import layer_width_formats

    if "-k4third" in method:
        return layer_width_formats(base, key_bits=third)
    if "-k4half-v4third" in method:
        half = [4 if layer % 2 == 1 else 2 for layer in range(num_layers)]
        return layer_width_formats(base, key_bits=half, value_bits=third)
    return (base,) * num_layers


def synthetic_oscar(
    config, seed: int = 0, clips: tuple[float, float] = (0.85, 0.92), *, folded: bool = False
):
    """OSCAR rotations for a model of ``config``'s shapes with the work of a calibrated file:
    random orthogonal K and V rotations per layer and KV head, INT2 clip ratios ``clips`` (K, V;
    OSCAR's fitted ones lie around these) and GPTQ factors of random metrics for the keys.
    ``folded``: identity value rotations, as :func:`foscar.oscar.fold_value_rotations` leaves
    them."""
    from ..oscar import OscarRotations
    from ..quantize import gptq_factor

    g = torch.Generator().manual_seed(seed)
    n, h, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim

    def orthogonal():
        return torch.linalg.qr(torch.randn(n, h, d, d, generator=g, dtype=torch.float64))[0]

    a = torch.randn(n, h, d, d, generator=g, dtype=torch.float64)
    metric = a @ a.transpose(-1, -2) / d + torch.eye(d, dtype=torch.float64)
    full = torch.ones(n, dtype=torch.float64)
    key, value = orthogonal(), orthogonal()
    if folded:
        value = torch.eye(d, dtype=torch.float64).expand(n, h, d, d).contiguous()
    return OscarRotations(
        key,
        value,
        {
            (2, "key"): full * clips[0],
            (2, "value"): full * clips[1],
            # for INT4 keys / values in some layers (-k4third, -k4half-v4third): nearly
            # min-max, as fitted
            (4, "key"): full * 0.99,
            (4, "value"): full * 0.99,
        },
        {"recipe": "synthetic (foscar bench --e2e)"},
        gptq_factor(metric),
    )


def kv_bytes_per_token(method: str, context: int, config) -> float:
    """KV bytes one user's token costs at ``context`` tokens (all layers, K and V)."""
    elems = config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    if method == "bf16":
        return elems * 2.0
    bits = int(method[-1])
    if method.startswith("foscar"):
        return elems * effective_bits(context, method_formats(method, config.num_hidden_layers)) / 8
    # transformers' QuantizedCache: nbits plus an fp scale and zero point per 64 values (an
    # estimate: backends differ), and a BF16 residual of 128 tokens
    quant = bits + 2 * 16 / 64
    return elems * (quant * (context - 128) + 16 * 128) / context / 8


def hf_quantized_backend() -> tuple[str | None, str]:
    """The first importable backend of transformers' QuantizedCache, or None and why not."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    if is_optimum_quanto_available():
        return "quanto", "optimum-quanto"
    if is_hqq_available():
        return "hqq", "hqq"
    return None, "neither optimum-quanto nor hqq is installed"


def _fill_random(cache, seed: int) -> None:
    """Random codes; small positive scales and offsets around zero (so values stay finite)."""
    g = torch.Generator(device=cache.kv.device).manual_seed(seed)
    for st in cache.kv.layers:
        for words in (st.k_words, st.v_words):
            words.random_(-(2**31), 2**31 - 1, generator=g)
        for sz in (st.k_scales, st.v_scales):
            sz[..., 0].uniform_(0.005, 0.02, generator=g)
            sz[..., 1].uniform_(-1.0, -0.5, generator=g)


def make_cache(method: str, model, batch: int, context: int, extra: int, seed: int):
    """A cache holding ``batch`` synthetic prompts of ``context`` tokens."""
    from transformers import DynamicCache

    from ..integrations.transformers import FoscarCache

    cfg = model.config
    device = model.device
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    if method.startswith("foscar"):
        fmt = method_formats(method, cfg.num_hidden_layers)
        kw = dict(
            max_cache_len=context + extra,
            max_batch_size=batch,
            check_finite=False,
            check_mask=False,
        )
        if method.startswith("foscar-oscar"):
            from ..oscar import oscar_cache

            rot = synthetic_oscar(cfg, seed, folded=method.startswith("foscar-oscar-folded"))
            cache = oscar_cache(fmt, cfg, rot, clip_bits="cache", **kw)
        else:
            cache = FoscarCache(fmt, cfg, **kw)
        cache.assume_prompt(batch, context, device)
        _fill_random(cache, seed)
        return cache
    g = torch.Generator(device=device).manual_seed(seed)
    if method == "bf16":
        cache = DynamicCache()
    else:
        from transformers import QuantizedCache

        backend, _ = hf_quantized_backend()
        cache = QuantizedCache(backend, cfg, nbits=int(method[-1]), q_group_size=64)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g)
        v = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g)
        cache.update(k, v, layer)
        del k, v
    return cache


def cache_bytes(cache) -> int:
    """Bytes the cache's K/V occupy (foscar: what its live tokens use)."""
    stats = getattr(cache, "memory_stats", None)
    if stats is not None:
        return int(stats()["used_bytes"])
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------- one point
@torch.no_grad()
def decode_point(model, method: str, batch: int, context: int, new_tokens: int, warmup: int):
    """Decode ``warmup + new_tokens`` steps for ``batch`` users; timings of the last ones."""
    from ..integrations.transformers import cache_kwarg

    device = model.device
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    model.set_attn_implementation("foscar" if method.startswith("foscar") else "sdpa")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cache = make_cache(method, model, batch, context, warmup + new_tokens + 8, seed=batch)
    kw = cache_kwarg(model)
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    sync()
    t0 = time.perf_counter()
    for step in range(warmup + new_tokens):
        if step == warmup:
            sync()
            t0 = time.perf_counter()
        pos = torch.full((batch, 1), context + step, device=device)
        out = model(
            input_ids=tokens, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache}
        )
        tokens = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    sync()
    seconds = time.perf_counter() - t0
    tpot = seconds / new_tokens
    row = {
        "method": method,
        "context": context,
        "batch": batch,
        "tpot_ms": 1e3 * tpot,
        "tokens_per_s_per_user": 1 / tpot,
        "tokens_per_s_aggregate": batch / tpot,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "kv_cache_gib": cache_bytes(cache) / 2**30,
    }
    del cache, out
    gc.collect()  # caches in reference cycles (transformers' own) free their memory only here
    if cuda:
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------- report
def budget_table(methods, contexts, config, budget_gib: float, new_tokens: int) -> list[dict]:
    rows = []
    for method in methods:
        for context in contexts:
            n = context + new_tokens
            per_user = kv_bytes_per_token(method, n, config) * n
            rows.append(
                {
                    "method": method,
                    "context": context,
                    "kv_gib_per_user": per_user / 2**30,
                    "max_batch": int(budget_gib * 2**30 // per_user),
                }
            )
    return rows


def markdown(result: dict) -> str:
    lines = [
        "| method | context | batch | TPOT (ms) | tok/s per user | tok/s aggregate | "
        "peak mem (GiB) | KV (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["points"]:
        if r.get("oom"):
            lines.append(f"| {r['method']} | {r['context']} | {r['batch']} | OOM | | | | |")
            continue
        lines.append(
            f"| {r['method']} | {r['context']} | {r['batch']} | {r['tpot_ms']:.2f} | "
            f"{r['tokens_per_s_per_user']:.1f} | {r['tokens_per_s_aggregate']:.1f} | "
            f"{r['peak_memory_gib'] or 0:.1f} | {r['kv_cache_gib']:.2f} |"
        )
    lines += [
        "",
        f"Largest batch whose KV cache fits {result['config']['kv_budget_gib']:g} GiB:",
        "",
        "| method | context | KV per user (GiB) | max batch |",
        "|---|---|---|---|",
    ]
    for r in result["budget"]:
        lines.append(
            f"| {r['method']} | {r['context']} | {r['kv_gib_per_user']:.2f} | {r['max_batch']} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Aggregate against per-user tokens/s (the paper's Fig. 12), one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = result["config"]["contexts"]
    fig, axes = plt.subplots(1, len(contexts), figsize=(7 * len(contexts), 5.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for method in result["config"]["methods"]:
            pts = [
                p
                for p in result["points"]
                if p["method"] == method and p["context"] == context and not p.get("oom")
            ]
            if not pts:
                continue
            x = [p["tokens_per_s_per_user"] for p in pts]
            y = [p["tokens_per_s_aggregate"] for p in pts]
            ax.plot(x, y, "-o", label=method)
            for p, xi, yi in zip(pts, x, y):
                ax.annotate(f"B={p['batch']}", (xi, yi), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
        ax.set_xlabel("tokens/s per user")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"prompt {context // 1024}K tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"foscar bench --e2e: Qwen3-8B shapes, random weights, synthetic prompt K/V "
        f"({result['env'].get('gpu', '')})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(result: dict, out: Path, name: str) -> None:
    """Write ``<name>.json``, ``<name>.md`` (the notes and the table) and, where matplotlib is
    there, ``<name>.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(results_json(result))
    notes = "\n".join(f"- {n}" for n in result["notes"])
    (out / f"{name}.md").write_text(
        f"# foscar bench --e2e ({result['env'].get('gpu')})\n\n{notes}\n\n{markdown(result)}\n"
    )
    try:
        plot(result, out / f"{name}.png")
    except ImportError:
        pass


# ---------------------------------------------------------------------------- entry
def run_e2e(
    *,
    contexts=(32768, 102400),
    batches=(1, 2, 4, 8, 16, 32),
    new_tokens: int = 1024,
    warmup: int = 8,
    methods=DEFAULT_METHODS,
    kv_budget_gib: float = 96.0,
    layers: int | None = None,
    max_seconds: float | None = None,
    out_dir: str = ".",
    name: str = "e2e_qwen3_8b",
    out=sys.stdout,
) -> dict:
    """Decode throughput of the Qwen3-8B-shaped model for every method, context and batch;
    writes ``name``'s JSON, markdown and plot under ``out_dir`` after every point and returns
    the result. ``layers``: fewer than 36 (smoke runs); ``max_seconds``: start no point after
    that many seconds. Needs a CUDA GPU and transformers (``RuntimeError`` otherwise)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the end-to-end benchmark needs a CUDA GPU: it decodes a Qwen3-8B-shaped model (16 "
            "GiB of BF16 weights) with the Triton kernels"
        )
    import transformers

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"methods must be among {METHODS}, got {bad}")
    if new_tokens < 1 or warmup < 0:
        raise ValueError(f"new_tokens must be >= 1 and warmup >= 0, got {new_tokens}, {warmup}")
    device = torch.device("cuda")
    methods = list(methods)
    skipped = {}
    if any(m.startswith("hf-quantized") for m in methods):
        backend, why = hf_quantized_backend()
        if backend is None:
            skipped = {m: why for m in methods if m.startswith("hf-quantized")}
            methods = [m for m in methods if m not in skipped]
        else:
            skipped["hf-quantized backend"] = why
    t_start = time.perf_counter()
    model = build_model(device, layers)
    env = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "foscar": __version__,
        "model_class": type(model).__name__,
        "weights_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
    }
    print(json.dumps(env), file=out, flush=True)
    out_path = Path(out_dir)
    result = {
        "config": {
            "model": {**QWEN3_8B, "num_hidden_layers": model.config.num_hidden_layers},
            "contexts": list(contexts),
            "batches": list(batches),
            "new_tokens": new_tokens,
            "warmup": warmup,
            "methods": methods,
            "skipped": skipped,
            "kv_budget_gib": kv_budget_gib,
            "foscar_formats": {
                **{f"foscar-int{b}": foscar_format(b).short() for b in (4, 2)},
                "foscar-oscar-int2": foscar_format(2).short()
                + " with synthetic OSCAR rotations, clips 0.85/0.92 and GPTQ keys",
                "foscar-oscar-k4third-int2": "foscar-oscar-int2 with INT4 keys (clip 0.99) in "
                "every third layer",
                "foscar-oscar-k4half-v4third-int2": "foscar-oscar-int2 with INT4 keys in every "
                "other layer and INT4 values in every third (clips 0.99)",
            },
        },
        "env": env,
        "notes": [
            "random weights with Qwen3-8B's shapes, built from a config (no checkpoint)",
            "synthetic prompts: the prompt K/V are written straight into the caches (no "
            "prefill); decode cost does not depend on the cached values",
            f"each point: {warmup} untimed decode steps, then {new_tokens} "
            "timed ones, greedy argmax, one forward per step",
            "max batch: from each method's KV bytes per token at context + new tokens "
            "(hf-quantized: an estimate of nbits + fp16 scale/zero per 64 values)",
        ],
        "points": [],
        "budget": budget_table(methods, list(contexts), model.config, kv_budget_gib, new_tokens),
    }
    for context in contexts:
        for method in methods:
            for batch in sorted(batches):
                if max_seconds and time.perf_counter() - t_start > max_seconds:
                    result["notes"].append(f"stopped after {max_seconds:g} s")
                    write_results(result, out_path, name)
                    print(markdown(result), file=out)
                    return result
                try:
                    row = decode_point(model, method, batch, context, new_tokens, warmup)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    row = {"method": method, "context": context, "batch": batch, "oom": True}
                result["points"].append(row)
                print(json.dumps(row), file=out, flush=True)
                write_results(result, out_path, name)
                if row.get("oom"):
                    break
    result["seconds"] = time.perf_counter() - t_start
    write_results(result, out_path, name)
    print(markdown(result), file=out)
    return result
