"""The decode phase of the continuous-batching engine, timed step by step, beside each step's
byte limit.

Per KV cache: ``batch`` requests of ``context`` tokens (prompt plus answer) go in at once; the
engine prefills them (untimed), and once every request decodes, each step is one token for each
of the ``batch`` rows. The first ``warmup_steps`` of those steps are untimed (they capture the
engine's CUDA graph of that batch, and compile what the first steps compile); the next ``steps``
are timed: the interval between the starts of consecutive steps, which is the engine's whole
step (scheduling, the forward, sampling, the bookkeeping). Then every request is cancelled.

Reported per row: step time (median, p99), tokens per second (``batch`` over the median step),
the batch, and the step's byte limit: (weight bytes + KV bytes the step reads) / the device's
copy bandwidth, measured in the same process by a large device-to-device copy
(:func:`copy_bandwidth`). Weight bytes: every parameter but the input embeddings (a step reads
``batch`` rows of those). KV bytes: each row's stored tokens at the step, at the cache's bytes per
token (foscar: its quantized history, and its BF16 windows at BF16's).

Two comparisons (:func:`run_decode_benchmark`): ``same-memory`` gives every cache the same KV
memory and as many requests as it holds (capacity turned into throughput); ``same-batch`` gives
every cache the same batch (the speed of a step).

A torch profile of the timed steps (``profile_dir``) is summarized in a short Markdown file: the
kernels that took the most device time, the host operations that took the most host time
(:func:`profile_summary`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .bench import not_measured, percentile

__all__ = [
    "COMPARISONS",
    "copy_bandwidth",
    "profile_summary",
    "run_decode_benchmark",
    "run_decode_phase",
    "weight_bytes",
]

COMPARISONS = ("same-memory", "same-batch")


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read and written: 2 bytes
    moved per byte copied), the median of ``repeats`` copies after one untimed."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        if i:
            times.append(seconds)
    del src, dst
    return 2 * (nbytes // 4) * 4 / sorted(times)[len(times) // 2]


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads: all but the input embeddings (unless they
    are tied to the output head, which reads them whole)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


class _StepRecorder:
    """Records every step of a manager's engine: its start, its rows ``(past, new)``; starts
    and stops a torch profile around the timed steps when asked."""

    def __init__(self, batch: int, warmup_steps: int, steps: int, profile: bool) -> None:
        self.batch, self.warmup_steps, self.steps = batch, warmup_steps, steps
        self.profile = profile
        self.profiler = None
        self.pending: list[tuple[int, int]] = []
        self.full_steps: list[tuple[float, list[tuple[int, int]]]] = []  # (start, rows)
        self.done = False

    def attach(self, manager) -> None:
        create = manager._create_batch_processor

        def create_and_record():
            processor = create()
            self._hook(processor)
            return processor

        manager._create_batch_processor = create_and_record

    def _hook(self, processor) -> None:
        cache, runner = processor.cache, processor.model_runner
        extend, compute = cache.extend_read_and_write_indices, runner.compute_batch

        def extend_recorded(request_id, past_length, query_length, *args, **kwargs):
            self.pending.append((past_length, query_length))
            return extend(request_id, past_length, query_length, *args, **kwargs)

        def compute_recorded(*args, **kwargs):
            rows, self.pending = self.pending, []
            full = len(rows) == self.batch and all(p and q == 1 for p, q in rows)
            if full and not self.done:
                self.full_steps.append((time.perf_counter(), rows))
                n = len(self.full_steps)
                if self.profile and n == self.warmup_steps + 1:
                    self._start_profile()
                if n == self.warmup_steps + self.steps + 1:  # its start ends the last timed one
                    self.done = True
                    self._stop_profile()
            return compute(*args, **kwargs)

        cache.extend_read_and_write_indices = extend_recorded
        runner.compute_batch = compute_recorded

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()

    def _stop_profile(self) -> None:
        if self.profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)

    def timed_intervals(self) -> tuple[list[float], list[list[tuple[int, int]]]]:
        """The timed steps' durations (start to next start) and their rows."""
        timed = self.full_steps[self.warmup_steps : self.warmup_steps + self.steps + 1]
        return ([b[0] - a[0] for a, b in zip(timed, timed[1:])], [rows for _, rows in timed[:-1]])


