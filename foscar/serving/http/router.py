"""Between the HTTP event loop and the engine: admission, submission, and each request's outputs.

The manager (a transformers ``ContinuousBatchingManager``: ``start``, ``stop``, ``add_request``,
``cancel_request``, ``get_result``) runs its generation loop in a thread of its own. One router
thread reads its outputs and hands each to its request's ``asyncio.Queue`` on the event loop (the
manager's ``request_id_iter`` has every caller poll one shared queue and put back what is not its
own, which costs each token a pass over every waiting caller).

Admission is bounded: at most ``max_pending`` engine requests (a request of ``n`` choices is
``n`` of them) are in flight; one more is refused with :class:`Busy` (HTTP 429 with
``Retry-After``) before it reaches the engine, so a burst queues nowhere unbounded and no
connection is reset.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..sampling import child_request_ids

__all__ = ["RequestRouter", "RequestError", "Busy", "EngineStopped", "STOPPED", "engine_error",
           "free_share"]

logger = logging.getLogger("foscar.serving")

#: put in a request's queue when the engine stops under it
STOPPED = object()


class RequestError(ValueError):
    """A request the server refuses: ``status`` (an HTTP code), ``param`` (the field at fault,
    or None) and the message."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class Busy(RequestError):
    """The server holds ``max_pending`` requests: refused with 429 and ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, status=429)
        self.retry_after_s = retry_after_s


class EngineStopped(RuntimeError):
    """The manager's generation loop is not running (stopped, or died of an error)."""


def engine_error(manager) -> str | None:
    """Why ``manager`` cannot generate (None while it can)."""
    status = getattr(manager, "background_thread_status", None)
    fatal = getattr(status, "fatal_error", None)
    if fatal is not None:
        return f"the engine stopped after an error: {fatal}"
    is_running = getattr(manager, "is_running", None)
    if is_running is not None and not is_running():
        return "the engine is not running"
    return None


def engine_cache(manager):
    """The engine's paged cache of the running loop, or None before it is built."""
    cache = getattr(manager, "cache", None)  # foscar's manager keeps it beside the engine's
    if cache is None:
        processor = getattr(manager, "batch_processor", None)
        cache = getattr(processor, "cache", None)
    return cache


