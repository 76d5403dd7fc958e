"""The OpenAI-compatible HTTP layer of ``foscar serve``: FastAPI on uvicorn, pydantic models of
OpenAI's request bodies (``pip install "foscar[serve]"``).

Routes:

- ``POST /v1/chat/completions`` and ``POST /v1/completions`` (prompt as text or token ids, or a
  list of them): answered as one JSON object, or with ``"stream": true`` as server-sent events
  (``data: {chunk}`` lines, then ``data: [DONE]``); ``n`` choices, ``logprobs`` (and chat's
  ``top_logprobs``), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, presence,
  frequency and repetition penalties, ``logit_bias``, ``stop`` strings, ``stop_token_ids``,
  ``max_tokens`` / ``max_completion_tokens``, ``stream_options.include_usage``;
- ``POST /tokenize`` (text, or messages through the chat template), ``POST /detokenize``;
- ``GET /v1/models``, ``GET /v1/models/{id}``;
- ``GET /health`` (``{"status": "ok"}``, or 503 once the engine has stopped), ``GET /stats`` (the
  KV pool, its free share, the requests in flight), ``GET /metrics`` (Prometheus,
  :mod:`foscar.serving.http.metrics`).

With an API key, every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``
(401 otherwise). A field the server does not take, an unknown role, or a value out of range is
refused with HTTP 400 naming the field, in OpenAI's error schema
(``{"error": {"message", "type", "param", "code"}}``); nothing is silently ignored.
Admission is bounded (:mod:`foscar.serving.http.router`): past ``max_pending`` requests in
flight, HTTP 429 with ``Retry-After``; an engine that stopped answers 503 with ``Retry-After``.

A client that disconnects (or stops reading a stream) midway has its requests cancelled: the
engine frees their blocks at its next step, and the other requests go on.
"""

from .app import ServingState, create_app
from .router import Busy, EngineStopped, RequestError, RequestRouter
from .text import StopText, TextStream, prompt_ids

__all__ = [
    "Busy",
    "EngineStopped",
    "RequestError",
    "RequestRouter",
    "ServingState",
    "StopText",
    "TextStream",
    "create_app",
    "prompt_ids",
]
