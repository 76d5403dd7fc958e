"""An OpenAI-compatible HTTP server on a continuous-batching manager (``foscar serve``).

Endpoints:

- ``POST /v1/chat/completions``: a chat, answered as one JSON object, or with ``"stream": true``
  as server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``);
- ``GET /v1/models``: the one model served;
- ``GET /health``: ``{"status": "ok"}``, or HTTP 503 once the engine has stopped;
- ``GET /stats``: the KV pool (:meth:`foscar.serving.FoscarBatchingManager.kv_stats`), its free
  share, and the requests in flight, in the engine and in this server.

The manager is a transformers ``ContinuousBatchingManager`` (``start``, ``stop``,
``add_request``, ``cancel_request``, ``get_result``, and its logits processors, to which the
server adds per-request sampling: :mod:`foscar.serving.sampling`); a manager of
:func:`foscar.serving.build_manager` adds ``kv_stats`` and refuses, with ``ValueError``, a
request its pool can never hold, which the server answers with HTTP 400.

Sampling: ``temperature`` (0 to 2; 0 is greedy), ``top_p`` (0 to 1], ``top_k`` (0: all) and
``seed`` apply per request; a request that sets no ``temperature`` gets the server's (greedy by
default, where OpenAI's API samples at 1: a server answer is then reproducible without a
seed). A token depends only on the request's logits, seed and position: the same seed gives the
same answer wherever the logits are the same (they can move in the last bits with the batch a
request shares and after a preemption, which flips near-tied tokens).

Threads: the standard library's ``ThreadingHTTPServer`` runs each connection in a thread of its
own; one router thread reads the manager's outputs and puts each in its request's queue (the
manager's ``request_id_iter`` has every caller poll one shared queue and put back what is not
its own, which costs each token a pass over every waiting caller).

A client that disconnects (or stops reading a stream) midway has its request cancelled: the
engine frees its blocks (foscar's pages and window slot) at its next step, and the other
requests go on.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["ChatServer", "RequestRouter", "RequestError", "EngineStopped", "prompt_ids"]

logger = logging.getLogger("foscar.serving")

#: largest request body read, in bytes (a chat of this size is ~250K tokens)
MAX_BODY_BYTES = 1 << 20
#: how often a waiting request checks whether its client is still connected, in seconds
DISCONNECT_POLL_S = 0.2
#: OpenAI's range of temperature
MAX_TEMPERATURE = 2.0
#: most stop strings a request may give (OpenAI's limit)
MAX_STOPS = 4
#: penalties this server does not apply: accepted when 0 (what clients send by default)
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty")


class RequestError(ValueError):
    """A request the server refuses: ``status`` (an HTTP code), ``param`` (the field at fault,
    or None) and the message."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class EngineStopped(RuntimeError):
    """The manager's generation loop is not running (stopped, or died of an error)."""


_STOPPED = object()  # put in a request's queue when the engine stops under it


def _engine_error(manager) -> str | None:
    """Why ``manager`` cannot generate (None while it can)."""
    status = getattr(manager, "background_thread_status", None)
    fatal = getattr(status, "fatal_error", None)
    if fatal is not None:
        return f"the engine stopped after an error: {fatal}"
    is_running = getattr(manager, "is_running", None)
    if is_running is not None and not is_running():
        return "the engine is not running"
    return None


def _engine_cache(manager):
    """The engine's paged cache of the running loop, or None before it is built."""
    cache = getattr(manager, "cache", None)  # foscar's manager keeps it beside the engine's
    if cache is None:
        processor = getattr(manager, "batch_processor", None)
        cache = getattr(processor, "cache", None)
    return cache


def _free_share(cache) -> float | None:
    """Share of the engine's KV blocks that are free (transformers >= 5.24:
    ``compute_free_capacity``; 5.17: ``get_num_free_blocks``)."""
    if cache is None:
        return None
    if hasattr(cache, "compute_free_capacity"):
        return float(cache.compute_free_capacity())
    if hasattr(cache, "get_num_free_blocks"):
        return cache.get_num_free_blocks() / cache.num_blocks
    return None


