"""Public decode entry: validate -> pick a backend (foscar.backends' registry) -> plan -> run.

:class:`DecodePlan` is FlashInfer's wrapper pattern: made once per DecodeBatch (one layer's
page tables and lengths), it picks and checks the backend and holds the backend's plan (split
workspaces allocated when it is made, bound launches, TMA descriptors); :meth:`DecodePlan.run`
takes the query and the outputs of each call. :func:`decode_attention` makes a plan for its
one call.
"""

from __future__ import annotations

import math

import torch

from . import backends, configs
from .cache import DecodeBatch, QuantizedKVCache

__all__ = ["BACKENDS", "DecodePlan", "decode_attention", "default_backend"]

#: ``"auto"`` and the registered backends (foscar.backends): ``"triton-reconstruct"`` and
#: ``"gluon-reconstruct"`` are the per-value reconstruction baselines of the two kernels
#: (benchmarks only); ``"gluon-e4m3"`` is the Gluon kernel with FP8 (E4M3) operands, faster and
#: less accurate (never picked by ``"auto"``).
BACKENDS = ("auto", *backends.names())


def default_backend(cache: QuantizedKVCache, q: torch.Tensor, layer: int = 0) -> str:
    """The backend ``"auto"`` picks: on a Hopper GPU the Gluon kernel where it covers the format
    and was measured faster (``configs.gluon_min_ctas`` of the K/V axes, read off the measured
    table ``configs.GLUON_OVER_TRITON_US``, from docs/tuning.md's grids: token-wise K always,
    channel-wise K from 64 sequences x KV heads; pages other than 64 where
    ``configs.GLUON_OVER_TRITON_PAGE_US`` has Gluon faster), else the Triton kernel on a GPU
    when it covers the format, else the reference. ``layer``: whose format decides, where the
    cache holds one per layer (Gluon serves such a cache only where it covers every layer's
    format)."""
    return auto_backend(cache, q.device, q.dtype, q.shape[0], q.shape[1], layer)


def auto_backend(
    cache: QuantizedKVCache,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int,
    num_q_heads: int,
    layer: int = 0,
) -> str:
    """:func:`default_backend` for queries ``[batch_size, num_q_heads, head_dim]`` of ``dtype``
    on ``device``."""
    gluon, triton = backends.get("gluon"), backends.get("triton")
    cuda = device.type == "cuda"
    if (
        cuda
        and dtype == torch.bfloat16
        and gluon.available(device)
        and gluon.supports(cache, num_q_heads) is None
    ):
        fmt = cache.layer_format(layer)
        k, v = fmt.key, fmt.value
        if configs.auto_takes_gluon(
            k.axis.value,
            v.axis.value,
            cache.head_dim,
            tuple({k.bits, v.bits}),
            batch_size * cache.num_kv_heads,
            cache.page_size,
        ):
            return "gluon"
    if (
        cuda
        and triton.available(device)
        and triton.supports(cache, num_q_heads) is None
        and dtype == torch.bfloat16
    ):
        return "triton"
    return "reference"


