"""An OpenAI-compatible HTTP server on a continuous-batching manager (``foscar serve``).

:class:`ChatServer` runs the application of :mod:`foscar.serving.http` (its routes, fields and
errors) on uvicorn, over a listening socket it binds at once (``listen_socket``: a port in use
fails here, before any model is loaded) with a backlog of :data:`LISTEN_BACKLOG` connections.

The manager is a transformers ``ContinuousBatchingManager`` (``start``, ``stop``,
``add_request``, ``cancel_request``, ``get_result``, and its logits processors, to which the
server adds per-request sampling: :mod:`foscar.serving.sampling`); a manager of
:func:`foscar.serving.build_manager` adds ``kv_stats`` and refuses, with ``ValueError``, a
request its pool can never hold, which the server answers with HTTP 400.

Sampling: ``temperature`` (0 to 2; 0 is greedy), ``top_p`` (0 to 1], ``top_k`` (0 or -1: all),
``min_p`` and ``seed`` apply per request; a request that sets no ``temperature`` gets the
server's (greedy by default, where OpenAI's API samples at 1: a server answer is then
reproducible without a seed). A token depends only on the request's logits, seed and position:
the same seed gives the same answer wherever the logits are the same (they can move in the last
bits with the batch a request shares and after a preemption, which flips near-tied tokens).
Choice ``i`` of a request of ``n`` draws with ``seed + i``. ``logprobs`` are the model's own
(its logits before penalties, bias and temperature).

Threads: uvicorn's event loop serves HTTP in one thread; the engine's loop runs in its own, and a
router thread hands the engine's outputs to the requests on the event loop
(:mod:`foscar.serving.http.router`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

__all__ = ["ChatServer", "listen_socket", "LISTEN_BACKLOG", "DEFAULT_MAX_PENDING"]

logger = logging.getLogger("foscar.serving")

#: connections the kernel queues before the server accepts them
LISTEN_BACKLOG = 4096
#: engine requests in flight before the server answers 429 (``--max-pending``)
DEFAULT_MAX_PENDING = 512
#: seconds open connections get to finish when the server stops
GRACEFUL_STOP_S = 3


def listen_socket(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (port 0: a free one) and listening; raises
    OSError (a port in use, an address not of this machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class ChatServer:
    """The HTTP server (module docstring).

    Parameters
    ----------
    address : (host, port); port 0 takes a free port (:attr:`url` says which). Ignored when
        ``sock`` is given.
    manager : continuous-batching manager (module docstring); started by :meth:`start`
    tokenizer : the model's tokenizer, with a chat template
    model_id : the name ``/v1/models`` gives and requests may name
    default_max_tokens : tokens to generate for a request that sets no ``max_tokens`` (less
        where the pool holds less)
    max_positions : the model's positions, optional
    temperature, top_p : the sampling of a request that does not set them (default greedy)
    api_key : a key every request but ``/health`` and ``/metrics`` must carry (None: none)
    max_pending : engine requests in flight before 429 (a request of ``n`` choices is ``n``)
    sock : a listening socket (:func:`listen_socket`) to serve on

    Example
    -------
    >>> server = ChatServer(("127.0.0.1", 0), manager, tok, model_id="smollm2")
    >>> server.start()                    # the engine, and serving in a thread
    >>> server.url                        # 'http://127.0.0.1:41235'
    >>> server.stop()
    """

    def __init__(self, address: tuple[str, int], manager, tokenizer, *, model_id: str,
                 default_max_tokens: int = 256, max_positions: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, api_key: str | None = None,
                 max_pending: int = DEFAULT_MAX_PENDING, sock: socket.socket | None = None
                 ) -> None:
        import uvicorn

        from .http import RequestRouter, ServingState, create_app
        from .sampling import enable_sampling, host_fields_usable, request_sampler

        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or (
            default_max_tokens < 1
        ):
            raise ValueError(f"default_max_tokens must be an int >= 1, got {default_max_tokens!r}")
        if not 0 <= temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {temperature!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string or None")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template: /v1/chat/completions needs one")
        enable_sampling(manager)  # before the socket: a refusal leaves no port open
        eos = getattr(manager, "generation_config", None)
        eos = getattr(eos, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.router = RequestRouter(manager, max_positions=max_positions, eos_token_ids=eos_ids,
                                    max_pending=max_pending)
        config = getattr(getattr(manager, "model", None), "config", None)
        vocab = getattr(config.get_text_config(), "vocab_size", None) if config else None
        self.state = ServingState(
            self.router, tokenizer, model_id=model_id, default_max_tokens=default_max_tokens,
            temperature=float(temperature), top_p=float(top_p), api_key=api_key,
            logprob_sink=request_sampler(manager).sink, host_fields=host_fields_usable(manager),
            vocab_size=int(vocab or len(tokenizer)),
        )
        self.socket = sock if sock is not None else listen_socket(*address)
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            create_app(self.state), log_level="warning", access_log=False, lifespan="off",
            backlog=LISTEN_BACKLOG, timeout_keep_alive=30,
            timeout_graceful_shutdown=GRACEFUL_STOP_S,
        ))
        self._thread: threading.Thread | None = None

    @property
    def model_id(self) -> str:
        return self.state.model_id

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine and serve in a background thread (:meth:`serve_forever` serves in
        the caller's thread instead, after :meth:`start_engine`)."""
        self.start_engine()
        self._thread = threading.Thread(target=self._serve_in_thread, name="foscar-http",
                                        daemon=True)
        self._thread.start()

    def start_engine(self) -> None:
        self.router.start()

    def _serve_in_thread(self) -> None:
        self.serve_forever()

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`shutdown` (on uvloop where it is installed)."""
        serving = self._uvicorn.serve(sockets=[self.socket])
        factory = getattr(self._uvicorn.config, "get_loop_factory", None)
        if factory is None or not hasattr(asyncio, "Runner"):  # Python 3.10, older uvicorn
            asyncio.run(serving)
            return
        with asyncio.Runner(loop_factory=factory()) as runner:
            runner.run(serving)

    def shutdown(self) -> None:
        """Ask the HTTP server to stop (open connections get a few seconds to end)."""
        self._uvicorn.should_exit = True

    def stop(self) -> None:
        """Stop serving, then the engine (requests still waiting get HTTP 503)."""
        self.shutdown()
        if self._thread is not None:
            self._thread.join(GRACEFUL_STOP_S + 30)
            self._thread = None
        self.router.stop()
        self.server_close()

    def server_close(self) -> None:
        self.socket.close()