class RequestRouter:
    """Submits requests to ``manager`` and hands each its own outputs.

    Parameters
    ----------
    manager : a started or unstarted continuous-batching manager (module docstring)
    max_positions : int, optional
        The model's positions: a request longer than this is refused before the engine sees it.
    eos_token_ids : set of int
        The tokens that end an answer (for ``finish_reason``).
    """

    def __init__(self, manager, *, max_positions: int | None = None,
                 eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.manager = manager
        self.max_positions = max_positions
        self.eos_token_ids = frozenset(eos_token_ids)
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_in_flight = 0
        self.finished = 0
        self.cancelled = 0
        self.stopped = 0  # finished ones the server ended at a stop string

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the manager (if it is not running) and the router thread."""
        is_running = getattr(self.manager, "is_running", None)
        if is_running is None or not is_running():
            self.manager.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._route, name="foscar-router", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the router and the manager; requests still waiting end with EngineStopped."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.manager.stop(block=True, timeout=timeout)
        self._fail_all()

    def engine_error(self) -> str | None:
        """Why the engine cannot take requests now (None while it can)."""
        if self._stop.is_set():
            return "the server is stopping"
        return _engine_error(self.manager)

    # ------------------------------------------------------------------ requests
    def capacity(self) -> int | None:
        """Most tokens (prompt and answer) one request can hold: the pool's and the model's
        limit, whichever is smaller (None: no known limit)."""
        limits = [self.max_positions] if self.max_positions else []
        kv_stats = getattr(self.manager, "kv_stats", None)
        if kv_stats is not None:
            limits.append(int(kv_stats()["max_tokens"]))
        return min(limits) if limits else None

    def submit(self, prompt: list[int], *, max_new_tokens: int, stream: bool,
               request_id: str, sampling: dict | None = None) -> queue.Queue:
        """Queue a request; returns the queue its outputs arrive in (the manager's outputs, or
        the sentinel of a stopped engine). ``sampling``: the request's arguments of
        :func:`foscar.serving.sampling.enable_sampling` (none: greedy). Raises RequestError (400)
        for a request the pool or the model can never hold, EngineStopped when the engine cannot
        take it."""
        limit = self.capacity()
        if limit is not None and len(prompt) + max_new_tokens > limit:
            raise RequestError(
                f"the request needs {len(prompt) + max_new_tokens} tokens ({len(prompt)} in the "
                f"messages + max_tokens {max_new_tokens}) but this server holds at most {limit} "
                "tokens per request; shorten the messages or lower max_tokens",
                param="messages",
            )
        error = self.engine_error()
        if error is not None:
            raise EngineStopped(error)
        outputs: queue.Queue = queue.Queue()
        with self._lock:
            self._queues[request_id] = outputs  # before add_request: an answer can come at once
            self.peak_in_flight = max(self.peak_in_flight, len(self._queues))
        try:
            accepted = self.manager.add_request(
                prompt, request_id=request_id, max_new_tokens=max_new_tokens, streaming=stream,
                **(sampling or {}),
            )
        except ValueError as e:  # the pool can never hold it (foscar's managers say so)
            self._forget(request_id)
            raise RequestError(str(e), param="messages") from None
        except Exception:
            self._forget(request_id)
            raise
        if accepted is None:  # the engine is stopping and dropped it
            self._forget(request_id)
            raise EngineStopped(self.engine_error() or "the engine is not taking requests")
        return outputs

    def cancel(self, request_id: str) -> None:
        """Cancel a request: the engine frees its blocks at its next step."""
        if self._forget(request_id):
            self.manager.cancel_request(request_id)
            with self._lock:
                self.cancelled += 1

    def done(self, request_id: str, *, early: bool = False) -> None:
        """A request whose last output was read; ``early``: the server ended it before the
        engine did (a stop string), so the engine cancels it and frees its blocks."""
        if self._forget(request_id):
            if early:
                self.manager.cancel_request(request_id)
            with self._lock:
                self.finished += 1
                self.stopped += early

    def in_flight(self) -> int:
        with self._lock:
            return len(self._queues)

    def _forget(self, request_id: str) -> bool:
        with self._lock:
            return self._queues.pop(request_id, None) is not None

    # ------------------------------------------------------------------ the router thread
    def _route(self) -> None:
        while not self._stop.is_set():
            output = self.manager.get_result(timeout=0.1)
            if output is None:
                if _engine_error(self.manager) is not None:
                    self._fail_all()
                    time.sleep(0.1)  # get_result returns at once when the loop is gone
                continue
            with self._lock:
                outputs = self._queues.get(output.request_id)
            if outputs is not None:  # None: cancelled, its last outputs are dropped
                outputs.put(output)

    def _fail_all(self) -> None:
        with self._lock:
            waiting = list(self._queues.values())
            self._queues.clear()
        for outputs in waiting:
            outputs.put(_STOPPED)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """``kv``: the pool's sizes (kv_stats, when the manager has it), ``kv_free_share``: share
        of its blocks free now; ``engine_requests``: requests holding blocks in the engine;
        ``server``: requests in flight here, their peak, finished ones (``stopped``: of them, those
        ended at a stop string, the engine told to cancel) and cancelled ones."""
        manager = self.manager
        kv_stats = getattr(manager, "kv_stats", None)
        cache = _engine_cache(manager)
        live = getattr(cache, "live_request_ids", None)
        with self._lock:
            server = {
                "in_flight": len(self._queues),
                "peak_in_flight": self.peak_in_flight,
                "finished": self.finished,
                "stopped": self.stopped,
                "cancelled": self.cancelled,
            }
        return {
            "kv": kv_stats() if kv_stats is not None else None,
            "kv_free_share": _free_share(cache),
            "engine_requests": None if live is None else len(live),
            "server": server,
        }


# ---------------------------------------------------------------------------- requests
def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, with the assistant's
    turn opened (``apply_chat_template`` returns a list in some transformers versions and a
    BatchEncoding in others)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                raise RequestError(
                    f"messages[{index}].content: only text parts "
                    '({"type": "text", "text": "..."}) are supported',
                    param="messages",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(
        f"messages[{index}].content must be a string or a list of text parts, got "
        f"{type(content).__name__}",
        param="messages",
    )


def _int_field(body: dict, name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
    if high is not None and value > high:
        raise RequestError(f"{name} must be an integer <= {high}, got {value!r}", param=name)
    return value


def _number_field(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise RequestError(f"{name} must be a number, got {value!r}", param=name)
    return float(value)


class ChatRequest:
    """A checked ``/v1/chat/completions`` body: ``messages`` (role and text), ``max_tokens``
    (None: the server's default), ``stream``, ``include_usage`` (stream_options), and the
    sampling fields ``temperature``, ``top_p``, ``top_k``, ``seed`` (None where not given: the
    server's defaults), ``stop`` (a list of strings, empty for none)."""

    def __init__(self, body, *, model_id: str) -> None:
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        messages = body.get("messages")
        if messages is None:
            raise RequestError("messages is missing: give a list of {role, content}",
                               param="messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content}",
                               param="messages")
        self.messages = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise RequestError(f"messages[{i}] must be an object with role and content",
                                   param="messages")
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise RequestError(f"messages[{i}].role must be a non-empty string",
                                   param="messages")
            if "content" not in message:
                raise RequestError(f"messages[{i}].content is missing", param="messages")
            self.messages.append({"role": role, "content": _message_text(message["content"], i)})
        model = body.get("model")
        if model is not None and model != model_id:
            raise RequestError(
                f"model {model!r} is not served here; this server serves {model_id!r}",
                status=404, param="model",
            )
        max_tokens = _int_field(body, "max_tokens", low=1)
        max_completion = _int_field(body, "max_completion_tokens", low=1)
        if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
            raise RequestError("max_tokens and max_completion_tokens differ; give one",
                               param="max_tokens")
        self.max_tokens = max_tokens if max_tokens is not None else max_completion
        n = _int_field(body, "n", low=1)
        if n not in (None, 1):
            raise RequestError(f"n must be 1 (one answer per request), got {n}", param="n")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise RequestError(f"stream must be true or false, got {stream!r}", param="stream")
        self.stream = stream
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
        self.include_usage = bool(options.get("include_usage", False))
        temperature = _number_field(body, "temperature")
        if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
            raise RequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                               f"{temperature!r}", param="temperature")
        self.temperature = temperature
        top_p = _number_field(body, "top_p")
        if top_p is not None and not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p!r}", param="top_p")
        self.top_p = top_p
        # the engine carries it as an int32 per row
        self.top_k = _int_field(body, "top_k", low=0, high=2**31 - 1)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(f"seed must be an integer, got {seed!r}", param="seed")
        self.seed = seed
        for name in PENALTY_FIELDS:
            value = _number_field(body, name)
            if value:
                raise RequestError(f"{name} is not supported by this server (0 or absent)",
                                   param=name)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (
            not isinstance(stop, list) or len(stop) > MAX_STOPS
            or not all(isinstance(x, str) and x for x in stop)
        ):
            raise RequestError(f"stop must be a non-empty string or a list of at most "
                               f"{MAX_STOPS} of them, got {stop!r}", param="stop")
        self.stop = stop or []
        for name in ("tools", "logprobs"):
            if body.get(name):
                raise RequestError(f"{name} is not supported by this server", param=name)
        response_format = body.get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise RequestError("response_format: only {\"type\": \"text\"} is supported",
                               param="response_format")


class _TextStream:
    """Text of a growing list of tokens, given out in pieces that never split a character (a
    byte-level token can carry half of one): each piece decodes a few tokens before the new ones,
    so the tokenizer's merging of spaces sees its context."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # tokens before this one are given out and need no context again
        self.read = 0  # tokens before this one are given out
        self.text = ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        """Take the answer's tokens so far; returns the text they add."""
        self.tokens = list(tokens)
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The text not given out yet (the whole answer's decode is the reference)."""
        full = self._decode(self.tokens)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += piece
        return piece


# ---------------------------------------------------------------------------- HTTP
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ChatServer

    # ------------------------------------------------------------------ plumbing
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        logger.debug("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str, param: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(
            status, {"error": {"message": message, "type": kind, "param": param, "code": status}}
        )

    def _client_gone(self) -> bool:
        """Whether the client closed its side (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a request body with a Content-Length header is required",
                               status=411)
        try:
            size = int(length)
        except ValueError:
            raise RequestError(f"Content-Length must be an integer, got {length!r}") from None
        if size < 0 or size > MAX_BODY_BYTES:
            raise RequestError(f"the request body must be at most {MAX_BODY_BYTES} bytes",
                               status=413)
        raw = self.rfile.read(size)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        path = self.path.split("?", 1)[0]
        server = self.server
        if path == "/health":
            error = server.router.engine_error()
            if error is None:
                self._send_json(200, {"status": "ok"})
            else:
                self._send_json(503, {"status": "unhealthy", "reason": error})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [server.model_card()]})
        elif path == "/stats":
            self._send_json(200, server.router.stats())
        else:
            self._send_error(404, f"no route GET {path}; routes: GET /v1/models, /health, "
                                  "/stats; POST /v1/chat/completions")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path != "/v1/chat/completions":
            self._send_error(404, f"no route POST {path}; POST /v1/chat/completions serves chats")
            return
        try:
            body = self._read_body()
            request = ChatRequest(body, model_id=self.server.model_id)
            self.server.chat(self, request)
        except RequestError as e:
            self.close_connection = True  # the body may be unread
            self._send_error(e.status, str(e), e.param)
        except EngineStopped as e:
            self._send_error(503, str(e))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client is gone; chat() cancelled its request

    def do_OPTIONS(self) -> None:  # noqa: N802
        self.send_response(204)
        self.send_header("Allow", "GET, POST, OPTIONS")
        self.send_header("Content-Length", "0")
        self.end_headers()


class ChatServer(ThreadingHTTPServer):
    """The HTTP server (module docstring).

    Parameters
    ----------
    address : (host, port); port 0 takes a free port (``server_address`` says which)
    manager : continuous-batching manager (module docstring); started by :meth:`start`
    tokenizer : the model's tokenizer, with a chat template
    model_id : the name ``/v1/models`` gives and requests may name
    default_max_tokens : tokens to generate for a request that sets no ``max_tokens`` (less
        where the pool holds less)
    max_positions : the model's positions, optional
    temperature, top_p : the sampling of a request that does not set them (default greedy:
        temperature 0; OpenAI's API defaults to 1). The server gives the manager per-request
        sampling (:func:`foscar.serving.sampling.enable_sampling`): a request's ``temperature``,
        ``top_p``, ``top_k`` and ``seed`` apply to it alone, and the same seed gives the same
        answer; a request without a seed draws one at random.

    Example
    -------
    >>> server = ChatServer(("127.0.0.1", 0), manager, tok, model_id="smollm2")
    >>> server.start()                    # the engine, and serving in a thread
    >>> server.url                        # 'http://127.0.0.1:41235'
    >>> server.stop()
    """

    daemon_threads = True  # a request still waiting does not keep the process alive
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], manager, tokenizer, *, model_id: str,
                 default_max_tokens: int = 256, max_positions: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0) -> None:
        from .sampling import enable_sampling

        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or (
            default_max_tokens < 1
        ):
            raise ValueError(f"default_max_tokens must be an int >= 1, got {default_max_tokens!r}")
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature!r}"
            )
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template: /v1/chat/completions needs one")
        if ":" in address[0]:  # an IPv6 address such as ::1
            self.address_family = socket.AF_INET6
        enable_sampling(manager)  # before the socket: a refusal leaves no port open
        super().__init__(address, _Handler)
        eos = getattr(manager, "generation_config", None)
        eos = getattr(eos, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.router = RequestRouter(manager, max_positions=max_positions, eos_token_ids=eos_ids)
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "foscar"}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine and serve in a background thread (:meth:`serve_forever` serves in
        the caller's thread instead, after :meth:`start_engine`)."""
        self.start_engine()
        self._thread = threading.Thread(target=self.serve_forever, name="foscar-http",
                                        daemon=True)
        self._thread.start()

    def start_engine(self) -> None:
        self.router.start()

    def stop(self) -> None:
        """Stop serving, then the engine (requests still waiting get HTTP 503)."""
        self.shutdown()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.router.stop()
        self.server_close()

    # ------------------------------------------------------------------ a chat
    def _max_new_tokens(self, request: ChatRequest, prompt: list[int]) -> int:
        if request.max_tokens is not None:
            return request.max_tokens
        limit = self.router.capacity()
        if limit is None or len(prompt) >= limit:
            return self.default_max_tokens  # the router refuses it with the numbers
        return min(self.default_max_tokens, limit - len(prompt))

    def sampling(self, request: ChatRequest) -> dict:
        """The engine's sampling arguments of ``request`` (empty: greedy)."""
        temperature = self.temperature if request.temperature is None else request.temperature
        if temperature == 0:
            return {}
        seed = request.seed
        if seed is None:  # drawn here, on the process that takes requests: every process
            seed = secrets.randbits(63)  # of a tensor-parallel engine gets it with the request
        return {
            "temperature": temperature,
            "top_p": self.top_p if request.top_p is None else request.top_p,
            "top_k": request.top_k or 0,
            "seed": seed,
        }

    def chat(self, handler: _Handler, request: ChatRequest) -> None:
        """Answer one checked chat request on ``handler``'s connection."""
        try:
            prompt = prompt_ids(self.tokenizer, request.messages)
        except Exception as e:  # the template's own checks (roles, order)
            raise RequestError(f"messages: the chat template refused them: {e}",
                               param="messages") from None
        max_new = self._max_new_tokens(request, prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        start = time.perf_counter()
        # stop strings are looked for in the answer as it grows, so its tokens come one by one
        outputs = self.router.submit(prompt, max_new_tokens=max_new,
                                     stream=request.stream or bool(request.stop),
                                     request_id=request_id, sampling=self.sampling(request))
        answer = _Answer(self, handler, request, request_id, len(prompt), max_new, start)
        try:
            if request.stream:
                answer.stream(outputs)
            else:
                answer.whole(outputs)
        finally:
            if answer.cancelled:
                self.router.cancel(request_id)
                logger.info("%s cancelled after %d tokens: %s; its KV blocks are freed",
                            request_id, answer.tokens, answer.cancelled)
            else:
                self.router.done(request_id, early=answer.stopped)


class _Answer:
    """One request's answer on its connection (JSON or a stream)."""

    def __init__(self, server: ChatServer, handler: _Handler, request: ChatRequest,
                 request_id: str, prompt_tokens: int, max_new_tokens: int, start: float) -> None:
        self.server = server
        self.handler = handler
        self.request = request
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.start = start
        self.created = int(time.time())
        self.tokens = 0
        self.first_token_s: float | None = None
        self.cancelled: str | None = None  # why, once it is
        self.stop = _StopText(request.stop)
        self.stopped = False  # ended at a stop string, before the engine ended it
        self.hit_stop = False  # the text was cut at a stop string

    def _next(self, outputs: queue.Queue, gone: Callable[[], bool]):
        """The next output, None once the client is gone (``self.cancelled`` says why)."""
        while True:
            try:
                output = outputs.get(timeout=DISCONNECT_POLL_S)
            except queue.Empty:
                if gone():
                    self.cancelled = "the client disconnected"
                    return None
                continue
            if output is _STOPPED:
                raise EngineStopped(self.server.router.engine_error() or "the engine stopped")
            error = getattr(output, "error", None)
            if error is not None:
                raise _GenerationFailed(str(error))
            tokens = len(output.generated_tokens)
            if tokens and self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.start
            self.tokens = tokens
            return output

    def _finish_reason(self, tokens: list[int]) -> str:
        if self.hit_stop or tokens and tokens[-1] in self.server.router.eos_token_ids:
            return "stop"
        return "length" if len(tokens) >= self.max_new_tokens else "stop"

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}

    def _log(self, mode: str) -> None:
        elapsed = time.perf_counter() - self.start
        first = "-" if self.first_token_s is None else f"{self.first_token_s:.2f} s"
        logger.info("%s: %d prompt + %d answer tokens in %.2f s (first token %s, %s)",
                    self.request_id, self.prompt_tokens, self.tokens, elapsed, first, mode)

    # ------------------------------------------------------------------ JSON
    def whole(self, outputs: queue.Queue) -> None:
        while True:
            try:
                output = self._next(outputs, self.handler._client_gone)
            except _GenerationFailed as e:
                self.handler._send_error(500, f"generation failed: {e}")
                return
            if output is None:
                return
            if output.is_finished():
                break
            if self.stop.stops:
                # the answer's last tokens only (each holds at least a byte of a stop string that
                # ends in them): the whole answer is decoded once, below
                tail = output.generated_tokens[-self.stop.tail_tokens:]
                text = self.server.tokenizer.decode(tail, skip_special_tokens=True)
                self.stopped = self.stop.end(text) is not None
                if self.stopped:
                    break
        tokens = list(output.generated_tokens)
        text = self.server.tokenizer.decode(tokens, skip_special_tokens=True)
        end = self.stop.end(text)
        if end is not None:
            text, self.hit_stop = text[:end], True
        self.handler._send_json(200, {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.server.model_id,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": self._finish_reason(tokens),
            }],
            "usage": self._usage(),
        })
        self._log("json")

    # ------------------------------------------------------------------ stream
    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.server.model_id,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }

    def _event(self, payload) -> bool:
        """Send one event; False (and the request cancelled) if the client is gone."""
        data = payload if isinstance(payload, str) else json.dumps(payload)
        try:
            self.handler.wfile.write(f"data: {data}\n\n".encode())
            self.handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.cancelled = "the client disconnected"
            return False
        return True

    def stream(self, outputs: queue.Queue) -> None:
        handler = self.handler
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Connection", "close")  # the stream ends where the connection does
        handler.end_headers()
        handler.close_connection = True
        if not self._event(self._chunk({"role": "assistant", "content": ""})):
            return
        text = _TextStream(self.server.tokenizer)
        sent = 0  # characters given out, with stop strings
        while True:
            try:
                output = self._next(outputs, handler._client_gone)
            except _GenerationFailed as e:
                self._event({"error": {"message": f"generation failed: {e}",
                                       "type": "server_error", "param": None, "code": 500}})
                return
            except EngineStopped as e:
                self._event({"error": {"message": str(e), "type": "server_error",
                                       "param": None, "code": 503}})
                return
            if output is None:
                return
            finished = output.is_finished()
            piece = text.push(output.generated_tokens)
            if finished:
                piece += text.finish()
            if self.stop.stops:
                shown = self.stop.shown(text.text, finished)
                piece = shown[sent:]
                sent = len(shown)
                self.hit_stop = self.stop.end(text.text) is not None
                self.stopped = self.hit_stop and not finished
            if piece and not self._event(self._chunk({"content": piece})):
                return
            if finished or self.stopped:
                break
        tokens = list(output.generated_tokens)
        if not self._event(self._chunk({}, self._finish_reason(tokens))):
            return
        if self.request.include_usage:
            usage = {**self._chunk({}), "choices": [], "usage": self._usage()}
            if not self._event(usage):
                return
        if self._event("[DONE]"):
            self._log("stream")


class _StopText:
    """Where an answer's text ends for a request's stop strings (OpenAI: the answer ends before
    the first of them, which is not returned)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        #: answer tokens that hold any stop string ending in the last one (a token carries at
        #: least one byte of text; a character at most 4)
        self.tail_tokens = 4 * max((len(s) for s in stops), default=0) + 1

    def end(self, text: str) -> int | None:
        """Index of the first stop string in ``text``, None without one."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def shown(self, text: str, final: bool) -> str:
        """The part of ``text`` a stream may give out now: up to a stop string; before it, all
        but a tail that could still grow into one (all of it once the answer is ``final``)."""
        end = self.end(text)
        if end is not None:
            return text[:end]
        if final:
            return text
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]


class _GenerationFailed(RuntimeError):
    """The engine failed this request (its output carries the error)."""