def kv_read_bytes(rows: Sequence[tuple[int, int]], stats: dict, bf16_per_token: int,
                   window_tokens: int) -> int:
    """KV bytes a step of ``rows`` reads: each row's stored tokens after the step's write
    (foscar: the first ``window_tokens`` of a request at BF16's bytes, the rest quantized)."""
    total = 0
    for past, new in rows:
        held = past + new
        windowed = min(held, window_tokens)
        total += windowed * bf16_per_token + (held - windowed) * stats["bytes_per_token"]
    return int(total)


def _window_tokens(manager) -> int:
    formats = manager.pool_sizes.kv.formats
    return 0 if formats is None else formats[0].sink_tokens + formats[0].recent_tokens


def run_decode_phase(model, kv, *, batch: int, context: int, memory_bytes: int | None = None,
                     num_blocks: int | None = None, steps: int = 32, warmup_steps: int = 8,
                     block_size: int | None = None, cuda_graphs: bool | None = None,
                     max_batch_tokens: int | None = None, max_seconds: float = 600.0,
                     bandwidth: float | None = None, profile_path: Path | None = None,
                     seed: int = 0) -> dict:
    """One KV cache's decode phase (module docstring): ``batch`` requests of ``context`` tokens
    (random prompt ids, seeded), ``steps`` timed steps after ``warmup_steps``.

    The pool is ``memory_bytes`` or ``num_blocks`` (``build_manager``'s); a foscar cache holds
    ``batch`` window slots. Returns the row, ``{"refused": reason}`` where the manager refuses
    the cache or the pool cannot hold ``batch`` requests, or ``{"failed": reason}``.
    """
    from . import build_manager

    for name, value in (("batch", batch), ("context", context), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    text = model.config.get_text_config()
    # answers long enough to outlast the prefill of the others (one step per chunk, counted
    # at 2048 tokens a chunk where the engine's budget is its own: 8192 by default), the
    # warm-up and the timed steps
    answer = (warmup_steps + steps + 2 * batch + 16
              + math.ceil(batch * context / (max_batch_tokens or 2048)))
    prompt = context - answer
    if prompt < 1:
        raise ValueError(f"context={context} leaves no prompt beside {answer} answer tokens")
    try:
        manager = build_manager(model, kv, memory_bytes=memory_bytes, num_blocks=num_blocks,
                                block_size=block_size, max_new_tokens=answer,
                                cuda_graphs=cuda_graphs, max_batch_tokens=max_batch_tokens,
                                max_requests=None if _is_engine_cache(kv) else batch,
                                request_tokens=context)
    except ValueError as e:
        return {"refused": " ".join(str(e).split())}
    fits = manager.concurrent_requests(context)["kv"]
    if fits < batch:
        return {"refused": f"the pool holds {fits} requests of {context} tokens, not {batch}"}
    recorder = _StepRecorder(batch, warmup_steps, steps, profile_path is not None)
    recorder.attach(manager)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(model.device)
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, text.vocab_size, (prompt,), generator=g).tolist()
           for _ in range(batch)]
    start = time.perf_counter()
    failure = None
    with torch.inference_mode():
        manager.start()
    try:
        for i, prompt_ids in enumerate(ids):
            manager.add_request(prompt_ids, request_id=f"decode-{i}", max_new_tokens=answer,
                                eos_token_id=-1)
        while not recorder.done:
            fatal = getattr(getattr(manager, "background_thread_status", None), "fatal_error",
                            None)
            if fatal is not None:
                failure = f"the engine stopped: {fatal}"
                break
            if time.perf_counter() - start > max_seconds:
                failure = (f"{len(recorder.full_steps)} of {warmup_steps + steps + 1} full decode "
                           f"steps after {max_seconds:.0f} s")
                break
            manager.get_result(timeout=0.05)  # drain the outputs as a client would
        for i in range(batch):
            manager.cancel_request(f"decode-{i}")
    finally:
        manager.stop(block=True)
    if failure is not None:
        return {"failed": failure}
    intervals, rows = recorder.timed_intervals()
    stats = manager.kv_stats()
    text_bf16 = 2 * text.num_hidden_layers * _kv_heads(text) * _head_dim(text) * 2
    kv_bytes = [kv_read_bytes(r, stats, text_bf16, _window_tokens(manager)) for r in rows]
    weights = weight_bytes(model)
    bandwidth = bandwidth or copy_bandwidth(model.device)
    median = percentile(intervals, 50)
    kv_median = percentile(kv_bytes, 50)
    limit = (weights + kv_median) / bandwidth
    result = {
        "batch": batch, "context": context, "prompt_tokens": prompt, "steps": len(intervals),
        "warmup_steps": warmup_steps, "step_median_s": median,
        "step_p99_s": percentile(intervals, 99), "tokens_per_s": batch / median,
        "weight_bytes": weights, "kv_read_bytes": kv_median, "copy_bandwidth": bandwidth,
        "byte_limit_s": limit, "limit_ratio": median / limit,
        "mean_stored_tokens": sum(p + q for r in rows for p, q in r) / max(1, len(rows) * batch),
        "pool": stats, "attention": stats.get("attention"),
        "graph_steps": getattr(manager.cache, "graph_steps", None),
        "seconds": time.perf_counter() - start,
    }
    if cuda:
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated(model.device)
    if recorder.profiler is not None:
        profile_path.write_text(profile_summary(recorder.profiler, len(intervals),
                                                title=f"{stats['kv']}, batch {batch}, context "
                                                f"{context}, CUDA graphs {cuda_graphs}"))
        result["profile"] = profile_path.name
    return result


