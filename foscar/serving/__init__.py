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

``kv`` (:func:`parse_kv` reads the command-line spelling): ``"bf16"`` (the engine's own cache,
unchanged), ``"int4"``, ``"int2"`` (token-wise groups of ``min(head_dim, 128)``, 64 sink + 256
recent BF16 tokens), a :class:`foscar.KVFormat`, a list of one per layer, or the path of an
OSCAR calibration file (its rotations, fitted clips and per-layer widths).
"""

from .continuous import FoscarBatchingManager, build_manager
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