def free_share(cache) -> float | None:
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
    """Submits requests to ``manager`` and hands each its own outputs on the event loop.

    Parameters
    ----------
    manager : a started or unstarted continuous-batching manager (module docstring)
    max_positions : int, optional
        The model's positions: a request longer than this is refused before the engine sees it.
    eos_token_ids : set of int
        The tokens that end an answer (for ``finish_reason``).
    max_pending : int
        Most engine requests in flight; more are refused with :class:`Busy`.
    """

    def __init__(self, manager, *, max_positions: int | None = None,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(),
                 max_pending: int = 256) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.manager = manager
        self.max_positions = max_positions
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_pending = max_pending
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_in_flight = 0
        self.finished = 0
        self.cancelled = 0
        self.stopped = 0  # finished ones the server ended early (a stop string or stop token)
        self.refused = 0  # refused for want of room (429)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the manager (if it is not running) and the router thread."""
        is_running = getattr(self.manager, "is_running", None)
        if is_running is None or not is_running():
            self.manager.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._route, name="foscar-router", daemon=True)
        self._thread.start()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the requests' queues live on."""
        self._loop = loop

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
        return engine_error(self.manager)

    # ------------------------------------------------------------------ requests
    def capacity(self) -> int | None:
        """Most tokens (prompt and answer) one request can hold: the pool's and the model's
        limit, whichever is smaller (None: no known limit)."""
        limits = [self.max_positions] if self.max_positions else []
        kv_stats = getattr(self.manager, "kv_stats", None)
        if kv_stats is not None:
            limits.append(int(kv_stats()["max_tokens"]))
        return min(limits) if limits else None

    def check(self, prompt_tokens: int, max_new_tokens: int, param: str) -> None:
        """Raise RequestError (400) for a request the pool or the model can never hold."""
        limit = self.capacity()
        if limit is not None and prompt_tokens + max_new_tokens > limit:
            raise RequestError(
                f"the request needs {prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in "
                f"the {param} + max_tokens {max_new_tokens}) but this server holds at most "
                f"{limit} tokens per request; shorten the {param} or lower max_tokens",
                param=param,
            )

    def admit(self, count: int) -> None:
        """Raise Busy unless ``count`` more requests fit under ``max_pending``, EngineStopped
        when the engine cannot take them."""
        error = self.engine_error()
        if error is not None:
            raise EngineStopped(error)
        with self._lock:
            if len(self._queues) + count > self.max_pending:
                self.refused += 1
                raise Busy(f"the server holds its limit of {self.max_pending} requests in "
                           "flight; retry shortly")

    def submit(self, prompt: list[int], *, max_new_tokens: int, stream: bool,
               request_id: str, sampling: dict | None = None,
               outputs: asyncio.Queue | None = None, num_children: int = 0) -> asyncio.Queue:
        """Queue a request (called on the event loop); returns the queue its outputs arrive in
        (the manager's outputs, or :data:`STOPPED`; ``outputs``: a queue to share with other
        requests, told apart by ``request_id``). ``sampling``: the request's arguments of
        :func:`foscar.serving.sampling.enable_sampling` (none: greedy). ``num_children``: more
        samples of the prompt, prefilled once (foscar's managers fork the request; their ids are
        :func:`foscar.serving.sampling.child_request_ids`, each one more engine request).
        Raises RequestError (400) for a request the engine refuses, EngineStopped when it cannot
        take it."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if outputs is None:
            outputs = asyncio.Queue()
        ids = [request_id, *child_request_ids(request_id, num_children)]
        children = {"num_children": num_children} if num_children else {}
        with self._lock:
            for i in ids:  # before add_request: an answer can come at once
                self._queues[i] = outputs
            self.peak_in_flight = max(self.peak_in_flight, len(self._queues))
        try:
            accepted = self.manager.add_request(
                prompt, request_id=request_id, max_new_tokens=max_new_tokens, streaming=stream,
                **children, **(sampling or {}),
            )
        except ValueError as e:  # the pool can never hold it (foscar's managers say so)
            self._forget(*ids)
            raise RequestError(str(e)) from None
        except Exception:
            self._forget(*ids)
            raise
        if accepted is None:  # the engine is stopping and dropped it
            self._forget(*ids)
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
        engine did (a stop string or token), so the engine cancels it and frees its blocks."""
        if self._forget(request_id):
            if early:
                self.manager.cancel_request(request_id)
            with self._lock:
                self.finished += 1
                self.stopped += early

    def in_flight(self) -> int:
        with self._lock:
            return len(self._queues)

    def _forget(self, *request_ids: str) -> bool:
        with self._lock:
            return any([self._queues.pop(i, None) is not None for i in request_ids])

    # ------------------------------------------------------------------ the router thread
    def _route(self) -> None:
        while not self._stop.is_set():
            output = self.manager.get_result(timeout=0.1)
            if output is None:
                if engine_error(self.manager) is not None:
                    self._fail_all()
                    time.sleep(0.1)  # get_result returns at once when the loop is gone
                continue
            with self._lock:
                outputs = self._queues.get(output.request_id)
            if outputs is not None and self._loop is not None:  # None: cancelled, dropped
                self._deliver(outputs, output)

    def _deliver(self, outputs: asyncio.Queue, item) -> None:
        try:
            self._loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass

    def _fail_all(self) -> None:
        with self._lock:
            waiting = list(self._queues.values())
            self._queues.clear()
        for outputs in waiting:
            if self._loop is not None:
                self._deliver(outputs, STOPPED)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """``kv``: the pool's sizes (kv_stats, when the manager has it), ``kv_free_share``: share
        of its blocks free now; ``engine_requests``: requests holding blocks in the engine;
        ``server``: requests in flight here, their peak, finished ones (``stopped``: of them, those
        ended at a stop string or token, the engine told to cancel), cancelled ones and refused
        ones (429)."""
        manager = self.manager
        kv_stats = getattr(manager, "kv_stats", None)
        cache = engine_cache(manager)
        live = getattr(cache, "live_request_ids", None)
        with self._lock:
            server = {
                "in_flight": len(self._queues),
                "max_pending": self.max_pending,
                "peak_in_flight": self.peak_in_flight,
                "finished": self.finished,
                "stopped": self.stopped,
                "cancelled": self.cancelled,
                "refused": self.refused,
            }
        return {
            "kv": kv_stats() if kv_stats is not None else None,
            "kv_free_share": free_share(cache),
            "engine_requests": None if live is None else len(live),
            "server": server,
        }
