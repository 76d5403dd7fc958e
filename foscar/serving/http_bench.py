"""The HTTP layer's cost per streamed token, beside the engine called directly
(``foscar bench --serve --serve-http``).

The same batch of requests (``requests`` prompts of ``prompt_tokens`` seeded random token ids,
``new_tokens`` answer tokens each, greedy, no end-of-sequence token: every answer runs its full
length) goes through the engine twice per round:

- directly: ``manager.add_request(..., streaming=True)`` and ``get_result`` in this process, as
  the server's router reads them;
- through HTTP: ``POST /v1/completions`` with ``"stream": true`` from a client in another process
  (httpx, one connection per request) to a :class:`foscar.serving.server.ChatServer` on the same
  manager, every token a server-sent event.

Each answer's time per output token (TPOT: from its first token to its last, over the tokens
between) is measured where its tokens arrive (the direct reader, the HTTP client); the medians
give the decode step with and without HTTP. The HTTP layer's cost per streamed token is the
step's growth shared over the tokens of the step (``requests``), and ``share_of_step`` is that
cost over the direct step: the goal is under 2%.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["measure_http_overhead", "write_report", "run_http_bench"]


def _prompts(requests: int, prompt_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (requests, prompt_tokens), generator=generator)
    return ids.tolist()


def _tpot(first: float, last: float, tokens: int) -> float | None:
    return (last - first) / (tokens - 1) if tokens > 1 else None


def _direct_round(manager, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    """The batch straight through ``manager``: its TPOTs and wall time."""
    start = time.perf_counter()
    ids = [manager.add_request(p, request_id=f"{tag}-{i}", max_new_tokens=new_tokens,
                               streaming=True) for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    done = 0
    while done < len(ids):
        output = manager.get_result(timeout=60)
        if output is None:
            raise RuntimeError("the engine gave no output for 60 s")
        now = time.perf_counter()
        tokens = len(output.generated_tokens)
        if tokens:
            first.setdefault(output.request_id, now)
            last[output.request_id] = now
            count[output.request_id] = tokens
        done += output.is_finished()
    tpots = [_tpot(first[r], last[r], count[r]) for r in ids]
    return {"seconds": time.perf_counter() - start, "tpot_s": [t for t in tpots if t],
            "tokens": sum(count.values())}


#: the HTTP client, run by a fresh interpreter (it imports httpx alone, not torch): reads
#: {"url", "prompts", "new_tokens"} on stdin, writes the arrival times of each answer's events
_CLIENT = r"""
import asyncio, json, sys, time
import httpx

job = json.load(sys.stdin)

async def one(client, prompt):
    body = {"prompt": prompt, "max_tokens": job["new_tokens"], "stream": True,
            "temperature": 0}
    times = []
    async with client.stream("POST", job["url"] + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return times

async def main():
    limits = httpx.Limits(max_connections=len(job["prompts"]) + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        start = time.perf_counter()
        times = await asyncio.gather(*(one(client, p) for p in job["prompts"]))
        return time.perf_counter() - start, times

seconds, times = asyncio.run(main())
json.dump({"seconds": seconds, "times": times}, sys.stdout)
"""


def _http_round(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """The batch through HTTP, from a client in another process (module docstring)."""
    job = json.dumps({"url": url, "prompts": prompts, "new_tokens": new_tokens})
    done = subprocess.run([sys.executable, "-c", _CLIENT], input=job, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the HTTP client failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout)
    times = result["times"]
    return {"seconds": result["seconds"], "events": [len(t) for t in times],
            "tpot_s": [_tpot(t[0], t[-1], len(t)) for t in times if len(t) > 1]}


def measure_http_overhead(model, tokenizer, kv, *, requests: int = 32, prompt_tokens: int = 128,
                          new_tokens: int = 128, rounds: int = 3, seed: int = 0,
                          log=print, **manager_args) -> dict:
    """Direct and HTTP rounds of one batch (module docstring) on a manager of ``kv``
    (``manager_args``: :func:`foscar.serving.build_manager`'s sizes and ``cuda_graphs``)."""
    from . import build_manager
    from .server import ChatServer

    for name, value in (("requests", requests), ("prompt_tokens", prompt_tokens),
                        ("new_tokens", new_tokens), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if new_tokens < 3:
        raise ValueError(f"new_tokens must be >= 3 (a TPOT needs two tokens), got {new_tokens}")
    vocab = model.config.get_text_config().vocab_size
    # no end-of-sequence token: every answer runs new_tokens long
    manager = build_manager(model, kv, max_new_tokens=new_tokens, eos_token_id=vocab + 1,
                            pad_token_id=tokenizer.pad_token_id, **manager_args)
    prompts = _prompts(requests, prompt_tokens, vocab, seed)
    server = ChatServer(("127.0.0.1", 0), manager, tokenizer, model_id="bench",
                        max_pending=2 * requests)
    direct, http = [], []
    with torch.inference_mode():
        manager.start()
    try:
        _direct_round(manager, prompts, 4, "warmup")
        for r in range(rounds):
            direct.append(_direct_round(manager, prompts, new_tokens, f"direct{r}"))
            log(f"direct round {r}: {direct[-1]['seconds']:.2f} s")
        server.start()  # its router reads the engine's outputs from now on
        _http_round(server.url, prompts[:2], 4)
        for r in range(rounds):
            http.append(_http_round(server.url, prompts, new_tokens))
            log(f"HTTP round {r}: {http[-1]['seconds']:.2f} s")
    finally:
        server.stop()
    step_direct = statistics.median(t for d in direct for t in d["tpot_s"])
    step_http = statistics.median(t for h in http for t in h["tpot_s"])
    per_token = (step_http - step_direct) / requests
    return {
        "kv": str(kv), "requests": requests, "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens, "rounds": rounds, "device": str(model.device),
        "step_ms_direct": 1e3 * step_direct, "step_ms_http": 1e3 * step_http,
        "http_ms_per_token": 1e3 * per_token, "share_of_step": per_token / step_direct,
        "seconds_direct": [d["seconds"] for d in direct],
        "seconds_http": [h["seconds"] for h in http],
        "min_events_per_answer": min(min(h["events"]) for h in http),
    }


def write_report(results: list[dict], out: str | Path, name: str, command: str) -> Path:
    """``NAME.json`` and ``NAME.md`` under ``out``; returns the markdown's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"command": command, "results": results},
                                                 indent=2))
    lines = ["# HTTP layer cost per streamed token\n", f"`{command}`\n",
             "| KV | device | requests | decode step direct (ms) | through HTTP (ms) | "
             "HTTP per token (ms) | share of a step |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['kv']} | {r['device']} | {r['requests']} | "
                     f"{r['step_ms_direct']:.3f} | {r['step_ms_http']:.3f} | "
                     f"{r['http_ms_per_token']:.4f} | {100 * r['share_of_step']:.2f}% |")
    path = out / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_http_bench(model, tokenizer, kvs, *, out, name: str, command: str, log=print,
                   **kwargs) -> list[dict]:
    """:func:`measure_http_overhead` for each KV cache of ``kvs``, then the report."""
    results = []
    for kv in kvs:
        log(f"{kv}: HTTP beside the engine")
        results.append(measure_http_overhead(model, tokenizer, kv, log=log, **kwargs))
        r = results[-1]
        log(f"{kv}: step {r['step_ms_direct']:.2f} ms direct, {r['step_ms_http']:.2f} ms "
            f"through HTTP: {r['http_ms_per_token']:.4f} ms per token, "
            f"{100 * r['share_of_step']:.2f}% of a step")
    path = write_report(results, out, name, command)
    log(f"wrote {path}")
    return results
