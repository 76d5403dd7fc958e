"""Decode-attention baselines for the foscar benchmark (one NVIDIA H200).

Every maker has the shape

    make_<name>(batch, kv_len, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                page_size=64, device="cuda", **options) -> (step, info)

``step`` is a zero-argument callable that runs ONE decode step (one bf16 query
token per sequence, all sequences ``kv_len`` long, every kernel of the step
included) and returns the bf16 output. ``info`` is a plain dict (no tensors):

    method       "flashinfer-bf16" | "flashinfer-fp8" | "trtllm-xqa-fp8" | "sdpa-bf16"
    kv_bytes     bytes of one read of the stored K and V (payload only:
                 batch * kv_len * num_kv_heads * head_dim * elem_size * 2)
    alloc_bytes  bytes of everything the maker allocated on the GPU (approx.)
    impl, kv_dtype, kv_layout, ...  details for the report

Makers raise ``BaselineUnavailable`` (a RuntimeError) or ImportError with a
message when the method cannot run here (FlashInfer missing, no CUDA, not
enough free memory, wrong GPU); catch ``(ImportError, RuntimeError)`` and skip.

Memory: a maker allocates only its own cache. Before building the next
baseline call ``step.close()`` (or ``del step``), drop any CUDA graph that
captured it, then ``gc.collect(); torch.cuda.empty_cache()``.
B=64 x L=512K bf16 is 128 GiB of K+V: it fits an H200 (139 GiB) only alone.

FlashInfer JIT-compiles each kernel family on first use (nvcc + ninja,
minutes per module, cached under $FLASHINFER_WORKSPACE_BASE/.cache/
flashinfer, default ~/.cache/flashinfer). Every maker calls the step once
before returning, so the compile never lands in a timed call; ``prewarm()``
compiles all modules up front with tiny shapes (the JIT module key does not
depend on batch, kv_len or page_size, except XQA, whose key includes
page_size).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

try:
    import torch
except Exception:  # pragma: no cover
    torch = None  # type: ignore[assignment]

__all__ = [
    "BaselineUnavailable",
    "BaselineStep",
    "BASELINES",
    "make_flashinfer_bf16",
    "make_flashinfer_fp8",
    "make_trtllm_xqa_fp8",
    "make_sdpa_bf16",
    "kv_bytes",
    "required_bytes",
    "prewarm",
    "free_cuda_memory",
]

_GiB = 1 << 30
_MiB = 1 << 20


class BaselineUnavailable(RuntimeError):
    """The baseline cannot run in this environment; the message says why."""


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _require_cuda(device) -> torch.device:
    if torch is None:
        raise BaselineUnavailable("torch is not importable")
    if not torch.cuda.is_available():
        raise BaselineUnavailable("CUDA is not available on this machine")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise BaselineUnavailable(f"device must be a CUDA device, got {device!r}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


_FLASHINFER = None


def _import_flashinfer():
    """Imports flashinfer (+ flashinfer.decode) or raises ImportError with a reason."""
    global _FLASHINFER
    if _FLASHINFER is not None:
        return _FLASHINFER
    try:
        import flashinfer  # noqa: F401
        import flashinfer.decode  # noqa: F401
    except Exception as exc:  # ImportError, OSError (missing .so), RuntimeError...
        raise ImportError(
            "FlashInfer is not importable "
            f"({type(exc).__name__}: {exc}). Install the wheels without network: "
            "pip install --no-deps --no-index "
            "flashinfer_python-0.7.2.post1-py3-none-any.whl "
            "apache_tvm_ffi-0.1.15.post2-cp312-*.whl"
        ) from exc
    _FLASHINFER = flashinfer
    return flashinfer


def _check_version(fi) -> str:
    ver = getattr(fi, "__version__", "unknown")
    if not str(ver).startswith("0.7.2"):
        # Not fatal: the API used here is old and stable, but say so.
        import warnings

        warnings.warn(
            f"baselines.py was written against FlashInfer 0.7.2.post1, found {ver}", stacklevel=2
        )
    return str(ver)


def kv_bytes(batch: int, kv_len: int, num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """Bytes of one read of the stored K and V (payload, no page tables)."""
    return 2 * batch * kv_len * num_kv_heads * head_dim * elem_size


def required_bytes(
    method: str,
    batch: int,
    kv_len: int,
    num_qo_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 64,
    workspace_bytes: int = 256 * _MiB,
) -> int:
    """Approximate GPU bytes a maker allocates (use to skip before allocating)."""
    elem = 1 if method in ("flashinfer-fp8", "trtllm-xqa-fp8") else 2
    pages = batch * math.ceil(kv_len / page_size)
    cache = 2 * pages * page_size * num_kv_heads * head_dim * elem
    small = 2 * batch * num_qo_heads * head_dim * 2 + 8 * pages + 64 * _MiB
    ws = 0 if method == "sdpa-bf16" else workspace_bytes
    return cache + small + ws


def free_cuda_memory() -> None:
    gc.collect()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _check_memory(need: int, dev, headroom: int) -> None:
    free, total = torch.cuda.mem_get_info(dev)
    if need + headroom > free:
        raise BaselineUnavailable(
            f"not enough GPU memory: needs {need / _GiB:.1f} GiB + "
            f"{headroom / _GiB:.1f} GiB headroom, {free / _GiB:.1f} GiB free "
            f"of {total / _GiB:.1f} GiB (free the previous baseline first)"
        )


def _fill_normal_(t: torch.Tensor, gen: torch.Generator, chunk_elems: int = 1 << 28) -> None:
    """Fills t with N(0,1) in chunks (fp8 via a bf16 staging chunk): no big temporaries."""
    flat = t.view(-1)
    n = flat.numel()
    if t.dtype in (torch.bfloat16, torch.float16, torch.float32):
        for s in range(0, n, chunk_elems):
            flat[s : s + chunk_elems].normal_(generator=gen)
        return
    stage = torch.empty(min(n, chunk_elems), dtype=torch.bfloat16, device=t.device)
    for s in range(0, n, chunk_elems):
        e = min(n, s + chunk_elems)
        st = stage[: e - s]
        st.normal_(generator=gen)
        flat[s:e].copy_(st)  # bf16 -> float8_e4m3fn (saturating cast not needed: |x| << 448)
    del stage


def _page_table(batch: int, kv_len: int, page_size: int, dev, gen, shuffle: bool):
    """(pages_per_seq, block_tables[B, P] int32, indptr[B+1], indices[B*P], last_page_len[B])."""
    pages_per_seq = math.ceil(kv_len / page_size)
    total = batch * pages_per_seq
    if shuffle:
        perm = torch.randperm(total, device=dev, generator=gen).to(torch.int32)
    else:
        perm = torch.arange(total, device=dev, dtype=torch.int32)
    block_tables = perm.view(batch, pages_per_seq).contiguous()
    indptr = torch.arange(batch + 1, device=dev, dtype=torch.int32) * pages_per_seq
    last = kv_len - (pages_per_seq - 1) * page_size  # in [1, page_size]
    last_page_len = torch.full((batch,), last, device=dev, dtype=torch.int32)
    return pages_per_seq, block_tables, indptr, block_tables.view(-1), last_page_len


def _gen(dev, seed: int) -> torch.Generator:
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    return g


class BaselineStep:
    """Zero-argument callable running one decode step of a baseline library (not foscar's
    planned :class:`foscar.cache.DecodeStep`); ``close()`` frees its memory."""

    def __init__(self, fn: Callable[[], Any], keep: dict[str, Any], name: str) -> None:
        self._fn = fn
        self._keep = keep  # tensors / wrappers the step uses (kept alive here)
        self.name = name

    def __call__(self):
        if self._fn is None:
            raise RuntimeError(f"{self.name}: step was closed")
        return self._fn()

    def close(self) -> None:
        self._fn = None
        self._keep = {}
        free_cuda_memory()

    def __repr__(self) -> str:
        return f"BaselineStep({self.name})"


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _reference_seq0(q0, k0, v0, sm_scale: float) -> torch.Tensor:
    """fp32 reference for one sequence. q0 [Hq,D]; k0,v0 [L,Hkv,D] (any float dtype)."""
    hq, d = q0.shape
    hkv = k0.shape[1]
    g = hq // hkv
    out = torch.empty(hq, d, dtype=torch.float32, device=q0.device)
    for h in range(hkv):
        kh = k0[:, h, :].float()  # [L, D]
        vh = v0[:, h, :].float()
        qh = q0[h * g : (h + 1) * g].float()  # [g, D]
        p = torch.softmax((qh @ kh.T) * sm_scale, dim=-1)
        out[h * g : (h + 1) * g] = p @ vh
    return out


def _gather_seq0(kv_cache, pages, layout: str, kv_len: int, num_kv_heads: int, head_dim: int):
    """K, V of sequence 0 from a 5-D paged cache as float32 [L, H_kv, D].

    fp8 pages are gathered through a uint8 view (indexing kernels are not
    guaranteed to cover float8 dtypes)."""
    raw = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
    sel = raw[pages]  # [P, 2, page, H, D] (NHD) or [P, 2, H, page, D] (HND)
    if layout == "HND":
        sel = sel.transpose(2, 3)
    k0 = sel[:, 0].reshape(-1, num_kv_heads, head_dim)[:kv_len]
    v0 = sel[:, 1].reshape(-1, num_kv_heads, head_dim)[:kv_len]
    if raw is not kv_cache:
        k0, v0 = k0.view(kv_cache.dtype), v0.view(kv_cache.dtype)
    return k0.float(), v0.float()


def _finish(step: BaselineStep, info: dict[str, Any], verify: bool, ref_fn, tol: float, out_view):
    """Runs the step once (JIT compile / warm-up), optionally checks sequence 0."""
    try:
        out = step()  # first call: JIT compile (FlashInfer) + warm-up
        torch.cuda.synchronize()
    except Exception as exc:
        step.close()
        raise BaselineUnavailable(
            f"{info['method']}: first call failed ({type(exc).__name__}: {exc})"
        ) from exc
    if verify:
        ref = ref_fn()
        got = out_view(out)
        err = _rel_err(got, ref)
        info["verify_rel_err_seq0"] = err
        if not math.isfinite(err) or err > tol:
            step.close()
            raise RuntimeError(
                f"{info['method']}: output of sequence 0 differs from the fp32 "
                f"reference (relative L2 error {err:.3g} > {tol})"
            )
    return step, info


# --------------------------------------------------------------------------
# FlashInfer BatchDecodeWithPagedKVCacheWrapper (bf16 or fp8 e4m3 KV)
# --------------------------------------------------------------------------


def _build_and_plan(
    fi,
    workspace,
    kv_layout,
    graph_safe,
    use_tensor_cores,
    indptr,
    indices,
    last_page_len,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    page_size,
    kv_dtype,
):
    if graph_safe:
        # What FlashInfer's own benchmark does for CUDA-graph timing: the wrapper
        # owns fixed indptr/indices/last_page_len buffers (batch size frozen).
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            kv_layout=kv_layout,
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=torch.empty_like(indptr),
            paged_kv_indices_buffer=torch.empty_like(indices),
            paged_kv_last_page_len_buffer=torch.empty_like(last_page_len),
        )
    else:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout=kv_layout, use_tensor_cores=use_tensor_cores
        )
    # plan(): host-side scheduling + H2D copy of the plan (and the JIT build on
    # first use); done once, never timed. Optional args by keyword only
    # (positional use is deprecated).
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        q_data_type=torch.bfloat16,  # default is float16: must be passed
        kv_data_type=kv_dtype,
        o_data_type=torch.bfloat16,
    )
    return wrapper


def _make_flashinfer(
    method: str,
    kv_dtype,
    batch: int,
    kv_len: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    device,
    *,
    kv_layout: str = "HND",
    use_tensor_cores: bool = True,
    graph_safe: bool = False,
    workspace_bytes: int = 256 * _MiB,
    k_scale: float | None = None,
    v_scale: float | None = None,
    enable_pdl: bool | None = None,
    shuffle_pages: bool = True,
    seed: int = 0,
    verify: bool = False,
    mem_headroom_bytes: int = 2 * _GiB,
):
    fi = _import_flashinfer()
    dev = _require_cuda(device)
    fi_version = _check_version(fi)
    if kv_layout not in ("NHD", "HND"):
        raise ValueError("kv_layout must be 'NHD' or 'HND'")
    if num_qo_heads % num_kv_heads:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
    _check_memory(
        required_bytes(
            method, batch, kv_len, num_qo_heads, num_kv_heads, head_dim, page_size, workspace_bytes
        ),
        dev,
        mem_headroom_bytes,
    )
    gen = _gen(dev, seed)
    P, block_tables, indptr, indices, last_page_len = _page_table(
        batch, kv_len, page_size, dev, gen, shuffle_pages
    )
    total_pages = batch * P
    # One 5-D tensor, K at [:, 0] and V at [:, 1] (the layout FlashInfer's docs use).
    if kv_layout == "NHD":
        shape = (total_pages, 2, page_size, num_kv_heads, head_dim)
    else:
        shape = (total_pages, 2, num_kv_heads, page_size, head_dim)
    kv_cache = torch.empty(shape, dtype=kv_dtype, device=dev)
    _fill_normal_(kv_cache, gen)
    q = torch.randn(batch, num_qo_heads, head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
    out = torch.empty_like(q)
    # float workspace: docs say "must be initialized to 0 for its first use", 128 MB recommended.
    workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)

    try:
        wrapper = _build_and_plan(
            fi,
            workspace,
            kv_layout,
            graph_safe,
            use_tensor_cores,
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            kv_dtype,
        )
    except Exception as exc:  # plan() JIT-compiles the module: nvcc/ninja errors land here
        del kv_cache, q, out, workspace
        free_cuda_memory()
        raise BaselineUnavailable(
            f"{method}: wrapper construction/plan failed ({type(exc).__name__}: {exc})"
        ) from exc
    # k_scale folds into sm_scale (free); a v_scale other than None/1.0 adds an
    # extra elementwise kernel (out *= v_scale) on the fa2 / CUDA-core paths.
    run_kwargs: dict[str, Any] = {"out": out}
    if k_scale is not None:
        run_kwargs["k_scale"] = float(k_scale)
    if v_scale is not None:
        run_kwargs["v_scale"] = float(v_scale)
    if enable_pdl is not None:
        run_kwargs["enable_pdl"] = bool(enable_pdl)

    def fn():
        return wrapper.run(q, kv_cache, **run_kwargs)

    elem = kv_cache.element_size()
    info: dict[str, Any] = {
        "method": method,
        "kv_bytes": kv_bytes(batch, kv_len, num_kv_heads, head_dim, elem),
        "alloc_bytes": kv_cache.numel() * elem
        + workspace_bytes
        + 2 * q.numel() * 2
        + 16 * total_pages,
        "impl": None,  # filled after plan
        "flashinfer_version": fi_version,
        "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "kv_layout": kv_layout,
        "use_tensor_cores": use_tensor_cores,
        "graph_safe": graph_safe,
        "page_size": page_size,
        "batch": batch,
        "kv_len": kv_len,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }
    try:
        backend = wrapper.resolved_backend
    except Exception:  # pragma: no cover
        backend = getattr(wrapper, "_backend", "?")
    info["impl"] = (
        f"BatchDecodeWithPagedKVCacheWrapper(backend={backend}, "
        f"{'tensor-core prefill kernel' if use_tensor_cores else 'CUDA-core decode kernel'})"
    )
    step = BaselineStep(
        fn,
        {
            "wrapper": wrapper,
            "kv_cache": kv_cache,
            "q": q,
            "out": out,
            "ws": workspace,
            "indptr": indptr,
            "indices": indices,
            "last": last_page_len,
            "bt": block_tables,
        },
        method,
    )

    def ref():
        k0, v0 = _gather_seq0(
            kv_cache, block_tables[0].long(), kv_layout, kv_len, num_kv_heads, head_dim
        )
        r = _reference_seq0(q[0], k0, v0, (k_scale or 1.0) / math.sqrt(head_dim))
        return r * (v_scale or 1.0)

    tol = 0.03 if kv_dtype == torch.bfloat16 else 0.12
    return _finish(step, info, verify, ref, tol, lambda o: o[0])


def make_flashinfer_bf16(
    batch,
    kv_len,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=64,
    device="cuda",
    **options,
):
    """FlashInfer 0.7.2 paged decode, bf16 Q/KV/O.

    options: kv_layout="HND"|"NHD" (default HND, as FlashInfer's benchmark),
    use_tensor_cores=True (FlashInfer's bench_batch_decode.py and vLLM use True;
    False = CUDA-core decode kernel: time both and report the faster),
    graph_safe=False, workspace_bytes=256 MiB, enable_pdl=None (auto: on for sm90),
    shuffle_pages=True, seed=0, verify=False, mem_headroom_bytes=2 GiB.
    """
    _require_torch()
    return _make_flashinfer(
        "flashinfer-bf16",
        torch.bfloat16,
        batch,
        kv_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        device,
        **options,
    )


def make_flashinfer_fp8(
    batch,
    kv_len,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=64,
    device="cuda",
    **options,
):
    """FlashInfer 0.7.2 paged decode, bf16 Q/O, float8_e4m3fn KV cache.

    Same options as make_flashinfer_bf16, plus k_scale / v_scale (default None =
    1.0, no extra kernel). With use_tensor_cores=True the 'auto' backend picks
    fa2 (FA3 needs an fp8 query), i.e. the FA2 prefill kernel with in-kernel
    fp8 -> bf16 dequantisation.
    """
    _require_torch()
    return _make_flashinfer(
        "flashinfer-fp8",
        torch.float8_e4m3fn,
        batch,
        kv_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        device,
        **options,
    )


# --------------------------------------------------------------------------
# TensorRT-LLM XQA through FlashInfer (fp8 e4m3 KV, NHD)
# --------------------------------------------------------------------------


def make_trtllm_xqa_fp8(
    batch,
    kv_len,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=64,
    device="cuda",
    *,
    workspace_bytes: int = 256 * _MiB,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    enable_pdl: bool | None = None,
    shuffle_pages: bool = True,
    seed: int = 0,
    verify: bool = False,
    mem_headroom_bytes: int = 2 * _GiB,
):
    """flashinfer.decode.xqa_batch_decode_with_kv_cache, bf16 Q/O, fp8 e4m3 NHD cache.

    On sm90 with an fp8 cache FlashInfer runs XQA's Hopper kernel (mha_sm90.cu,
    fp8 GMMA). page_size must be 16/32/64/128.
    """
    _require_torch()
    fi = _import_flashinfer()
    dev = _require_cuda(device)
    fi_version = _check_version(fi)
    xqa_fn = getattr(fi.decode, "xqa_batch_decode_with_kv_cache", None)
    if xqa_fn is None:
        raise ImportError("flashinfer.decode.xqa_batch_decode_with_kv_cache not found")
    major, minor = torch.cuda.get_device_capability(dev)
    if major not in (9, 10, 12):
        raise BaselineUnavailable(f"XQA needs SM90/SM100/SM120, this GPU is sm{major}{minor}")
    if page_size not in (16, 32, 64, 128):
        raise BaselineUnavailable(f"XQA page_size must be 16/32/64/128, got {page_size}")
    if num_qo_heads % num_kv_heads:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
    _check_memory(
        required_bytes(
            "trtllm-xqa-fp8",
            batch,
            kv_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            workspace_bytes,
        ),
        dev,
        mem_headroom_bytes,
    )
    gen = _gen(dev, seed)
    P, block_tables, _indptr, _indices, _last = _page_table(
        batch, kv_len, page_size, dev, gen, shuffle_pages
    )
    del _indptr, _indices, _last
    total_pages = batch * P
    # NHD 5-D cache [pages, 2, page_size, H_kv, D]; the wrapper unbinds dim 1 (views).
    kv_cache = torch.empty(
        (total_pages, 2, page_size, num_kv_heads, head_dim), dtype=torch.float8_e4m3fn, device=dev
    )
    _fill_normal_(kv_cache, gen)
    q = torch.randn(batch, num_qo_heads, head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
    out = torch.empty_like(q)
    # MUST be zeros: the first 8 MiB are XQA's semaphores (the kernel leaves them at 0).
    workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
    # seq_lens: [B] int32/uint32 on device (kernel reads it as uint32).
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
    sm_scale = 1.0 / math.sqrt(head_dim)
    # bmm1_scale is the WHOLE logit scale: q_scale * k_scale / sqrt(D). Default 1.0 is wrong.
    bmm1_scale = sm_scale * float(k_scale)
    bmm2_scale = float(v_scale)  # v_scale / o_scale
    # NB: XQA sizes its grid from block_tables.shape[1] * page_size, not from
    # max_seq_len (which xqa_batch_decode_with_kv_cache does not forward), so
    # block_tables is exactly ceil(kv_len / page_size) wide.
    kwargs: dict[str, Any] = {"out": out, "kv_layout": "NHD"}
    if enable_pdl is not None:
        kwargs["enable_pdl"] = bool(enable_pdl)

    def fn():
        return xqa_fn(
            q, kv_cache, workspace, block_tables, seq_lens, kv_len, bmm1_scale, bmm2_scale, **kwargs
        )

    info: dict[str, Any] = {
        "method": "trtllm-xqa-fp8",
        "kv_bytes": kv_bytes(batch, kv_len, num_kv_heads, head_dim, 1),
        "alloc_bytes": kv_cache.numel() + workspace_bytes + 2 * q.numel() * 2 + 4 * total_pages,
        "impl": "flashinfer.decode.xqa_batch_decode_with_kv_cache -> xqa "
        + ("(sm90 fp8 GMMA kernel mha_sm90.cu)" if major == 9 else "(mha.cu)"),
        "flashinfer_version": fi_version,
        "kv_dtype": "float8_e4m3fn",
        "kv_layout": "NHD",
        "page_size": page_size,
        "batch": batch,
        "kv_len": kv_len,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }
    step = BaselineStep(
        fn,
        {
            "kv_cache": kv_cache,
            "q": q,
            "out": out,
            "ws": workspace,
            "bt": block_tables,
            "seq_lens": seq_lens,
        },
        "trtllm-xqa-fp8",
    )

    def ref():
        k0, v0 = _gather_seq0(
            kv_cache, block_tables[0].long(), "NHD", kv_len, num_kv_heads, head_dim
        )
        return _reference_seq0(q[0], k0, v0, bmm1_scale) * bmm2_scale

    # XQA's sm90 kernel also quantises Q and P to fp8: looser tolerance.
    return _finish(step, info, verify, ref, 0.15, lambda o: o[0])


# --------------------------------------------------------------------------
# torch SDPA over a contiguous (non-paged) bf16 cache
# --------------------------------------------------------------------------


def make_sdpa_bf16(
    batch,
    kv_len,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=64,
    device="cuda",
    *,
    mode: str = "gqa",
    backends=("CUDNN_ATTENTION", "FLASH_ATTENTION"),
    seed: int = 0,
    verify: bool = False,
    mem_headroom_bytes: int = 2 * _GiB,
):
    """torch.nn.functional.scaled_dot_product_attention, bf16, K/V [B, H_kv, L, D] contiguous.

    mode="gqa" (default): q [B, H_q, 1, D], K/V [B, H_kv, L, D], enable_gqa=True.
    mode="packed": the G = H_q/H_kv query heads sharing a KV head are passed as
      G query rows of that head, q.view(B, H_kv, G, D), no mask (identical
      maths at decode; it is the shape FA2 switches to internally).
    backends: SDPBackend names; the FIRST one that runs this shape is pinned
      (tried one at a time at make time, recorded in info["sdpa_backend"]), so
      the timed call never silently falls back to the math path.
    cuDNN first: the default order tries it, then flash; mem-efficient rejects
      enable_gqa. Output rel. L2 error vs fp32 ~2e-3 for both modes.
    page_size is ignored (cache is contiguous). The step returns [B, H_q, 1, D]
    ("gqa") or [B, H_kv, G, D] ("packed") without a reshape copy.
    """
    _require_torch()
    dev = _require_cuda(device)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if num_qo_heads % num_kv_heads:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
    if mode not in ("packed", "gqa"):
        raise ValueError("mode must be 'packed' or 'gqa'")
    bk_list = [getattr(SDPBackend, b) if isinstance(b, str) else b for b in backends]
    _check_memory(
        required_bytes("sdpa-bf16", batch, kv_len, num_qo_heads, num_kv_heads, head_dim, page_size),
        dev,
        mem_headroom_bytes,
    )
    gen = _gen(dev, seed)
    k = torch.empty(batch, num_kv_heads, kv_len, head_dim, dtype=torch.bfloat16, device=dev)
    v = torch.empty_like(k)
    _fill_normal_(k, gen)
    _fill_normal_(v, gen)
    q = torch.randn(batch, num_qo_heads, head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
    g = num_qo_heads // num_kv_heads
    if mode == "packed":
        qv = q.view(batch, num_kv_heads, g, head_dim)  # query head h -> kv head h // g
        extra: dict[str, Any] = {}
    else:
        qv = q.view(batch, num_qo_heads, 1, head_dim)
        extra = {"enable_gqa": True}

    def make_fn(bk):
        def fn():
            with sdpa_kernel([bk], set_priority=True):
                return F.scaled_dot_product_attention(qv, k, v, **extra)

        return fn

    chosen, fn, errors = None, None, []
    for bk in bk_list:  # pick the first backend that accepts the shape
        cand = make_fn(bk)
        try:
            cand()
            torch.cuda.synchronize()
        except RuntimeError as exc:
            errors.append(f"{bk}: {str(exc).splitlines()[0][:200]}")
            continue
        chosen, fn = bk, cand
        break
    if fn is None:
        del k, v, q, qv
        free_cuda_memory()
        raise BaselineUnavailable("no SDPA backend accepted the shape: " + "; ".join(errors))

    info: dict[str, Any] = {
        "method": "sdpa-bf16",
        "kv_bytes": kv_bytes(batch, kv_len, num_kv_heads, head_dim, 2),
        "alloc_bytes": 2 * k.numel() * 2 + q.numel() * 2,
        "impl": f"torch {torch.__version__} F.scaled_dot_product_attention ({mode}), "
        f"backend {chosen}, contiguous [B,H_kv,L,D] cache",
        "sdpa_backend": str(chosen),
        "sdpa_rejected": errors,
        "kv_dtype": "bfloat16",
        "kv_layout": "contiguous BHLD (not paged)",
        "batch": batch,
        "kv_len": kv_len,
    }
    step = BaselineStep(fn, {"k": k, "v": v, "q": q}, "sdpa-bf16")

    def ref():
        return _reference_seq0(
            q[0], k[0].transpose(0, 1), v[0].transpose(0, 1), 1.0 / math.sqrt(head_dim)
        )

    return _finish(step, info, verify, ref, 0.03, lambda o: o[0].reshape(num_qo_heads, head_dim))


def _require_torch() -> None:
    if torch is None:
        raise BaselineUnavailable("torch is not importable")


BASELINES: dict[str, Callable[..., tuple[BaselineStep, dict[str, Any]]]] = {
    "flashinfer-bf16": make_flashinfer_bf16,
    "flashinfer-fp8": make_flashinfer_fp8,
    "trtllm-xqa-fp8": make_trtllm_xqa_fp8,
    "sdpa-bf16": make_sdpa_bf16,
}


def prewarm(
    methods=None,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=64,
    device="cuda",
    variants=None,
) -> dict[str, str]:
    """JIT-compiles every kernel family once with a tiny shape (B=1, L=2 pages).

    variants: optional {method: [options dict, ...]} to also warm e.g.
    use_tensor_cores=False. Returns {label: "ok" | "skip: <reason>"}.
    """
    methods = list(methods or BASELINES)
    variants = variants or {}
    status: dict[str, str] = {}
    for m in methods:
        for opts in variants.get(m, [{}]):
            label = m + (f" {opts}" if opts else "")
            try:
                step, _ = BASELINES[m](
                    1,
                    2 * page_size,
                    num_qo_heads,
                    num_kv_heads,
                    head_dim,
                    page_size,
                    device,
                    **opts,
                )
                step.close()
                status[label] = "ok"
            except (ImportError, RuntimeError) as exc:
                status[label] = f"skip: {exc}"
            free_cuda_memory()
    return status
