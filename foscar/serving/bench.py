"""``foscar bench --serve``: a seeded trace of requests through the continuous-batching engine.

Requests arrive over time (Poisson arrivals at ``rate`` per second, or all at once), each with a
prompt and a fixed answer length, both uniform in their ranges. A prompt is a window of a real
text's token ids at a seeded offset (``text_ids``: ``foscar bench --serve`` takes foscar's
evaluation text, tokenized by the model's tokenizer) or, without a text, random token ids.
Answers are greedy and run to their length (no end-of-sequence token stops them), so every
method does the same work. The same trace goes through the engine once per KV cache, one after
the other, on the same model and device, in one process, each with the same KV memory
(``memory_bytes``): a format that stores a token in fewer bytes holds more tokens, so the engine
runs more requests at once. The caches: ``flashinfer-bf16`` and ``flashinfer-fp8`` (BF16 and FP8
pages attended by FlashInfer's kernels, the baselines vLLM and SGLang users run; a CUDA device
with FlashInfer installed, else refused with the reason), ``sdpa-bf16`` (or ``bf16``: the
engine's own paged cache attended by its paged SDPA path, its fallback without FlashInfer) and
foscar's formats.

Per method: throughput (answer tokens per second of the trace's wall time, and prompt plus
answer tokens), time to first token (TTFT: arrival to the first answer token) and time per
output token (TPOT: first to last answer token over the tokens between), median and p99; peak
concurrent requests (most requests holding KV blocks at once, the engine's count); the pool
(blocks, tokens, bytes per token, BF16's tokens in the same memory); and on a GPU the device's
peak memory (reset before each method). Before the clock starts each method warms up
(``warm_up``): ``"trace"`` replays the trace once untimed, every prompt as it comes and the
answers cut so that requests end one step apart (2, 3, ... tokens), so the steps meet the
prefill shapes, the decode batch sizes and the history lengths the timed replay meets, and every
kernel they launch (FlashInfer's JIT, Triton's, the engine's CUDA graphs) is built; ``"short"``
runs one short request (the engine's cache is built, little else).

A sanity check of the tokens: every request's answer is recorded, and each method's answers are
compared with the reference's (``flashinfer-bf16`` where measured, else the engine's BF16 cache;
:func:`answer_agreement`): how many are the same token for token, and
how long the common prefix is. On real weights and a real text a cache that breaks the model
shows as short prefixes. It is no accuracy measurement (``foscar eval`` is): greedy answers part
at the first near-tie of two tokens, and the engine batches the requests differently for each
method (a smaller cache holds more at once), which can round differently even for the same cache.
foscar's caches keep a request's first and latest tokens in BF16 windows (64 and 256 by
default): a request shorter than the two together reads no quantized token, and its answers
differ from ``bf16``'s only by BF16's rounding (on a CPU the engine's cache is float32) and the
batching; prompts longer than that test the quantized tokens. With ``agreement_floor`` the
reference runs the trace a second time with the requests in reverse order (all at once): how
many of its own answers it gives again is the floor the others' agreement is read against.

Results: ``serve_bench.json`` (everything, with every request's times), ``serve_bench.md`` (the
table) and ``serve_bench.png`` (the plot; needs matplotlib) under ``out``.

``bf16`` is the engine's cache in the model's dtype: BF16 on a GPU, float32 for the float32
weights used on a CPU (the tables say which).
"""

from __future__ import annotations

import math
import os
import platform
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..results import results_json

__all__ = [
    "DEFAULT_TRACE",
    "RANDOM_PROMPTS",
    "TraceRequest",
    "TraceSpec",
    "answer_agreement",
    "cell",
    "make_trace",
    "not_measured",
    "replay",
    "run_environment",
    "run_benchmark",
    "summarize",
]


@dataclass(frozen=True)
class TraceSpec:
    """A trace: ``num_requests`` requests arriving at ``rate`` per second (Poisson; 0: all at
    once), prompt and answer lengths uniform in ``prompt_tokens`` and ``output_tokens``
    (inclusive ``(min, max)``), drawn with ``seed``."""

    num_requests: int = 64
    rate: float = 8.0
    prompt_tokens: tuple[int, int] = (512, 4096)
    output_tokens: tuple[int, int] = (64, 512)
    seed: int = 0
    #: tokens of a system prompt every prompt starts with (before its own ``prompt_tokens``)
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        n = self.num_requests
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_requests must be an int >= 1, got {n!r}")
        if not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate)) or self.rate < 0:
            raise ValueError(f"rate must be a number >= 0 (requests per second), got {self.rate!r}")
        for name in ("prompt_tokens", "output_tokens"):
            lo_hi = getattr(self, name)
            if (
                len(lo_hi) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in lo_hi)
                or not 1 <= lo_hi[0] <= lo_hi[1]
            ):
                raise ValueError(f"{name} must be (min, max) with 1 <= min <= max, got {lo_hi!r}")
        shared = self.shared_prefix_tokens
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"shared_prefix_tokens must be an int >= 0, got {shared!r}")

    @property
    def max_request_tokens(self) -> int:
        return self.shared_prefix_tokens + self.prompt_tokens[1] + self.output_tokens[1]


