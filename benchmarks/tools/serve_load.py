"""A burst of concurrent requests against ``foscar serve``, with the official ``openai`` client and
no retries: every request must be answered, or refused with 429/503 and ``Retry-After``, or
cancelled by the client midway; afterwards nothing may be in flight and the KV pool must be empty.

    python benchmarks/tools/serve_load.py --out DIR [--requests 256] [-- SERVE ARGS...]

starts ``foscar serve`` (SmolLM2 by default; SERVE ARGS go to it, e.g. ``--kv int2`` or
``--model PATH``) on a free port, sends ``--waves`` bursts of ``--requests`` chats at once (half
streamed, every fourth cancelled midway: a stream closed after its third event, a JSON request
dropped after ``--cancel-after`` seconds), checks ``/stats`` after each, stops the server with
SIGINT and writes ``serve_load.json`` (the outcomes per wave, the server's stats and its peak
resident memory per wave). Exit status 1 if a request was lost (an error other than a refusal
with ``Retry-After``, a timeout, a reset) or the pool was not empty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_server(args: list[str], startup_s: float) -> tuple[subprocess.Popen, str, list[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "foscar", "serve", "--port", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()
    found: dict = {}

    def read():
        for line in proc.stderr:
            lines.append(line.rstrip())
            match = re.search(r"serving .* on (http://[\d.]+:\d+)", line)
            if match:
                found["url"] = match.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(startup_s)
    if "url" not in found:
        proc.kill()
        raise SystemExit("foscar serve did not start:\n" + "\n".join(lines[-20:]))
    return proc, found["url"], lines


async def one(client, openai, model: str, i: int, cancel: bool, max_tokens: int,
              cancel_after: float) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": f"Count to ten. ({i})"}],
            "max_tokens": max_tokens}
    try:
        if i % 2 == 0:
            events = await client.chat.completions.create(**body, stream=True)
            count = 0
            async for _ in events:
                count += 1
                if cancel and count == 3:
                    await events.close()
                    return "cancelled"
            return "answered"
        call = asyncio.ensure_future(client.chat.completions.create(**body))
        if cancel:
            done, _ = await asyncio.wait({call}, timeout=cancel_after)
            if not done:
                call.cancel()
                return "cancelled"
        await call
        return "answered"
    except openai.APIStatusError as e:
        if e.status_code in (429, 503) and e.response.headers.get("retry-after"):
            return f"refused_{e.status_code}"
        return f"lost: HTTP {e.status_code}"
    except Exception as e:  # a reset, a timeout: lost
        return f"lost: {type(e).__name__}"


async def wave(url: str, requests: int, max_tokens: int, cancel_after: float) -> list[str]:
    import httpx
    import openai

    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=os.environ.get("FOSCAR_API_KEY", "unused"), max_retries=0,
        timeout=600, http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=requests + 8,
                                max_keepalive_connections=requests + 8)),
    ) as client:
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one(client, openai, model, i, i % 4 == 3, max_tokens,
                                          cancel_after) for i in range(requests)))


def stats(url: str) -> dict:
    import httpx

    return httpx.get(url + "/stats", timeout=30).json()


def idle(url: str, timeout: float) -> tuple[bool, dict]:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)
        if s["server"]["in_flight"] == 0 and s["engine_requests"] == 0 and \
                s["kv_free_share"] == 1.0:
            return True, s
        if time.monotonic() > deadline:
            return False, s
        time.sleep(0.2)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of serve_load.json")
    parser.add_argument("--name", default="serve_load", help="the results file's name")
    parser.add_argument("--requests", type=int, default=256, help="requests per wave")
    parser.add_argument("--waves", type=int, default=3, help="bursts, one after another")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer tokens per request")
    parser.add_argument("--cancel-after", type=float, default=1.0,
                        help="seconds before a cancelled JSON request is dropped")
    parser.add_argument("--startup-s", type=float, default=600, help="wait for the server")
    args = parser.parse_args(argv)
    proc, url, log = start_server(serve_args, args.startup_s)
    waves, lost = [], False
    try:
        for w in range(args.waves):
            start = time.perf_counter()
            outcomes = asyncio.run(wave(url, args.requests, args.max_tokens, args.cancel_after))
            seconds = time.perf_counter() - start
            empty, after = idle(url, 120)
            counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
            lost |= not empty or any(k.startswith("lost") for k in counts)
            waves.append({"wave": w, "seconds": seconds, "outcomes": counts,
                          "pool_empty_after": empty, "stats_after": after,
                          "server_rss_mb": rss_mb(proc.pid)})
            print(f"wave {w}: {counts} in {seconds:.1f} s; pool empty after: {empty}; server "
                  f"RSS {waves[-1]['server_rss_mb']:.0f} MB", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/tools/serve_load.py " + " ".join(sys.argv[1:])
    (out / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "serve_args": serve_args, "requests": args.requests,
         "max_tokens": args.max_tokens, "waves": waves, "server_exit_status": code,
         "server_log_tail": log[-5:]}, indent=2))
    print(f"wrote {out / (args.name + '.json')}; server exit status {code}")
    return 1 if lost or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