class DecodePlan:
    """Decode attention over one :class:`DecodeBatch` (its layer ``batch.layer``) of ``cache``,
    planned once and run per call (FlashInfer's ``plan``/``run``).

    Parameters
    ----------
    cache : QuantizedKVCache
    batch : DecodeBatch
        From ``cache.plan(seq_ids, layer)`` or a decode step's ``step.batches[layer]``. The plan
        reads its tables at every run, so a batch whose tensors are refilled in place (a planned
        decode step's) keeps its plan.
    num_q_heads : int
        Query heads (a multiple of the cache's KV heads).
    q_dtype : torch.dtype
        The queries' dtype (bfloat16 for the kernels).
    sm_scale : float, optional
        Logit scale (default ``1 / sqrt(head_dim)``).
    backend : str
        As :func:`decode_attention`'s; ``"auto"`` is resolved here, once.

    The backend's plan (``backend_plan``) owns the split workspace, allocated here, so that a
    CUDA graph captured over :meth:`run` and its replays allocate nothing, and the bound
    launches later runs replay (Note [bound launches] in foscar.triton_runtime).

    Example
    -------
    >>> plan = foscar.DecodePlan(cache, cache.plan(seq_ids), num_q_heads=32)
    >>> o = plan.run(q)
    """

    def __init__(
        self,
        cache: QuantizedKVCache,
        batch: DecodeBatch,
        *,
        num_q_heads: int,
        q_dtype: torch.dtype = torch.bfloat16,
        sm_scale: float | None = None,
        backend: str = "auto",
    ) -> None:
        if not isinstance(cache, QuantizedKVCache):
            raise TypeError(f"cache must be a QuantizedKVCache, got {type(cache).__name__}")
        if not isinstance(batch, DecodeBatch):
            raise TypeError(
                f"batch must be a DecodeBatch (from cache.plan), got {type(batch).__name__}"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or (
            num_q_heads < 1 or num_q_heads % cache.num_kv_heads
        ):
            raise ValueError(
                f"num_q_heads must be a positive multiple of num_kv_heads "
                f"({cache.num_kv_heads}), got {num_q_heads!r}"
            )
        if not isinstance(q_dtype, torch.dtype) or not q_dtype.is_floating_point:
            raise TypeError(
                f"q must be a floating tensor (bfloat16 for the kernels), got {q_dtype}"
            )
        cache.check_plan(batch)  # a plan made before a free or an append raises here
        self.cache = cache
        self.batch = batch
        self.num_q_heads = num_q_heads
        self.q_dtype = q_dtype
        self.sm_scale = 1.0 / math.sqrt(cache.head_dim) if sm_scale is None else float(sm_scale)
        if backend == "auto":
            backend = auto_backend(
                cache, cache.device, q_dtype, batch.batch_size, num_q_heads, batch.layer
            )
        self.backend = backend
        impl = backends.get(backend)
        if not impl.available(cache.device):
            raise ValueError(
                f"backend {backend!r} needs {impl.requirement}; q is on {cache.device}"
            )
        reason = impl.supports(cache, num_q_heads)
        if reason:
            raise ValueError(f"backend {backend!r} does not cover this cache: {reason}")
        if impl.query_dtypes is not None and q_dtype not in impl.query_dtypes:
            dtypes = " or ".join(str(d).removeprefix("torch.") for d in impl.query_dtypes)
            raise TypeError(f"backend {backend!r} needs {dtypes} queries, got {q_dtype}")
        self.backend_plan = impl.plan(cache, batch, num_q_heads, self.sm_scale)

    def run(
        self,
        q: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Attention of ``q: [batch, num_q_heads, head_dim]`` over the batch; returns ``o`` (and
        ``lse`` with ``return_lse``), as :func:`decode_attention`."""
        cache, batch = self.cache, self.batch
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.device != cache.device:
            raise ValueError(f"q is on {q.device}, expected the cache's device {cache.device}")
        cache.check_query(q, batch)
        if q.shape[1] != self.num_q_heads or q.dtype != self.q_dtype:
            raise ValueError(
                f"q must be {self.q_dtype} with {self.num_q_heads} heads (the plan's), got "
                f"{q.dtype} with {q.shape[1]}"
            )
        cache.check_plan(batch)  # a plan made before a free or an append raises here
        if out is not None and (
            out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
        ):
            raise ValueError(
                f"out must be a {q.dtype} tensor of shape {list(q.shape)} on {q.device}"
            )
        tr = cache.transforms[batch.layer]
        if tr.key_rotation is not None:
            q = tr.rotate(q, "key").to(q.dtype)
        run = self.backend_plan.run
        if tr.value_rotation is None:
            return run(q, out=out, lse=lse, return_lse=return_lse)
        o, lse_o = run(q, out=None, lse=lse, return_lse=True)
        o = tr.rotate(o, "value", inverse=True).to(q.dtype)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse_o) if return_lse else o


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
        Page tables and lengths only: each call makes a :class:`DecodePlan` for itself; hold
        one (``DecodePlan(cache, batch, num_q_heads=...)``) to reuse its workspace and bound
        launches over many calls, as CUDA-graph capture and serving do.
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
        reference, the folded torch computation (:func:`foscar.backends.folded.attend_folded`) in
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
    cache.check_query(q, batch)
    cache.check_plan(batch)  # a plan made before a free or an append raises here
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {list(q.shape)} on {q.device}")
    plan = DecodePlan(
        cache, batch, num_q_heads=q.shape[1], q_dtype=q.dtype, sm_scale=sm_scale, backend=backend
    )
    return plan.run(q, out=out, lse=lse, return_lse=return_lse)