def _is_engine_cache(kv) -> bool:
    return isinstance(kv, str) and kv.lower() in ("bf16", "sdpa-bf16", "flashinfer-bf16",
                                                  "flashinfer-fp8")


def _kv_heads(text) -> int:
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def profile_summary(profiler, steps: int, *, title: str, top: int = 15) -> str:
    """A short Markdown summary of a torch profile over ``steps`` steps: the kernels with the
    most device time, the host operations with the most self host time (per step)."""
    events = profiler.key_averages()

    def device_time(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    lines = [f"# Profile: {title}", "", f"{steps} timed steps; times per step.", ""]
    kernels = sorted((e for e in events if device_time(e) > 0 and e.device_type is not None
                      and "cuda" in str(e.device_type).lower()),
                     key=device_time, reverse=True)
    total_device = sum(device_time(e) for e in kernels)
    lines += [f"Device time: {total_device / steps / 1e3:.3f} ms per step.", "",
              "| kernel | calls/step | ms/step | share |", "|---|---|---|---|"]
    for e in kernels[:top]:
        lines.append(f"| `{_short(e.key)}` | {e.count / steps:.1f} "
                     f"| {device_time(e) / steps / 1e3:.3f} "
                     f"| {device_time(e) / max(total_device, 1):.0%} |")
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    total_host = sum(e.self_cpu_time_total for e in events)
    lines += ["", f"Host time (self, every thread): {total_host / steps / 1e3:.3f} ms per step.",
              "", "| host operation | calls/step | ms/step |", "|---|---|---|"]
    for e in host[:top]:
        lines.append(f"| `{_short(e.key)}` | {e.count / steps:.1f} "
                     f"| {e.self_cpu_time_total / steps / 1e3:.3f} |")
    return "\n".join(lines) + "\n"


def _short(name: str, width: int = 90) -> str:
    name = name.replace("|", "/").replace("`", "'")
    return name if len(name) <= width else name[: width - 3] + "..."


def run_decode_benchmark(model, kvs: Sequence, *, context: int, comparisons: Sequence[str],
                         memory_bytes: int, batch: int, max_batch: int = 256,
                         steps: int = 32, warmup_steps: int = 8, block_size: int | None = None,
                         cuda_graphs: Sequence[bool | None] = (None,),
                         max_batch_tokens: int | None = None, max_seconds: float = 600.0,
                         profile_dir: Path | None = None,
                         log: Callable[[str], None] = print,
                         on_row: Callable[[dict], None] | None = None) -> dict:
    """Every cache of ``kvs`` through :func:`run_decode_phase` at ``context`` for each of
    ``comparisons`` and ``cuda_graphs`` setting: ``same-memory`` with ``memory_bytes`` of KV and
    as many requests as it holds (at most ``max_batch``), ``same-batch`` with ``batch`` requests
    and the pages they need. Returns ``{"bandwidth": ..., "rows": [...]}`` (one per cache,
    comparison and setting; each names them); ``on_row(row)`` sees each row as it is measured
    (a caller writes its results after each, so a run cut short keeps what it measured)."""
    from .kv_spec import resolve_kv

    bad = [c for c in comparisons if c not in COMPARISONS]
    if bad or not comparisons:
        raise ValueError(f"comparisons must be taken from {COMPARISONS}, got {list(comparisons)}")
    text = model.config.get_text_config()
    bandwidth = copy_bandwidth(model.device)
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, weights {weight_bytes(model) / 1e9:.2f} GB")
    rows = []
    for comparison in comparisons:
        for graphs in cuda_graphs:
            for kv in kvs:
                label = resolve_kv(kv, num_layers=text.num_hidden_layers,
                                   head_dim=_head_dim(text)).label
                size = _sizes(model, kv, comparison, context=context, memory_bytes=memory_bytes,
                              batch=batch, max_batch=max_batch, block_size=block_size,
                              steps=steps, warmup_steps=warmup_steps,
                              max_batch_tokens=max_batch_tokens)
                path = None
                if profile_dir is not None:
                    graphs_name = {True: "on", False: "off", None: "auto"}[graphs]
                    path = Path(profile_dir) / (f"profile_{label}_{context}_{comparison}_graphs-"
                                                f"{graphs_name}.md")
                row = ({"refused": size["refused"]} if "refused" in size else run_decode_phase(
                    model, kv, context=context, steps=steps, warmup_steps=warmup_steps,
                    block_size=block_size, cuda_graphs=graphs, max_batch_tokens=max_batch_tokens,
                    max_seconds=max_seconds, bandwidth=bandwidth, profile_path=path, **size))
                row.update(kv=label, comparison=comparison, cuda_graphs=graphs, context=context)
                rows.append(row)
                log(f"{comparison}, graphs {graphs}, {label}: {row_line(row)}")
                if on_row is not None:
                    on_row(row)
    return {"copy_bandwidth": bandwidth, "weight_bytes": weight_bytes(model), "rows": rows}


def _sizes(model, kv, comparison: str, *, context: int, memory_bytes: int, batch: int,
           max_batch: int, block_size, steps: int, warmup_steps: int,
           max_batch_tokens) -> dict:
    """``run_decode_phase``'s batch and pool for a comparison: the most requests
    ``memory_bytes`` holds, or ``batch`` requests and their pages."""
    from . import build_manager

    try:
        probe = build_manager(model, kv, memory_bytes=memory_bytes, block_size=block_size,
                              request_tokens=context, max_batch_tokens=max_batch_tokens)
    except ValueError as e:
        return {"refused": " ".join(str(e).split())}
    if comparison == "same-memory":
        fits = min(max_batch, probe.concurrent_requests(context)["kv"])
        if fits < 1:
            return {"refused": f"{memory_bytes / 1e9:.2f} GB hold no request of {context} tokens"}
        return {"batch": fits, "memory_bytes": memory_bytes}
    blocks_per_request = math.ceil(context / probe.pool_sizes.block_size)
    return {"batch": batch, "num_blocks": batch * blocks_per_request + batch}


def row_line(row: dict) -> str:
    """One log line of a row."""
    if not_measured(row):
        return not_measured(row)
    peak = row.get("device_peak_bytes")
    return (f"batch {row['batch']}, step {row['step_median_s'] * 1e3:.2f} / "
            f"{row['step_p99_s'] * 1e3:.2f} ms (median / p99), {row['tokens_per_s']:.0f} tokens/s, "
            f"byte limit {row['byte_limit_s'] * 1e3:.2f} ms ({row['limit_ratio']:.2f}x)"
            + ("" if peak is None else f", device peak {peak / 2**30:.1f} GiB"))


def markdown_rows(rows: Sequence[dict]) -> list[str]:
    """The rows as a Markdown table."""
    lines = ["| context | comparison | CUDA graphs | KV cache | batch | step median (ms) "
             "| step p99 (ms) | tokens/s | byte limit (ms) | step / limit | KV read (GB) "
             "| device peak (GiB) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        graphs = {True: "on", False: "off", None: "auto"}[r["cuda_graphs"]]
        head = f"| {r['context']} | {r['comparison']} | {graphs} | {r['kv']} |"
        if not_measured(r):
            lines.append(head + f" {not_measured(r)} |" + " |" * 7)
            continue
        peak = r.get("device_peak_bytes")
        peak_text = "-" if peak is None else f"{peak / 2**30:.1f}"
        lines.append(
            head + f" {r['batch']} | {r['step_median_s'] * 1e3:.2f} | {r['step_p99_s'] * 1e3:.2f} "
            f"| {r['tokens_per_s']:.0f} | {r['byte_limit_s'] * 1e3:.2f} | {r['limit_ratio']:.2f}x "
            f"| {r['kv_read_bytes'] / 1e9:.3f} | {peak_text} |")
    return lines