#: the trace ``foscar bench --serve`` replays by default (sized for a GPU)
DEFAULT_TRACE = TraceSpec()
#: what a trace's prompts are where its results name no text (``trace["prompts"]``)
RANDOM_PROMPTS = "random token ids"


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: ``arrival_s`` after the trace starts, its prompt's token ids,
    and the answer tokens it generates."""

    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    output_tokens: int


def make_trace(
    spec: TraceSpec,
    vocab_size: int,
    *,
    avoid: Sequence[int] = (),
    text_ids: Sequence[int] | None = None,
) -> list[TraceRequest]:
    """The requests of ``spec``, the same for the same seed on every machine (Python's
    ``random``).

    Prompts are windows of ``text_ids`` (a real text's token ids), each at an offset uniform over
    the windows of its length that fit in the text; without ``text_ids``, random ids drawn from
    ``[0, vocab_size)`` less ``avoid`` (special tokens). Raises ``ValueError`` where the text is
    shorter than the longest prompt or holds ids outside ``[0, vocab_size)``.
    """
    rng = random.Random(spec.seed)
    if text_ids is None:
        banned = set(avoid)
        pool = [t for t in range(vocab_size) if t not in banned]
        if not pool:
            raise ValueError(f"vocab_size={vocab_size} leaves no token outside avoid")
    else:
        text = tuple(text_ids)
        if len(text) < spec.prompt_tokens[1]:
            raise ValueError(
                f"text_ids holds {len(text)} tokens, fewer than the longest prompt's "
                f"{spec.prompt_tokens[1]}"
            )
        if min(text) < 0 or max(text) >= vocab_size:
            raise ValueError(f"text_ids holds ids outside [0, {vocab_size})")
    # the system prompt: its own random stream, so that the requests' draws stay those of the
    # same trace without one; from a text, the text's first tokens
    shared = spec.shared_prefix_tokens
    if text_ids is None:
        system_rng = random.Random(f"system prompt {spec.seed}")
        system = tuple(system_rng.choice(pool) for _ in range(shared))
    else:
        system = text[:shared]
    clock = 0.0
    trace = []
    for i in range(spec.num_requests):
        if spec.rate > 0 and i:
            clock += rng.expovariate(spec.rate)
        # per request: the arrival gap, the length, each random id, the answer length (the order
        # every committed random trace was drawn in)
        length = rng.randint(*spec.prompt_tokens)
        if text_ids is None:
            prompt = tuple(rng.choice(pool) for _ in range(length))
        else:
            start = rng.randint(0, len(text) - length)
            prompt = text[start : start + length]
        trace.append(TraceRequest(i, clock, system + prompt, rng.randint(*spec.output_tokens)))
    return trace


def replay(manager, trace: Sequence[TraceRequest], *, max_seconds: float = 600.0,
           clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Send ``trace`` through a started ``manager`` at its arrival times; returns a record per
    request: ``arrival``, ``first_token``, ``finish`` (seconds after the trace's start; None if
    it never came), ``prompt_tokens``, ``output_tokens`` (generated), ``target_tokens``,
    ``answer`` (the generated token ids) and ``error``. Gives up ``max_seconds`` after the start
    (the requests left are cancelled)."""
    records = {
        f"trace-{r.index}": {
            "index": r.index,
            "arrival": r.arrival_s,
            "first_token": None,
            "finish": None,
            "prompt_tokens": len(r.prompt),
            "output_tokens": 0,
            "target_tokens": r.output_tokens,
            "answer": [],
            "error": None,
        }
        for r in trace
    }
    submit_errors: list[str] = []
    start = clock()

    def submit() -> None:
        for r in trace:
            wait = start + r.arrival_s - clock()
            if wait > 0:
                time.sleep(wait)
            request_id = f"trace-{r.index}"
            records[request_id]["arrival"] = clock() - start  # when it really went in
            try:
                accepted = manager.add_request(
                    list(r.prompt),
                    request_id=request_id,
                    max_new_tokens=r.output_tokens,
                    streaming=True,
                    eos_token_id=-1,  # no token ends an answer: each runs to its length
                )
            except ValueError as e:
                records[request_id]["error"] = str(e)
                submit_errors.append(request_id)
                continue
            if accepted is None:
                records[request_id]["error"] = "the engine dropped it (not running)"
                submit_errors.append(request_id)

    sender = threading.Thread(target=submit, name="trace-sender", daemon=True)
    sender.start()
    open_ids = set(records)
    while open_ids - set(submit_errors):
        now = clock() - start
        if now > max_seconds:
            for request_id in open_ids:
                manager.cancel_request(request_id)
                records[request_id]["error"] = records[request_id]["error"] or (
                    f"not finished after {max_seconds} s"
                )
            break
        output = manager.get_result(timeout=0.05)
        if output is None:
            fatal = getattr(getattr(manager, "background_thread_status", None), "fatal_error",
                            None)
            if fatal is not None:
                for request_id in open_ids:
                    records[request_id]["error"] = f"the engine stopped: {fatal}"
                break
            continue
        record = records.get(output.request_id)
        if record is None or output.request_id not in open_ids:
            continue  # the warm-up's, or a late one
        now = clock() - start
        tokens = len(output.generated_tokens)
        if tokens and record["first_token"] is None:
            record["first_token"] = now
        record["output_tokens"] = tokens
        record["answer"] = list(output.generated_tokens)
        if output.error is not None:
            record["error"] = str(output.error)
            open_ids.discard(output.request_id)
        elif output.is_finished():
            record["finish"] = now
            open_ids.discard(output.request_id)
    sender.join(timeout=1.0)
    return [records[f"trace-{r.index}"] for r in trace]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear between ranks, as numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _complete(record: dict) -> bool:
    """Finished without an error, every target token generated."""
    return (record["finish"] is not None and record["error"] is None
            and record["output_tokens"] >= record["target_tokens"])


def summarize(records: Sequence[dict]) -> dict:
    """Throughput, TTFT and TPOT (median and p99) of ``replay``'s records; only complete requests
    (every target token generated) count."""
    done = [r for r in records if _complete(r)]
    ttft = [r["first_token"] - r["arrival"] for r in done]
    tpot = [
        (r["finish"] - r["first_token"]) / (r["output_tokens"] - 1)
        for r in done
        if r["output_tokens"] > 1
    ]
    wall = (max(r["finish"] for r in done) - min(r["arrival"] for r in records)) if done else None
    answer = sum(r["output_tokens"] for r in done)
    prompt = sum(r["prompt_tokens"] for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": [r["index"] for r in records if r not in done],
        "wall_s": wall,
        "answer_tokens": answer,
        "output_tokens_per_s": answer / wall if wall else None,
        "total_tokens_per_s": (answer + prompt) / wall if wall else None,
        "ttft_median_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_median_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens before the first place ``a`` and ``b`` differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def answer_agreement(method: dict, reference: dict) -> dict | None:
    """How the answers of ``method`` compare with those of ``reference`` (two of
    :func:`run_method`'s results over the same trace; the reference is ``bf16``), over the
    requests complete in both.

    Returns ``identical`` (answers equal token for token), ``compared`` (requests complete in
    both), ``prefix_median`` and ``prefix_min`` (tokens before the first difference; None when
    nothing was compared) and ``prefix_share_median`` (that prefix over the reference answer's
    length). None where either was not measured or its records hold no answers (results
    written before answers were recorded).

    Example: answers ``[5, 6, 7]`` and ``[5, 6, 9]`` share a prefix of 2 tokens, a share of 2/3.
    """
    if not_measured(method) or not_measured(reference):
        return None
    runs = (method.get("records"), reference.get("records"))
    if any(records is None or any("answer" not in r for r in records) for records in runs):
        return None
    expected = {r["index"]: r["answer"] for r in reference["records"] if _complete(r)}
    pairs = [(r["answer"], expected[r["index"]]) for r in method["records"]
             if _complete(r) and r["index"] in expected]
    prefixes = [_common_prefix(a, b) for a, b in pairs]
    shares = [p / len(b) if b else 1.0 for p, (_, b) in zip(prefixes, pairs)]
    return {
        "identical": sum(a == b for a, b in pairs),
        "compared": len(pairs),
        "prefix_median": percentile(prefixes, 50),
        "prefix_min": min(prefixes, default=None),
        "prefix_share_median": percentile(shares, 50),
    }


def _bf16_engine_bytes_per_token(model) -> int:
    """Bytes one token takes in the engine's own cache (the model's dtype)."""
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * model.dtype.itemsize


def default_memory_bytes(model, spec: TraceSpec, trace: Sequence[TraceRequest]) -> int:
    """KV memory that holds a quarter of the trace's tokens, and at least two of its largest
    requests, in the engine's own cache: BF16 then queues requests, so what a format's smaller
    tokens buy shows in the concurrency."""
    tokens = sum(len(r.prompt) + r.output_tokens for r in trace)
    tokens = max(tokens // 4, 2 * spec.max_request_tokens)
    return tokens * _bf16_engine_bytes_per_token(model)


#: how each warm-up is described in the results
WARM_UPS = {
    "trace": "the trace replayed once untimed (every prompt, answers cut to end one step apart)",
    "short": "one short request untimed",
}


def warm_up_trace(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The warm-up of ``trace``: its requests at once, answers cut to 2, 3, ... tokens (at most
    their own), ids ``warm-up-<index>``."""
    return [TraceRequest(r.index, 0.0, r.prompt, min(r.output_tokens, 2 + i))
            for i, r in enumerate(trace)]


def _warm_up_requests(manager, trace: Sequence[TraceRequest], max_seconds: float) -> None:
    """Send ``warm_up_trace(trace)`` and wait until every request ended (at most
    ``max_seconds``); raises RuntimeError if the engine stopped."""
    pending = set()
    for r in warm_up_trace(trace):
        request_id = f"warm-up-{r.index}"
        try:
            manager.add_request(list(r.prompt), request_id=request_id,
                                max_new_tokens=r.output_tokens, eos_token_id=-1)
        except ValueError:
            continue  # one the pool can never hold: the timed replay records why
        pending.add(request_id)
    deadline = time.perf_counter() + max_seconds
    while pending and time.perf_counter() < deadline:
        output = manager.get_result(timeout=0.1)
        if output is not None and output.request_id in pending and (
                output.is_finished() or output.error is not None):
            pending.discard(output.request_id)
        fatal = getattr(getattr(manager, "background_thread_status", None), "fatal_error", None)
        if fatal is not None:
            raise RuntimeError(f"the engine stopped during its warm-up: {fatal}")
    for request_id in pending:
        manager.cancel_request(request_id)


def _warm_up(manager, vocab_size: int, max_seconds: float = 300.0) -> None:
    """One short request, untimed: the engine builds its cache when its loop starts. Waits at
    most ``max_seconds``."""
    request_id = manager.add_request([1 % vocab_size] * 4, request_id="warm-up", max_new_tokens=2,
                                     eos_token_id=-1)
    deadline = time.perf_counter() + max_seconds
    while time.perf_counter() < deadline:
        output = manager.get_result(request_id=request_id, timeout=0.1)
        if output is not None and output.is_finished():
            return
        fatal = getattr(getattr(manager, "background_thread_status", None), "fatal_error", None)
        if fatal is not None:
            raise RuntimeError(f"the engine stopped during its warm-up: {fatal}")


def run_method(model, kv, trace: Sequence[TraceRequest], *, memory_bytes: int,
               block_size: int | None = None, max_seconds: float = 600.0,
               cuda_graphs: bool | None = None, request_tokens: int | None = None,
               warm_up: str = "short", max_batch_tokens: int | None = None,
               prefix_sharing: bool = False) -> dict:
    """One KV cache through the trace: the engine's pool, the records and their summary.

    ``cuda_graphs``, ``request_tokens``, ``max_batch_tokens`` and ``prefix_sharing`` go to
    ``build_manager``;
    ``warm_up``: one of :data:`WARM_UPS` (module docstring). A cache the manager refuses
    (``ValueError``, e.g. CUDA graphs with a channel-wise format) comes back as
    ``{"refused": reason}`` and an engine that stops during the run as ``{"failed": reason}``,
    so one method's refusal does not end a benchmark of several."""
    from . import build_manager

    vocab = model.config.get_text_config().vocab_size
    longest = max(r.output_tokens for r in trace)
    try:
        manager = build_manager(model, kv, memory_bytes=memory_bytes, block_size=block_size,
                                max_new_tokens=longest, cuda_graphs=cuda_graphs,
                                request_tokens=request_tokens, max_batch_tokens=max_batch_tokens,
                                prefix_sharing=prefix_sharing)
    except ValueError as e:
        return {"refused": " ".join(str(e).split())}
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()  # the previous method's pool is not this one's peak
        torch.cuda.reset_peak_memory_stats(model.device)
    with torch.inference_mode():
        manager.start()
    try:
        _warm_up(manager, vocab, min(300.0, max_seconds))
        if warm_up == "trace":
            _warm_up_requests(manager, trace, max_seconds)
        paged = getattr(manager.cache, "paged", None)
        if hasattr(paged, "peak_pages"):  # the timed replay's pages, not the warm-up's
            paged.peak_pages = 0
            manager.cache.shared_tokens = 0
        # what attends the cache while the engine runs (the engine's BF16 cache: its paged
        # SDPA, or a FlashAttention where one is installed)
        attention = (manager.attention_description() if hasattr(manager, "attention_description")
                     else model.config._attn_implementation)
        records = replay(manager, trace, max_seconds=max_seconds)
    except RuntimeError as e:  # the engine stopped (_warm_up's error)
        return {"failed": " ".join(str(e).split())}
    finally:
        manager.stop(block=True)
    stats = manager.kv_stats()
    result = {**summarize(records), "pool": stats,
              "peak_concurrent_requests": stats.get("peak_concurrent_requests"),
              "attention": attention, "warm_up": WARM_UPS[warm_up], "records": records}
    if cuda:
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated(model.device)
    return result


def attention_line(methods) -> str | None:
    """``"Attention: bf16: paged|sdpa; int2: ..."``: what attended each measured method's cache
    while the engine ran (None where no method recorded it)."""
    seen = [f"{m['kv']}: {m['attention']}" for m in methods if m.get("attention")]
    return f"Attention: {'; '.join(seen)}." if seen else None


def not_measured(method: dict) -> str | None:
    """``"refused: <reason>"`` or ``"failed: <reason>"`` for a method :func:`run_method` could
    not measure, else None. A method whose requests did not all finish (``failed``: their
    indices) is measured over those that did, unless none did."""
    if method.get("refused"):
        return f"refused: {method['refused']}"
    failed = method.get("failed")
    if failed and (isinstance(failed, str) or not method.get("completed")):
        return f"failed: {failed}"
    return None


def run_benchmark(model, kvs: Sequence, spec: TraceSpec, *, out: str | Path | None,
                  model_name: str = "model", memory_bytes: int | None = None,
                  block_size: int | None = None, max_seconds: float = 600.0,
                  cuda_graphs: bool | None = None, request_tokens: int | None = None,
                  prompt_text_ids: Sequence[int] | None = None,
                  prompt_text_name: str | None = None, warm_up: str = "short",
                  agreement_floor: bool = False, max_batch_tokens: int | None = None,
                  prefix_sharing: Sequence[bool] = (False,),
                  name: str = "serve_bench", log: Callable[[str], None] = print) -> dict:
    """Replay the trace of ``spec`` for each KV cache of ``kvs`` (``build_manager``'s ``kv``
    values) on ``model``; writes ``<name>.{json,md,png}`` under ``out`` (None: no files) after
    every method and returns the results (``methods``: one dict per KV cache, in order; a
    refused or failed one holds its reason, :func:`not_measured`). ``cuda_graphs``,
    ``request_tokens`` and ``max_batch_tokens`` go to every method's ``build_manager``;
    ``warm_up`` and ``agreement_floor``: module docstring (the floor lands in
    ``agreement_floor``: the reference's label and :func:`answer_agreement` of its second run).

    ``prompt_text_ids``: the token ids of a real text whose windows are the prompts
    (:func:`make_trace`), named ``prompt_text_name`` in ``trace["prompts"]``; None: random ids,
    and the trace records no ``prompts`` (:data:`RANDOM_PROMPTS`).

    ``prefix_sharing``: each foscar cache runs once per value (``build_manager``'s
    ``prefix_sharing``; labelled ``<kv> shared`` when on), BF16 caches once."""
    from .kv_spec import resolve_kv

    if not kvs:
        raise ValueError("kvs must name at least one KV cache")
    if warm_up not in WARM_UPS:
        raise ValueError(f"warm_up must be one of {sorted(WARM_UPS)}, got {warm_up!r}")
    text = model.config.get_text_config()
    avoid = [t for t in (getattr(text, name, None) for name in
                         ("bos_token_id", "eos_token_id", "pad_token_id")) if isinstance(t, int)]
    trace = make_trace(spec, text.vocab_size, avoid=avoid, text_ids=prompt_text_ids)
    if memory_bytes is None:
        memory_bytes = default_memory_bytes(model, spec, trace)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
    results = {
        "model": model_name,
        "env": run_environment(model),
        "trace": {**asdict(spec), "answer_tokens": sum(r.output_tokens for r in trace),
                  "prompt_tokens_total": sum(len(r.prompt) for r in trace)},
        "memory_bytes": memory_bytes,
        "engine_cache_dtype": str(model.dtype).removeprefix("torch."),
        "cuda_graphs": cuda_graphs,
        "warm_up": WARM_UPS[warm_up],
        "methods": [],
    }
    if prompt_text_ids is not None:
        # only for a text: a random trace's record holds no "prompts" key, so that
        # benchmarks/tools/serve_random_model.py --merge finds committed runs the same trace
        results["trace"]["prompts"] = (
            prompt_text_name or f"a text of {len(prompt_text_ids)} tokens"
        )
    if not prefix_sharing or any(not isinstance(v, bool) for v in prefix_sharing):
        raise ValueError(f"prefix_sharing must list True and/or False, got {prefix_sharing!r}")
    runs = []
    for kv in kvs:
        resolved = resolve_kv(kv, num_layers=text.num_hidden_layers,
                              head_dim=getattr(text, "head_dim", None)
                              or text.hidden_size // text.num_attention_heads)
        for sharing in dict.fromkeys(prefix_sharing if not resolved.is_bf16 else (False,)):
            runs.append((kv, resolved.label, sharing))
    for kv, base_label, sharing in runs:
        label = base_label + (" shared" if sharing else "")
        log(f"{label}: {spec.num_requests} requests, {memory_bytes / 1e9:.3f} GB of KV memory"
            + ("" if cuda_graphs is None else f", CUDA graphs {'on' if cuda_graphs else 'off'}"))
        start = time.perf_counter()
        settings = dict(memory_bytes=memory_bytes, block_size=block_size,
                        max_seconds=max_seconds, cuda_graphs=cuda_graphs,
                        request_tokens=request_tokens, warm_up=warm_up,
                        max_batch_tokens=max_batch_tokens)
        result = run_method(model, kv, trace, prefix_sharing=sharing, **settings)
        result["kv"] = label
        result["prefix_sharing"] = sharing
        if isinstance(kv, (str, os.PathLike)) and os.fspath(kv) != base_label:
            result["kv_arg"] = os.fspath(kv)  # an OSCAR file: the path it was given as
        result["seconds"] = time.perf_counter() - start
        results["methods"].append(result)
        reference = _reference(results["methods"])
        agreement = _agreement_text(result, reference)
        log(f"{label}: {_summary_line(result)}"
            + (f", same answer as {reference['kv']}: {agreement}" if agreement else "")
            + f" ({result['seconds']:.1f} s)")
        if agreement_floor and result is reference and "agreement_floor" not in results:
            # the reference again, the requests in reverse order at once: its own floor
            again = run_method(model, kv, [TraceRequest(r.index, 0.0, r.prompt, r.output_tokens)
                                           for r in reversed(trace)], **settings)
            floor = answer_agreement(again, reference)
            results["agreement_floor"] = {"kv": label, **(floor or {"failed": not_measured(again)})}
            log(f"{label} against itself, requests in reverse order: "
                f"{_agreement_text(again, reference)}")
        if out is not None:
            write_results(results, out, name)
    if out is not None:
        log(f"wrote {out / (name + '.json')}, {name}.md and {name}.png")
    return results


def run_environment(model) -> dict:
    """Where a serving measurement ran: the device's name (or the CPU and its threads) and the
    versions of torch, transformers, foscar and Python."""
    import transformers

    from .. import __version__

    device = model.device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        "threads)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "foscar": __version__,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------- reports
def cell(value, scale: float = 1.0, digits: int = 1) -> str:
    """``value * scale`` with ``digits`` decimals for a report's table, ``"-"`` for None (not
    measured)."""
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _summary_line(m: dict) -> str:
    if not_measured(m):
        return not_measured(m)
    return (
        f"{m['completed']}/{m['requests']} requests, {cell(m['output_tokens_per_s'])} answer "
        f"tokens/s, TTFT {cell(m['ttft_median_s'], 1e3, 0)} / {cell(m['ttft_p99_s'], 1e3, 0)} "
        f"ms, TPOT {cell(m['tpot_median_s'], 1e3, 1)} / {cell(m['tpot_p99_s'], 1e3, 1)} ms "
        f"(median / p99), peak {m['peak_concurrent_requests']} requests at once"
    )


def _pages_line(methods: Sequence[dict], shared_prefix_tokens: int) -> str:
    """The foscar methods' peak pool pages held and the prompt tokens their requests started on
    from another request's pages (prefix sharing)."""
    parts = []
    for m in methods:
        pool = m.get("pool") or {}
        if not_measured(m) or pool.get("peak_pages") is None:
            continue
        parts.append(f"{m['kv']} {pool['peak_pages']} pages of {pool['block_size']} tokens at "
                     f"the peak, {pool.get('shared_tokens', 0)} prompt tokens adopted")
    system = (f"Every prompt starts with the same {shared_prefix_tokens}-token system prompt. "
              if shared_prefix_tokens else "")
    return (system + "Pages held (a page several requests share counts once): "
            + ("; ".join(parts) if parts else "none measured") + ".")


def _graphs_text(cuda_graphs: bool | None) -> str:
    if cuda_graphs is None:
        return ""
    return f" The engine's CUDA graphs: {'on' if cuda_graphs else 'off'} (asked of every method)."


#: the methods whose answers the others are compared with, in order of preference
REFERENCES = ("flashinfer-bf16", "bf16", "sdpa-bf16")


def _reference(methods: Sequence[dict]) -> dict | None:
    """The measured method the others' answers are compared with: the first of
    :data:`REFERENCES` measured."""
    for name in REFERENCES:
        found = next((m for m in methods if m["kv"] == name and not not_measured(m)), None)
        if found is not None:
            return found
    return None


def _agreement_text(method: dict, reference: dict | None) -> str | None:
    """``"3/4, median prefix 12 tokens (75%)"``; None for the reference itself, or where
    :func:`answer_agreement` gives None."""
    if reference is None or method is reference:
        return None
    a = answer_agreement(method, reference)
    if a is None:
        return None
    if not a["compared"]:
        return "0/0"
    return (f"{a['identical']}/{a['compared']}, median prefix {a['prefix_median']:g} tokens "
            f"({a['prefix_share_median']:.0%})")


def markdown(results: dict) -> str:
    """The results as a Markdown table, with the conditions above it. With a measured reference
    (:data:`REFERENCES`), a column compares every other method's answers with its
    (:func:`answer_agreement`; none for results without answers), and the reference's floor
    where it was measured."""
    env, trace = results["env"], results["trace"]
    methods = results["methods"]
    reference = _reference(methods)
    agreement = {id(m): _agreement_text(m, reference) for m in methods}
    compared = any(agreement.values())
    ref_name = reference["kv"] if reference is not None else "bf16"
    prompts = trace.get("prompts")
    lines = [
        f"# Serving benchmark: {results['model']}",
        "",
        f"Device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"foscar {env['foscar']}.",
        f"Trace: {trace['num_requests']} requests, "
        + (f"Poisson arrivals at {trace['rate']}/s" if trace["rate"] else "all at once")
        + f", prompts {trace['prompt_tokens'][0]}-{trace['prompt_tokens'][1]} tokens, answers "
        f"{trace['output_tokens'][0]}-{trace['output_tokens'][1]} tokens (seed {trace['seed']}; "
        f"{trace['prompt_tokens_total']} prompt and {trace['answer_tokens']} answer tokens). "
        f"Prompts: {f'windows of {prompts}' if prompts else RANDOM_PROMPTS}.",
        f"KV memory of every method: {results['memory_bytes'] / 1e9:.3f} GB. bf16 and "
        f"sdpa-bf16 are the engine's own paged cache and its paged SDPA path, in the model's "
        f"dtype ({results['engine_cache_dtype']}); flashinfer-bf16 and flashinfer-fp8 are BF16 "
        "and FP8 E4M3 pages attended by FlashInfer's paged prefill and decode kernels."
        + _graphs_text(results.get("cuda_graphs"))
        + (f" Warm-up before each method's timed replay: {results['warm_up']}."
           if results.get("warm_up") else ""),
        "",
        "| KV cache | done | answer tok/s | all tok/s | TTFT median (ms) | TTFT p99 (ms) | "
        "TPOT median (ms) | TPOT p99 (ms) | peak requests | pool tokens | bytes/token |"
        + (f" same answer as {ref_name} |" if compared else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if compared else ""),
    ]
    for m in methods:
        if not_measured(m):
            lines.append(f"| {m['kv']} | {not_measured(m)} |" + " |" * (10 if compared else 9))
            continue
        pool = m["pool"]
        lines.append(
            f"| {m['kv']} | {m['completed']}/{m['requests']} | {cell(m['output_tokens_per_s'])} "
            f"| {cell(m['total_tokens_per_s'])} | {cell(m['ttft_median_s'], 1e3, 0)} "
            f"| {cell(m['ttft_p99_s'], 1e3, 0)} | {cell(m['tpot_median_s'], 1e3, 1)} "
            f"| {cell(m['tpot_p99_s'], 1e3, 1)} | {m['peak_concurrent_requests']} "
            f"| {pool['max_tokens']} | {pool['bytes_per_token']:.0f} |"
            + (f" {agreement[id(m)] or '-'} |" if compared else "")
        )
    if any("device_peak_bytes" in m for m in methods):
        lines += ["", "Device peak memory: " + ", ".join(
            f"{m['kv']} {m['device_peak_bytes'] / 2**30:.2f} GiB" for m in methods
            if "device_peak_bytes" in m) + "."]
    if attention_line(methods):
        lines += ["", attention_line(methods)]
    if trace.get("shared_prefix_tokens") or any(m.get("prefix_sharing") for m in methods):
        lines += ["", _pages_line(methods, trace.get("shared_prefix_tokens", 0))]
    floor = results.get("agreement_floor")
    if floor and floor.get("compared") is not None:
        lines += ["", f"Floor of the agreement: {floor['kv']} run again with the requests in "
                  f"reverse order, all at once, gives {floor['identical']}/{floor['compared']} "
                  f"of its own answers again, median prefix {floor['prefix_median']:g} tokens "
                  f"({floor['prefix_share_median']:.0%}): batching alone parts greedy answers "
                  "this much."]
    elif floor:
        lines += ["", f"Floor of the agreement: {floor['kv']}'s second run {floor['failed']}."]
    lines += [
        "",
        "TTFT: arrival to first answer token; TPOT: first to last answer token over the tokens "
        "between; peak requests: most requests holding KV blocks at once."
        + (f" Same answer as {ref_name}: of the requests complete in both, those whose greedy "
           f"answer equals {ref_name}'s token for token; median prefix: tokens before the first "
           "difference (and their share of the answer)." if compared else "")
        + " Reproduce: `foscar "
        f"bench --serve --serve-kv {' '.join(m.get('kv_arg', m['kv']) for m in methods)} "
        f"--serve-requests {trace['num_requests']} --serve-rate {trace['rate']} "
        f"--serve-prompt-tokens {trace['prompt_tokens'][0]} {trace['prompt_tokens'][1]} "
        f"--serve-output-tokens {trace['output_tokens'][0]} {trace['output_tokens'][1]} "
        + (f"--serve-shared-prefix-tokens {trace['shared_prefix_tokens']} "
           if trace.get("shared_prefix_tokens") else "")
        + ("--serve-prefix-sharing "
           + ("both " if len({bool(m.get("prefix_sharing")) for m in methods}) > 1 else "on ")
           if any(m.get("prefix_sharing") for m in methods) else "")
        + f"--serve-prompts {'text' if prompts else 'random'} "
        f"--serve-seed {trace['seed']} --serve-memory-gb {results['memory_bytes'] / 1e9:.6g}`.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    """Bars per KV cache: throughput, TTFT, TPOT, peak concurrent requests. False (and no file)
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    methods = [m for m in results["methods"] if not not_measured(m)]
    if not methods:
        return False
    names = [m["kv"] for m in methods]
    x = list(range(len(methods)))
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = [
        ("answer tokens / s", [("", "output_tokens_per_s", 1.0)]),
        ("TTFT (ms)", [("median", "ttft_median_s", 1e3), ("p99", "ttft_p99_s", 1e3)]),
        ("TPOT (ms)", [("median", "tpot_median_s", 1e3), ("p99", "tpot_p99_s", 1e3)]),
        ("peak concurrent requests", [("", "peak_concurrent_requests", 1.0)]),
    ]
    for ax, (title, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for j, (label, key, scale) in enumerate(series):
            values = [(m[key] or 0) * scale for m in methods]
            offset = [i + (j - (len(series) - 1) / 2) * width for i in x]
            ax.bar(offset, values, width, label=label or None)
        ax.set_title(title)
        ax.set_xticks(x, names, rotation=20)
        if len(series) > 1:
            ax.legend(fontsize=8)
    trace = results["trace"]
    fig.suptitle(
        f"{results['model']} on {results['env']['device']}: {trace['num_requests']} requests, "
        f"{results['memory_bytes'] / 1e9:.3f} GB of KV memory each"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(results: dict, out: Path, name: str = "serve_bench") -> None:
    """``<name>.json``, ``.md`` and ``.png`` under ``out``."""
    (out / f"{name}.json").write_text(results_json(results))
    (out / f"{name}.md").write_text(markdown(results))
    plot(results, out / f"{name}.png")
