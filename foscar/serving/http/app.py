"""The FastAPI application of ``foscar serve`` (routes in :mod:`foscar.serving.http`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import child_request_ids
from .answers import Choice, GenerationFailed, Job
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from .router import STOPPED, Busy, EngineStopped, RequestError, RequestRouter
from .text import StopText, TextStream, prompt_ids

__all__ = ["ServingState", "create_app", "MAX_BODY_BYTES"]

logger = logging.getLogger("foscar.serving")

#: largest request body read, in bytes (a chat of this size is ~250K tokens)
MAX_BODY_BYTES = 1 << 20
#: seconds a client refused for want of room is told to wait
RETRY_AFTER_S = 1
#: fields the sampler applies on the host, refused where the engine replays CUDA graphs
HOST_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
               "logprobs")


class ServingState:
    """What the routes share: the router (and its manager), the tokenizer, the metrics, and the
    server's settings (:class:`foscar.serving.server.ChatServer` documents them)."""

    def __init__(self, router: RequestRouter, tokenizer, *, model_id: str,
                 default_max_tokens: int, temperature: float, top_p: float,
                 api_key: str | None, logprob_sink, host_fields: bool, vocab_size: int) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.api_key = api_key
        self.sink = logprob_sink
        self.host_fields = host_fields
        self.vocab_size = vocab_size
        self.created = int(time.time())
        self.metrics = ServerMetrics(router.stats)

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "foscar"}


# ---------------------------------------------------------------------------- errors
def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind, code = "invalid_request_error", code or "invalid_api_key"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else code}}


