"""Public decode entry: validate -> pick a backend (foscar.backends' registry) -> launch."""

from __future__ import annotations

import math

import torch

from . import backends, configs, reference
from .cache import DecodeBatch, QuantizedKVCache

__all__ = ["decode_attention", "default_backend", "BACKENDS"]

#: ``"auto"`` and the registered backends (foscar.backends): ``"triton-reconstruct"`` and
#: ``"gluon-reconstruct"`` are the per-value reconstruction baselines of the two kernels
#: (benchmarks only); ``"gluon-e4m3"`` is the Gluon kernel with FP8 (E4M3) operands, faster and
#: less accurate (never picked by ``"auto"``).
BACKENDS = ("auto", *backends.names())


def default_backend(cache: QuantizedKVCache, q: torch.Tensor, layer: int = 0) -> str:
    """The backend ``"auto"`` picks: on a Hopper GPU the Gluon kernel where it covers the format
    and was measured faster (``configs.gluon_min_ctas`` of the K/V axes, read off the measured
    ``configs.GLUON_OVER_TRITON_US``: token-wise K always, channel-wise K from 64 sequences x
    KV heads; pages other than 64 where ``configs.GLUON_OVER_TRITON_PAGE_US`` has Gluon
    faster), else the Triton kernel on a GPU when it covers the format, else the reference.
    ``layer``: whose format decides, where the cache holds one per layer (Gluon serves such a
    cache only where it covers every layer's format)."""
    gluon, triton = backends.get("gluon"), backends.get("triton")
    if (
        q.is_cuda
        and q.dtype == torch.bfloat16
        and gluon.available(q.device)
        and gluon.supports(cache, q.shape[1]) is None
    ):
        fmt = cache.layer_format(layer)
        k, v = fmt.key, fmt.value
        if configs.auto_takes_gluon(
            k.axis.value,
            v.axis.value,
            cache.head_dim,
            tuple({k.bits, v.bits}),
            q.shape[0] * cache.num_kv_heads,
            cache.page_size,
        ):
            return "gluon"
    if (
        q.is_cuda
        and triton.available(q.device)
        and triton.supports(cache, q.shape[1]) is None
        and q.dtype == torch.bfloat16
    ):
        return "triton"
    return "reference"


def decode_attention(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    batch: DecodeBatch,
    *,
    sm_scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """Attention of one query token per sequence over the quantized cache.

    Parameters
    ----------
    q : [batch, num_q_heads, head_dim]
        Queries (bfloat16 for the Triton kernel); query head ``h`` attends to KV head
        ``h // (num_q_heads // num_kv_heads)``.
    cache : QuantizedKVCache
    batch : DecodeBatch
        From ``cache.plan(seq_ids, layer)``; row ``i`` of ``q`` belongs to ``batch.seq_ids[i]``.
        It also holds the kernels' split workspace, so reusing one plan across layers and
        CUDA-graph replays allocates nothing.
        Plan after the step's appends: a plan whose sequences were freed, or appended to in
        its layer, since ``cache.plan`` raises ``ValueError`` (checked on the host, no device
        sync).
    sm_scale : float, optional
        Logit scale (default ``1 / sqrt(head_dim)``).
    backend : ``"auto"``, ``"gluon"``, ``"triton"``, ``"reference"``, ``"triton-reconstruct"``,
        ``"gluon-reconstruct"`` or ``"gluon-e4m3"``
        ``"gluon"`` is the warp-specialized Hopper kernel (sm_90; INT2/INT4 K and V, each
        token-wise with g = head_dim (128 or 64) or, at head_dim 128, channel-wise in groups of
        128 tokens; page size 64, or 16 and 32 for token-wise K and V at head_dim 128; up to 8
        query heads per KV head; windows included).
        ``"auto"`` takes it where it applies and the H200 measured it faster
        (:func:`default_backend`), else the Triton kernel for bf16 queries on a GPU
        when it covers the format (bf16 mapping, head_dim 64 or 128, at most 16 query heads
        per KV head), else the
        reference, the folded torch computation (:func:`foscar.reference.attend_folded`) in
        fp32 (fp64 for fp64 queries). ``"triton-reconstruct"`` dequantizes every value before
        the products (the baseline folding is measured against); ``"gluon-reconstruct"`` is the
        same ablation in the Gluon kernel's pipeline. ``"gluon-e4m3"`` is the Gluon kernel with
        FP8 wgmma operands built from the same cache (the paper's Blackwell mapping, codes as
        E4M3 ``q 2^-9``; token-wise K and V at head_dim 128): Q and the probabilities go to the
        tensor cores as per-head scaled E4M3, so its error is E4M3's (about 20x bf16's);
        ``"auto"`` never picks it.
    return_lse : bool
        Also return ``lse: [batch, num_q_heads]`` float32, the natural log of each head's
        softmax denominator over the scaled logits.
    out, lse : optional preallocated outputs (``[batch, num_q_heads, head_dim]`` in q's dtype,
        ``[batch, num_q_heads]`` float32) for CUDA-graph capture.

    Returns
    -------
    o : [batch, num_q_heads, head_dim] in ``q.dtype``, and ``lse`` if asked.

    A layer with OSCAR rotations (:meth:`QuantizedKVCache.set_transform`) is read in its
    rotated coordinates: ``q R_K`` goes to the backend and its output comes back as ``o R_V^T``
    (in fp32, fp64 for fp64 queries), so ``q`` and ``o`` stay in the model's coordinates.

    Example
    -------
    >>> batch = cache.plan(seq_ids)
    >>> o = foscar.decode_attention(q, cache, batch)
    """
    if not isinstance(cache, QuantizedKVCache):
        raise TypeError(f"cache must be a QuantizedKVCache, got {type(cache).__name__}")
    if not isinstance(batch, DecodeBatch):
        raise TypeError(
            f"batch must be a DecodeBatch (from cache.plan), got {type(batch).__name__}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device}, expected the cache's device {cache.device}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating tensor (bfloat16 for the kernels), got {q.dtype}")
    reference.check_query(q, cache, batch)
    cache.check_plan(batch)  # a plan made before a free or an append raises here
    sm_scale = 1.0 / math.sqrt(cache.head_dim) if sm_scale is None else float(sm_scale)
    if backend == "auto":
        backend = default_backend(cache, q, batch.layer)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {list(q.shape)} on {q.device}")
    tr = cache.transforms[batch.layer]
    if tr.key_rotation is not None:
        q = tr.rotate(q, "key").to(q.dtype)
    if tr.value_rotation is None:
        return _decode(q, cache, batch, sm_scale, backend, return_lse, out, lse)
    o, lse_o = _decode(q, cache, batch, sm_scale, backend, True, None, lse)
    o = tr.rotate(o, "value", inverse=True).to(q.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse_o) if return_lse else o


def _decode(q, cache, batch, sm_scale, name, return_lse, out, lse):
    """The backend call of :func:`decode_attention` (validated arguments, stored coordinates)."""
    backend = backends.get(name)
    if not backend.available(q.device):
        raise ValueError(f"backend {name!r} needs {backend.requirement}; q is on {q.device}")
    reason = backend.supports(cache, q.shape[1])
    if reason:
        raise ValueError(f"backend {name!r} does not cover this cache: {reason}")
    if backend.query_dtypes is not None and q.dtype not in backend.query_dtypes:
        dtypes = " or ".join(str(d).removeprefix("torch.") for d in backend.query_dtypes)
        raise TypeError(f"backend {name!r} needs {dtypes} queries, got {q.dtype}")
    return backend.launch(q, cache, batch, sm_scale, out=out, lse=lse, return_lse=return_lse)
