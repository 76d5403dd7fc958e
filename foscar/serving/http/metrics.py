"""Prometheus metrics of ``foscar serve`` (``GET /metrics``), in a registry of the server's own.

- ``foscar_requests_total{endpoint, outcome}``: requests answered, by how they ended (``stop``,
  ``length``, ``cancelled``, ``error``) or were refused (``refused_400``, ``refused_429``, ...);
- ``foscar_time_to_first_token_seconds``, ``foscar_time_per_output_token_seconds``: histograms
  of each answer (a request of ``n`` choices gives one of each per choice);
- ``foscar_prompt_tokens_total``, ``foscar_generation_tokens_total``;
- ``foscar_requests_in_flight`` (engine requests admitted), ``foscar_queue_length`` (of them,
  those holding no KV blocks yet), ``foscar_kv_blocks_in_use``, ``foscar_kv_blocks_total``.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class ServerMetrics:
    """The server's metrics; ``stats`` is called at each scrape for the gauges (the router's
    :meth:`~foscar.serving.http.router.RequestRouter.stats`)."""

    def __init__(self, stats) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats = stats
        self.requests = Counter("foscar_requests", "requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.ttft = Histogram("foscar_time_to_first_token_seconds",
                              "time from a request's arrival to its first answer token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("foscar_time_per_output_token_seconds",
                              "an answer's time per token after its first",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("foscar_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("foscar_generation_tokens", "answer tokens generated",
                                         registry=self.registry)
        self.in_flight = Gauge("foscar_requests_in_flight", "engine requests admitted",
                               registry=self.registry)
        self.queue = Gauge("foscar_queue_length",
                           "admitted engine requests holding no KV blocks yet",
                           registry=self.registry)
        self.blocks_used = Gauge("foscar_kv_blocks_in_use", "KV blocks held by requests",
                                 registry=self.registry)
        self.blocks_total = Gauge("foscar_kv_blocks_total", "KV blocks of the pool",
                                  registry=self.registry)

    def answer(self, endpoint: str, outcome: str, *, first_token_s: float | None,
               elapsed_s: float, tokens: int) -> None:
        """One choice's answer (or its end)."""
        self.requests.labels(endpoint, outcome).inc()
        self.generation_tokens.inc(tokens)
        if first_token_s is not None:
            self.ttft.observe(first_token_s)
            if tokens > 1:
                self.tpot.observe((elapsed_s - first_token_s) / (tokens - 1))

    def refused(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, f"refused_{status}").inc()

    def render(self) -> bytes:
        stats = self._stats()
        server = stats["server"]
        self.in_flight.set(server["in_flight"])
        engine = stats["engine_requests"]
        self.queue.set(max(server["in_flight"] - (engine or 0), 0))
        kv, free = stats["kv"], stats["kv_free_share"]
        if kv is not None:
            self.blocks_total.set(kv["num_blocks"])
            if free is not None:
                self.blocks_used.set(round((1.0 - free) * kv["num_blocks"]))
        return generate_latest(self.registry)