def error_response(status: int, message: str, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    error = exc.errors()[0]
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    kind, message = error.get("type", ""), error.get("msg", "invalid")
    if kind == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {message}")
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return error_response(400, "the request body must be a JSON object")
    message = message.removeprefix("Value error, ")
    param = loc[0] if loc else None
    if param is None and ":" in message:  # a check across fields names its field first
        param = message.split(":", 1)[0]
    if kind == "extra_forbidden":
        message = "this server does not take this field"
    elif kind == "missing":
        message = "is missing"
    where = ".".join(loc)
    return error_response(400, f"{where}: {message}" if where else message, param)


class BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes gets 413 (declared, or as it arrives); every
    body is read as JSON, whatever its Content-Type says (``curl -d`` sends a form's)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.limit:
                    return await self._refuse(send)
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(
            413, f"the request body must be at most {self.limit} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


# ---------------------------------------------------------------------------- requests
def _sampling(state: ServingState, request: SamplingFields, logprobs: int | None) -> dict:
    """The engine's sampling arguments of a prompt's first choice (none: greedy and
    unadjusted); its other choices, forks of it, draw with ``seed + i``."""
    args: dict = {}
    temperature = state.temperature if request.temperature is None else request.temperature
    if temperature > 0:
        seed = request.seed
        # drawn here, on the process that takes requests: every process of a tensor-parallel
        # engine gets it with the request
        seed = secrets.randbits(63) if seed is None else seed
        args.update(temperature=float(temperature), seed=seed,
                    top_p=float(state.top_p if request.top_p is None else request.top_p),
                    top_k=max(request.top_k or 0, 0), min_p=float(request.min_p or 0.0))
    if request.presence_penalty:
        args["presence_penalty"] = float(request.presence_penalty)
    if request.frequency_penalty:
        args["frequency_penalty"] = float(request.frequency_penalty)
    if request.repetition_penalty != 1.0:
        args["repetition_penalty"] = float(request.repetition_penalty)
    if request.logit_bias:
        args["logit_bias"] = {int(k): float(v) for k, v in request.logit_bias.items()}
    if logprobs is not None:
        args["logprobs"] = int(logprobs)
    return args


def _check_fields(state: ServingState, request: SamplingFields, logprobs: int | None) -> None:
    if request.model is not None and request.model != state.model_id:
        raise RequestError(f"model {request.model!r} is not served here; this server serves "
                           f"{state.model_id!r}", status=404, param="model")
    if not state.host_fields:
        used = {"presence_penalty": request.presence_penalty != 0,
                "frequency_penalty": request.frequency_penalty != 0,
                "repetition_penalty": request.repetition_penalty != 1,
                "logit_bias": bool(request.logit_bias), "logprobs": logprobs is not None}
        for name in HOST_FIELDS:
            if used[name]:
                raise RequestError(f"{name} is not available while the engine replays CUDA "
                                   "graphs (serve without --cuda-graphs)", param=name)
    for key in request.logit_bias or {}:
        if int(key) >= state.vocab_size:
            raise RequestError(f"logit_bias: token {key} is not in the vocabulary of "
                               f"{state.vocab_size}", param="logit_bias")
    for token in request.stop_token_ids or ():
        if token >= state.vocab_size:
            raise RequestError(f"stop_token_ids: token {token} is not in the vocabulary of "
                               f"{state.vocab_size}", param="stop_token_ids")


def _max_new_tokens(state: ServingState, asked: int | None, prompt_tokens: int) -> int:
    if asked is not None:
        return asked
    limit = state.router.capacity()
    if limit is None or prompt_tokens >= limit:
        return state.default_max_tokens  # the router refuses it with the numbers
    return min(state.default_max_tokens, limit - prompt_tokens)


def _completion_prompts(state: ServingState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    ids = []
    for p in prompt:
        if isinstance(p, str):
            ids.append(list(state.tokenizer.encode(p)))
        else:
            if max(p) >= state.vocab_size:
                raise RequestError(f"prompt: token {max(p)} is not in the vocabulary of "
                                   f"{state.vocab_size}", param="prompt")
            ids.append(list(p))
        if not ids[-1]:
            raise RequestError("prompt: the text has no tokens", param="prompt")
    return ids


def _start_job(state: ServingState, kind: str, request, prompts: list[list[int]],
               param: str) -> tuple[Job, asyncio.Queue]:
    """Check, admit and submit every choice of a request; returns its job and output queue."""
    router = state.router
    logprobs = request.logprob_alternatives()
    _check_fields(state, request, logprobs)
    asked = request.answer_tokens()
    lengths = [_max_new_tokens(state, asked, len(p)) for p in prompts]
    for prompt, max_new in zip(prompts, lengths):
        router.check(len(prompt), max_new, param)
    router.admit(len(prompts) * request.n)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    job = Job(kind, f"{prefix}-{uuid.uuid4().hex[:24]}", state.model_id, state.tokenizer,
              logprobs)
    outputs: asyncio.Queue = asyncio.Queue()
    stops = request.stops()
    stop_ids = frozenset(request.stop_token_ids or ())
    try:
        for p, (prompt, max_new) in enumerate(zip(prompts, lengths)):
            # one engine request a prompt, forked into its other n - 1 choices once its prompt
            # is prefilled (choice i draws with seed + i: foscar.serving.sampling)
            first = f"{job.request_id}-{p * request.n}"
            ids = [first, *child_request_ids(first, request.n - 1)]
            for i, request_id in enumerate(ids):
                choice = Choice(p * request.n + i, request_id, len(prompt), max_new,
                                TextStream(state.tokenizer), StopText(stops), stop_ids,
                                router.eos_token_ids)
                job.add(choice, new_prompt=i == 0)
                if logprobs is not None:
                    state.sink.watch(request_id)
            router.submit(prompt, max_new_tokens=max_new, stream=True, request_id=first,
                          outputs=outputs, sampling=_sampling(state, request, logprobs),
                          num_children=request.n - 1)
    except BaseException:
        _end_job(state, job, cancelled=True)
        raise
    state.metrics.prompt_tokens.inc(job.prompt_tokens)
    return job, outputs


def _end_job(state: ServingState, job: Job, *, cancelled: bool, why: str = "") -> None:
    """Release every choice's engine request (cancel those not ended) and record them."""
    elapsed = time.perf_counter() - job.start
    endpoint = "/v1/chat/completions" if job.kind == "chat" else "/v1/completions"
    for c in job.choices.values():
        if c.finished and not cancelled:
            state.router.done(c.request_id, early=c.early)
            outcome = c.finish_reason()
        else:
            state.router.cancel(c.request_id)
            outcome = "cancelled" if why != "error" else "error"
        state.sink.forget(c.request_id)
        state.metrics.answer(endpoint, outcome, first_token_s=c.first_token_s,
                             elapsed_s=elapsed, tokens=len(c.tokens))
    if cancelled and why:
        logger.info("%s %s; its KV blocks are freed", job.request_id, why)
    else:
        usage = job.usage()
        logger.info("%s: %d prompt + %d answer tokens in %.2f s", job.request_id,
                    usage["prompt_tokens"], usage["completion_tokens"], elapsed)


async def _next_output(state: ServingState, job: Job, outputs: asyncio.Queue):
    """The next output of a choice not yet finished: (choice, output)."""
    while True:
        output = await outputs.get()
        if output is STOPPED:
            raise EngineStopped(state.router.engine_error() or "the engine stopped")
        choice = job.choices.get(output.request_id)
        if choice is None or choice.finished:
            continue  # a choice ended here (stop string) may have one more in flight
        error = getattr(output, "error", None)
        if error is not None:
            raise GenerationFailed(str(error))
        return choice, output


def _update(state: ServingState, job: Job, choice: Choice, output) -> str:
    """``choice.update``; a choice ended here (a stop) is released from the engine at once,
    while its request's other choices go on."""
    piece = choice.update(output, job.start)
    if choice.finished and choice.early:
        state.router.done(choice.request_id, early=True)
    return piece


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _whole(state: ServingState, job: Job, outputs: asyncio.Queue,
                 request: Request) -> Response:
    async def collect():
        while not all(c.finished for c in job.choices.values()):
            choice, output = await _next_output(state, job, outputs)
            _update(state, job, choice, output)

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            _end_job(state, job, cancelled=True, why="cancelled: the client disconnected")
            return Response(status_code=499)
        try:
            work.result()
        except GenerationFailed as e:
            _end_job(state, job, cancelled=True, why="error")
            return error_response(500, f"generation failed: {e}")
        except EngineStopped:
            _end_job(state, job, cancelled=True, why="error")
            raise
        body = job.whole(lambda c: state.sink.take(c.request_id, len(c.tokens)))
        _end_job(state, job, cancelled=False)
        return JSONResponse(body)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()


class _Stream(StreamingResponse):
    """Server-sent events whose job is ended however the response ends (even unsent)."""

    def __init__(self, content, end) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._end = end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end()


def _stream(state: ServingState, job: Job, outputs: asyncio.Queue, include_usage: bool
            ) -> Response:
    ended = {"clean": False}

    def event(payload) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    def logprobs_now(choice: Choice):
        if job.logprobs is None:
            return None
        entries = state.sink.take(choice.request_id, len(choice.tokens))
        new = entries[choice.logprobs_sent :]
        choice.logprobs_sent = len(entries)
        return job.logprobs_of(new)

    async def events():
        if job.kind == "chat":
            for c in sorted(job.choices.values(), key=lambda c: c.index):
                yield event(job.chunk(c.index, None, role=True))
        try:
            while not all(c.finished for c in job.choices.values()):
                choice, output = await _next_output(state, job, outputs)
                piece = _update(state, job, choice, output)
                logprobs = logprobs_now(choice)
                if piece or (logprobs and (logprobs.get("content") or logprobs.get("tokens"))):
                    yield event(job.chunk(choice.index, piece, logprobs=logprobs))
                if choice.finished:
                    yield event(job.chunk(choice.index, None,
                                          finish_reason=choice.finish_reason()))
        except (GenerationFailed, EngineStopped) as e:
            status = 500 if isinstance(e, GenerationFailed) else 503
            yield event(error_body(status, f"generation failed: {e}" if status == 500
                                   else str(e)))
            return
        if include_usage:
            yield event(job.usage_chunk())
        ended["clean"] = True
        yield event("[DONE]")

    def end():
        if ended["clean"]:
            _end_job(state, job, cancelled=False)
        else:
            _end_job(state, job, cancelled=True, why="cancelled: the stream ended early")

    return _Stream(events(), end)


async def _answer(state: ServingState, kind: str, request, prompts: list[list[int]],
                  param: str, http_request: Request) -> Response:
    job, outputs = _start_job(state, kind, request, prompts, param)
    if request.stream:
        options = request.stream_options
        return _stream(state, job, outputs, bool(options and options.include_usage))
    return await _whole(state, job, outputs, http_request)


# ---------------------------------------------------------------------------- the app
def create_app(state: ServingState) -> BodyLimit:
    """The ASGI application: routes, errors in OpenAI's schema, the API key, the body limit."""
    app = FastAPI(title="foscar serve", docs_url=None, redoc_url=None, openapi_url=None)

    async def require_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            raise RequestError("a valid API key is needed: Authorization: Bearer KEY",
                               status=401)

    keyed = [Depends(require_key)]

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        state.metrics.refused(request.url.path, exc.status)
        retry = exc.retry_after_s if isinstance(exc, Busy) else None
        return error_response(exc.status, str(exc), exc.param, retry)

    @app.exception_handler(EngineStopped)
    async def stopped(request: Request, exc: EngineStopped):
        state.metrics.refused(request.url.path, 503)
        return error_response(503, str(exc), retry_after=RETRY_AFTER_S * 5)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        state.metrics.refused(request.url.path, 400)
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}; routes: "
                                  "POST /v1/chat/completions, /v1/completions, /tokenize, "
                                  "/detokenize; GET /v1/models, /health, /stats, /metrics")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(body: ChatCompletionRequest, request: Request):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            prompt = prompt_ids(state.tokenizer, messages)
        except Exception as e:  # the template's own checks (roles, order)
            raise RequestError(f"messages: the chat template refused them: {e}",
                               param="messages") from None
        return await _answer(state, "chat", body, [prompt], "messages", request)

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request):
        prompts = _completion_prompts(state, body.prompt)
        return await _answer(state, "completion", body, prompts, "prompt", request)

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize(body: TokenizeRequest):
        if body.model is not None and body.model != state.model_id:
            raise RequestError(f"model {body.model!r} is not served here", status=404,
                               param="model")
        if body.prompt is not None:
            tokens = state.tokenizer.encode(body.prompt,
                                            add_special_tokens=body.add_special_tokens)
        else:
            tokens = prompt_ids(state.tokenizer,
                                [{"role": m.role, "content": m.text()} for m in body.messages],
                                add_generation_prompt=body.add_generation_prompt)
        return {"tokens": list(tokens), "count": len(tokens),
                "max_model_len": state.router.capacity()}

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize(body: DetokenizeRequest):
        if any(t >= state.vocab_size for t in body.tokens):
            raise RequestError(f"tokens: ids must be below the vocabulary's {state.vocab_size}",
                               param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=keyed)
    async def model(model_id: str):
        if model_id != state.model_id:
            raise RequestError(f"model {model_id!r} is not served here; this server serves "
                               f"{state.model_id!r}", status=404, param="model")
        return state.model_card()

    @app.get("/health")
    async def health():
        error = state.router.engine_error()
        if error is None:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy", "reason": error}, status_code=503)

    @app.get("/stats", dependencies=keyed)
    async def stats():
        return state.router.stats()

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    with contextlib.suppress(AttributeError):
        app.router.redirect_slashes = False
    return BodyLimit(app)
