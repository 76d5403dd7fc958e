"""Serving: foscar's paged quantized KV cache inside a continuous-batching engine.

Two layers:

- an engine-neutral core (:class:`PagedKV`, :mod:`foscar.serving.core`): requests by id, their
  quantized history stored in the engine's own block ids, BF16 sink/recent windows per request,
  quantize-on-write of a step's tokens, and the attention of one step (decode through
  :func:`foscar.decode_attention`; prefill and chunked prefill over stored history plus new
  tokens in torch). A vLLM or SGLang plugin is an adapter around it;
- transformers' continuous-batching engine (:mod:`foscar.serving.continuous`): the engine's
  scheduler, request states, preemption and generation loop, with :class:`PagedKV` in place of
  the engine's BF16 paged cache and the ``"foscar_paged"`` attention.

::

    from foscar.serving import build_manager

    manager = build_manager(model, "int2", memory_bytes=2 << 30, max_new_tokens=128)
    manager.start()
    rid = manager.add_request(input_ids, max_new_tokens=64)
    for out in manager.request_id_iter(rid):   # out.generated_tokens, out.status
        ...
    manager.stop(block=True)
    manager.kv_stats()   # pool size, bytes per token, how many more tokens than BF16
    manager.concurrent_requests(2048)   # requests of 2K tokens held at once, and with BF16

``add_request`` raises ``ValueError`` for a request the pool can never hold (prompt plus
``max_new_tokens`` over the cache's tokens or the model's positions); a cancelled, finished or
preempted request's pages and window slot return to the pool. Under tensor parallelism
(``torchrun``) every process builds and starts the manager, process 0 adds requests, the others
call ``manager.wait()`` (:mod:`foscar.serving.tp`).

``kv`` (:func:`parse_kv` reads the command-line spelling): ``"bf16"`` (the engine's own cache,
unchanged), ``"int4"``, ``"int2"`` (token-wise groups of ``min(head_dim, 128)``, 64 sink + 256
recent BF16 tokens), a :class:`foscar.KVFormat`, a list of one per layer, or the path of an
OSCAR calibration file (its rotations, fitted clips and per-layer widths).
"""

from .core import PagedKV, StepRow
from .kv_spec import KV_NAMES, KVSpecError, parse_kv, resolve_kv

__all__ = [
    "KV_NAMES",
    "FoscarBatchingManager",
    "KVSpecError",
    "PagedKV",
    "StepRow",
    "build_manager",
    "parse_kv",
    "resolve_kv",
]


def __getattr__(name: str):
    # the transformers adapter is imported on first use: the core serves other engines without
    # transformers installed
    if name in ("FoscarBatchingManager", "build_manager"):
        from . import continuous

        return getattr(continuous, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
