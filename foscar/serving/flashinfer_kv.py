"""BF16 and FP8 paged KV caches attended by FlashInfer's paged kernels: the baselines a serving
engineer runs today (vLLM's and SGLang's FlashInfer backends, ``--kv-cache-dtype fp8``), in the
same engine and step protocol as foscar's :class:`~foscar.serving.PagedKV`.

Storage: per layer a K and a V tensor ``[num_pages + 1, page_size, H, D]`` (FlashInfer's NHD
layout, passed as the ``(k_cache, v_cache)`` tuple), in BF16 or FP8 E4M3; pages are the engine's
block ids, and the last page is scratch, where the padding rows of a captured step write and read.
FP8 stores ``k / k_scale`` saturated to E4M3's +-448 (per layer, per tensor, as vLLM writes its
cache) and the kernels scale back: FlashInfer folds ``k_scale`` into the softmax scale and
multiplies the output by ``v_scale``. The scales default to 1.0, what vLLM runs without
calibrated scales in the checkpoint.

A step (the engine's packed batch, ``T`` tokens): :meth:`FlashInferPagedKV.begin_step` takes the
rows (request, past length, new tokens, block ids) and, on the host and once for every layer,
lists each row's pages, its last page's length and each new token's slot, copies them to the
device and plans one wrapper: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor-core kernel) when
every row decodes one token, else ``BatchPrefillWithPagedKVCacheWrapper`` (causal, aligned to
the end of each row's KV), which serves prefill, chunk and decode rows in one launch. Per layer
:meth:`FlashInferPagedKV.attend` writes the new K/V into their slots (one ``index_copy_`` each)
and runs the planned wrapper.

CUDA graphs (``cuda_graphs=True``): a decode-only step of ``T`` packed tokens (the engine pads to
its buckets) plans a decode wrapper of ``T`` rows built for CUDA graphs (fixed indptr, indices
and last-page buffers, one wrapper per ``T``), and its write slots go to a fixed buffer; the
padding rows write to and read one token of the scratch page. The engine captures such a step
once per ``T`` and replays it after each ``begin_step``. Steps with prefill rows run eagerly.

``attention="torch"``: the same pool and plan read by a pure-torch paged attention (fp32), the
reference the tests compare with, and the only path on a CPU (FlashInfer needs CUDA).

Shapes: ``T`` packed tokens, ``H_q`` query heads, ``H`` KV heads, ``D`` head_dim.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .core import StepRow

__all__ = [
    "FLASHINFER_STORAGE",
    "FlashInferPagedKV",
    "attention_description",
    "flashinfer_bytes_per_token",
    "flashinfer_unavailable",
    "serving_kv",
]

#: storage dtype of each FlashInfer cache
FLASHINFER_STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
#: E4M3's largest finite value: stored values saturate to it (vLLM's cache write does)
E4M3_MAX = 448.0
#: FlashInfer's float workspace (its docs recommend 128 MB)
WORKSPACE_BYTES = 128 << 20


def flashinfer_unavailable(device) -> str | None:
    """Why FlashInfer's kernels cannot run on ``device`` (one line), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FlashInfer's kernels need a CUDA device; the model is on {device}"
    if importlib.util.find_spec("flashinfer") is None:
        return "FlashInfer is not installed (pip install 'foscar[flashinfer]')"
    return None


def flashinfer_bytes_per_token(storage: str, num_layers: int, num_kv_heads: int,
                               head_dim: int) -> int:
    """Bytes one token takes over all layers (K and V) in a FlashInfer cache of ``storage``."""
    if storage not in FLASHINFER_STORAGE:
        raise ValueError(f"storage must be one of {sorted(FLASHINFER_STORAGE)}, got {storage!r}")
    itemsize = torch.tensor([], dtype=FLASHINFER_STORAGE[storage]).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def attention_description(storage: str, attention: str = "flashinfer") -> str:
    """How logs and ``/stats`` name the attention of a FlashInfer cache."""
    kind = {"bf16": "BF16", "fp8": "FP8 E4M3 (k_scale, v_scale)"}[storage]
    if attention == "torch":
        return f"{kind} paged cache, torch reference attention"
    return (f"{kind} paged cache, FlashInfer BatchPrefillWithPagedKVCacheWrapper / "
            "BatchDecodeWithPagedKVCacheWrapper")


@dataclass
class _Step:
    """A begun step: what the host planned once for every layer."""

    rows: tuple[StepRow, ...]
    tokens: int  # tokens attended and written: the rows', or every packed token when graphed
    decode_only: bool
    graphed: bool  # planned as a capturable decode step (padding rows included)
    slots: torch.Tensor  # [tokens] int64 on the device: flat (page * page_size + row) slots
    pages: list  # per attended row: its pages (host; the torch path reads them)
    kv_lengths: list  # per attended row: tokens it holds after the step
    wrapper: object = None  # the planned FlashInfer wrapper (None on the torch path)


class FlashInferPagedKV:
    """An engine's KV storage in BF16 or FP8 paged tensors, attended by FlashInfer (module
    docstring). The protocol is :class:`~foscar.serving.PagedKV`'s: ``begin_step``, ``attend``
    per layer, ``end_step``, ``release``.

    Parameters
    ----------
    storage : ``"bf16"`` or ``"fp8"`` (E4M3)
    num_layers, num_kv_heads, num_q_heads, head_dim : int
        The model's (this process's heads under tensor parallelism).
    num_blocks : int
        Pages; more than the largest engine block id.
    block_size : int
        Tokens per page and engine block.
    device : torch.device or str
    sm_scale : float
        The model's logit scale (``attend`` checks each layer's against it: the plan holds it).
    attention : ``"flashinfer"`` (CUDA) or ``"torch"`` (the fp32 reference, any device)
    max_step_tokens : int, optional
        Most packed tokens of a forward (required with ``cuda_graphs``).
    cuda_graphs : bool
        Make decode-only steps capturable (module docstring).
    k_scale, v_scale : float or sequence of float (one per layer)
        FP8's scales (1.0: vLLM's default); BF16 takes 1.0 only.
    """

    def __init__(self, storage: str, *, num_layers: int, num_kv_heads: int, num_q_heads: int,
                 head_dim: int, num_blocks: int, block_size: int, device="cpu",
                 sm_scale: float | None = None, attention: str = "flashinfer",
                 max_step_tokens: int | None = None, cuda_graphs: bool = False,
                 k_scale=1.0, v_scale=1.0) -> None:
        if storage not in FLASHINFER_STORAGE:
            raise ValueError(
                f"storage must be one of {sorted(FLASHINFER_STORAGE)}, got {storage!r}")
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("num_q_heads", num_q_heads), ("head_dim", head_dim),
                            ("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if attention not in ("flashinfer", "torch"):
            raise ValueError(f"attention must be 'flashinfer' or 'torch', got {attention!r}")
        device = torch.device(device)
        if attention == "flashinfer":
            reason = flashinfer_unavailable(device)
            if reason is not None:
                raise ValueError(f"attention='flashinfer': {reason}")
        if cuda_graphs and (attention != "flashinfer" or max_step_tokens is None):
            raise ValueError("cuda_graphs=True needs attention='flashinfer' and max_step_tokens")
        self.k_scales = _per_layer(k_scale, num_layers, "k_scale")
        self.v_scales = _per_layer(v_scale, num_layers, "v_scale")
        if storage == "bf16" and any(s != 1.0 for s in self.k_scales + self.v_scales):
            raise ValueError("k_scale and v_scale apply to storage='fp8' only")
        self.storage, self.attention = storage, attention
        self.num_layers, self.num_kv_heads, self.num_q_heads = num_layers, num_kv_heads, num_q_heads
        self.head_dim, self.block_size, self.device = head_dim, block_size, device
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.max_step_tokens, self.cuda_graphs = max_step_tokens, cuda_graphs
        self.scratch_page = num_blocks  # the page after the engine's
        dtype = FLASHINFER_STORAGE[storage]
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        #: no window slots: a request needs only blocks (the engine's admission)
        self.max_requests = num_blocks
        #: never filled: a restarted request simply starts empty (kv_stats counts these)
        self.restarts: list = []
        #: the most pages live requests held at once (each request its own: no sharing)
        self.peak_pages = 0
        #: requests started as a copy of another (:meth:`fork`)
        self.forks = 0
        self._lengths: dict[Hashable, int] = {}
        self._step: _Step | None = None
        self._wrappers: dict = {}  # ("decode", rows) / "prefill" / "decode" -> wrapper
        self._workspace = None
        self._slot_buffer = None
        if attention == "flashinfer":
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            if cuda_graphs:
                self._slot_buffer = torch.zeros(max_step_tokens, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ requests
    def release(self, request_id: Hashable) -> None:
        """End a request: nothing of it is read again (its pages are the engine's to reuse)."""
        self._lengths.pop(request_id, None)

    def release_all(self) -> None:
        self._lengths.clear()

    def fork(self, parent_id: Hashable, request_id: Hashable, source_blocks: Sequence[int],
             block_ids: Sequence[int]) -> None:
        """Start request ``request_id`` as a copy of live request ``parent_id``: the parent's
        pages ``source_blocks`` are copied into ``block_ids`` (the fork's fresh engine blocks, in
        the same order) in every layer, and it holds the parent's tokens."""
        if parent_id not in self._lengths:
            raise ValueError(f"parent_id {parent_id!r} is not a live request")
        if len(source_blocks) != len(block_ids):
            raise ValueError(f"source_blocks and block_ids must be as long, got "
                             f"{len(source_blocks)} and {len(block_ids)}")
        blocks = [*source_blocks, *block_ids]
        if blocks:
            if not 0 <= min(blocks) <= max(blocks) < self.scratch_page:
                raise ValueError(f"block ids outside the pool's {self.scratch_page}")
            src = torch.tensor(list(source_blocks), device=self.device)
            dst = torch.tensor(list(block_ids), device=self.device)
            for pages in self.k_pages + self.v_pages:
                pages[dst] = pages[src]
        self._lengths[request_id] = self._lengths[parent_id]
        self.forks += 1

    def pool_bytes(self) -> int:
        """Bytes of the K and V pages (the scratch page included)."""
        return sum(t.numel() * t.element_size() for t in self.k_pages + self.v_pages)

    @property
    def step_capturable(self) -> bool:
        """The begun step may be captured and replayed: ``cuda_graphs`` and every row decodes."""
        return self._step is not None and self._step.graphed

    # ------------------------------------------------------------------ steps
    def begin_step(self, rows: Sequence[StepRow], *, num_tokens: int | None = None) -> None:
        """Take the next forward's rows (``block_ids`` required: the pages) and plan it once for
        every layer; ``num_tokens``: the forward's packed tokens (padding included)."""
        rows = tuple(rows)
        self._step = None
        if not rows:
            raise ValueError("rows must name at least one request")
        total = sum(r.query_length for r in rows)
        packed = total if num_tokens is None else num_tokens
        if isinstance(packed, bool) or not isinstance(packed, int) or packed < total:
            raise ValueError(f"num_tokens must be an int >= the rows' {total} tokens, "
                             f"got {num_tokens!r}")
        bs = self.block_size
        for i, r in enumerate(rows):
            if r.query_length < 1 or r.past_length < 0:
                raise ValueError(f"rows[{i}]: query_length must be >= 1 and past_length >= 0")
            if r.past_length and self._lengths.get(r.request_id) != r.past_length:
                raise ValueError(
                    f"rows[{i}]: request {r.request_id!r} holds "
                    f"{self._lengths.get(r.request_id, 'no')} tokens, the engine says "
                    f"{r.past_length}")
            need = -(-(r.past_length + r.query_length) // bs)
            if r.block_ids is None or len(r.block_ids) < need:
                raise ValueError(f"rows[{i}]: {r.past_length + r.query_length} tokens need "
                                 f"{need} block ids, got {r.block_ids!r}")
            if max(r.block_ids[:need]) >= self.scratch_page or min(r.block_ids[:need]) < 0:
                raise ValueError(f"rows[{i}]: block ids outside the pool's {self.scratch_page}")
        decode_only = all(r.past_length and r.query_length == 1 for r in rows)
        graphed = self.cuda_graphs and decode_only
        if graphed and packed > self.max_step_tokens:
            raise ValueError(f"the step packs {packed} tokens, more than max_step_tokens="
                             f"{self.max_step_tokens}")
        pages, kv_lengths, slots = [], [], []
        for r in rows:
            held = r.past_length + r.query_length
            pages.append(list(r.block_ids[: -(-held // bs)]))
            kv_lengths.append(held)
            slots += [r.block_ids[t // bs] * bs + t % bs for t in range(r.past_length, held)]
        if graphed:  # padding rows: one token in the scratch page each
            pad = packed - total
            pages += [[self.scratch_page]] * pad
            kv_lengths += [1] * pad
            slots += [self.scratch_page * bs] * pad
        for r in rows:
            self._lengths[r.request_id] = r.past_length + r.query_length
        held_pages = sum(-(-n // bs) for n in self._lengths.values())
        self.peak_pages = max(self.peak_pages, held_pages)
        slot_tensor = _to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        if graphed:
            self._slot_buffer[: len(slots)].copy_(slot_tensor, non_blocking=True)
            slot_tensor = self._slot_buffer[: len(slots)]
        step = _Step(rows, len(slots), decode_only, graphed, slot_tensor, pages, kv_lengths)
        if self.attention == "flashinfer":
            step.wrapper = self._plan(step)
        self._step = step

    def end_step(self, *, graphed: bool) -> None:
        """Nothing to record: the lengths advanced at :meth:`begin_step`, for every layer."""

    def _plan(self, step: _Step):
        """The step's wrapper, planned (host work and one copy of the page lists)."""
        import flashinfer

        bs = self.block_size
        indptr = [0]
        for p in step.pages:
            indptr.append(indptr[-1] + len(p))
        host = dict(
            indptr=torch.tensor(indptr, dtype=torch.int32),
            indices=torch.tensor([p for ps in step.pages for p in ps], dtype=torch.int32),
            last_page_len=torch.tensor([n - (math.ceil(n / bs) - 1) * bs
                                        for n in step.kv_lengths], dtype=torch.int32),
        )
        if self.device.type == "cuda":
            host = {k: v.pin_memory() for k, v in host.items()}
        dtypes = dict(q_data_type=torch.bfloat16, kv_data_type=FLASHINFER_STORAGE[self.storage],
                      o_data_type=torch.bfloat16)
        heads = (self.num_q_heads, self.num_kv_heads, self.head_dim, bs)
        if step.decode_only:
            wrapper = self._decode_wrapper(len(step.pages) if step.graphed else None)
            wrapper.plan(host["indptr"], host["indices"], host["last_page_len"], *heads,
                         pos_encoding_mode="NONE", sm_scale=self.sm_scale, **dtypes)
            return wrapper
        if "prefill" not in self._wrappers:
            self._wrappers["prefill"] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD")
        wrapper = self._wrappers["prefill"]
        qo = [0]
        for r in step.rows:
            qo.append(qo[-1] + r.query_length)
        qo_indptr = torch.tensor(qo, dtype=torch.int32)
        wrapper.plan(qo_indptr.pin_memory() if self.device.type == "cuda" else qo_indptr,
                     host["indptr"], host["indices"], host["last_page_len"], *heads,
                     causal=True, sm_scale=self.sm_scale, **dtypes)
        return wrapper

    def _decode_wrapper(self, fixed_rows: int | None):
        """The eager decode wrapper (``fixed_rows`` None), or the CUDA-graph one of that many
        rows, with its own fixed buffers (built once)."""
        import flashinfer

        key = ("decode", fixed_rows)
        if key not in self._wrappers:
            if fixed_rows is None:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, kv_layout="NHD", use_tensor_cores=True)
            else:
                dev = self.device
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, kv_layout="NHD", use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=torch.zeros(fixed_rows + 1, dtype=torch.int32,
                                                       device=dev),
                    paged_kv_indices_buffer=torch.zeros(self.scratch_page + fixed_rows,
                                                        dtype=torch.int32, device=dev),
                    paged_kv_last_page_len_buffer=torch.zeros(fixed_rows, dtype=torch.int32,
                                                              device=dev),
                )
            self._wrappers[key] = wrapper
        return self._wrappers[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scaling: float, prefill_attention=None) -> torch.Tensor:
        """Store layer ``layer``'s new K/V of the begun step and attend: ``q [T', H_q, D]``,
        ``k, v [T', H, D]`` (``T'`` at least the step's packed tokens) -> ``[T', H_q, D]`` in
        ``q``'s dtype (padding rows zero, or meaningless in a captured step).
        ``prefill_attention`` is ignored (the kernels attend every row)."""
        step = self._step
        if step is None:
            raise RuntimeError("attend() before begin_step()")
        if not math.isclose(scaling, self.sm_scale, rel_tol=1e-6):
            raise ValueError(f"layer {layer} scales logits by {scaling}, the plan by "
                             f"{self.sm_scale} (sm_scale)")
        n = step.tokens
        if min(q.shape[0], k.shape[0], v.shape[0]) < n:
            raise ValueError(f"the step attends {n} tokens, q, k and v hold {q.shape[0]}, "
                             f"{k.shape[0]} and {v.shape[0]}")
        k_pages, v_pages = self.k_pages[layer], self.v_pages[layer]
        flat = (-1, self.num_kv_heads, self.head_dim)
        for pages, new, scale in ((k_pages, k, self.k_scales[layer]),
                                  (v_pages, v, self.v_scales[layer])):
            stored = self._stored(new[:n], scale)
            if self.storage == "fp8":  # (index_copy_ of float8 is not everywhere: its bytes)
                pages, stored = pages.view(torch.uint8), stored.view(torch.uint8)
            pages.view(flat).index_copy_(0, step.slots, stored)
        query = q[:n].contiguous()
        if self.attention == "torch":
            out = self._torch_attention(layer, step, query)
        else:
            scales = {}
            if self.k_scales[layer] != 1.0:
                scales["k_scale"] = self.k_scales[layer]
            if self.v_scales[layer] != 1.0:
                scales["v_scale"] = self.v_scales[layer]
            out = step.wrapper.run(query, (k_pages, v_pages), **scales)
        out = out.to(q.dtype)
        if n == q.shape[0]:
            return out
        full = torch.zeros_like(q)
        full[:n] = out
        return full

    def _stored(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` as the pages store it (FP8: divided by ``scale`` and saturated to E4M3)."""
        if self.storage == "bf16":
            return x.to(torch.bfloat16)
        if scale != 1.0:
            x = x.float() / scale
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    def _torch_attention(self, layer: int, step: _Step, query: torch.Tensor) -> torch.Tensor:
        """The reference: each row's pages gathered, dequantized (fp32) and attended causally
        (the row's new tokens aligned to the end of its KV)."""
        group = self.num_q_heads // self.num_kv_heads
        k_scale, v_scale = self.k_scales[layer], self.v_scales[layer]
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        start = 0
        row_tokens = [r.query_length for r in step.rows] + [1] * (len(step.pages) - len(step.rows))
        for pages, length, q_len in zip(step.pages, step.kv_lengths, row_tokens):
            index = torch.tensor(pages, device=query.device)
            keys = self.k_pages[layer][index].flatten(0, 1)[:length].float() * k_scale
            values = self.v_pages[layer][index].flatten(0, 1)[:length].float() * v_scale
            q = query[start : start + q_len].float()  # [t, H_q, D]
            keys = keys.repeat_interleave(group, dim=1)  # [L, H_q, D]
            values = values.repeat_interleave(group, dim=1)
            logits = torch.einsum("thd,lhd->htl", q, keys) * self.sm_scale
            # new token j sits at position length - q_len + j and sees positions up to it
            visible = (torch.arange(length, device=q.device)[None, :]
                       <= torch.arange(length - q_len, length, device=q.device)[:, None])
            logits = logits.masked_fill(~visible, float("-inf"))
            out[start : start + q_len] = torch.einsum(
                "htl,lhd->thd", logits.softmax(-1), values)
            start += q_len
        return out


def _per_layer(value, num_layers: int, name: str) -> list[float]:
    values = [value] * num_layers if isinstance(value, (int, float)) else list(value)
    if len(values) != num_layers or not all(
        isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in values
    ):
        raise ValueError(f"{name} must be a positive number or one per layer ({num_layers}), "
                         f"got {value!r}")
    return [float(s) for s in values]


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: from pinned memory without a sync on a GPU."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def serving_kv(name: str, device, dtype: torch.dtype) -> tuple[str, str]:
    """What ``foscar serve --kv bf16|fp8`` runs on ``device`` for a model in ``dtype``: the
    FlashInfer cache where FlashInfer can run, else for ``bf16`` the engine's own cache and its
    paged SDPA path. Returns ``(kv, why)`` (``build_manager``'s kv and a line that says which
    attention runs); raises ``ValueError`` (one line) for ``fp8`` without FlashInfer."""
    if name not in FLASHINFER_STORAGE:
        raise ValueError(f"name must be one of {sorted(FLASHINFER_STORAGE)}, got {name!r}")
    reason = flashinfer_unavailable(device)
    if reason is None and dtype != torch.bfloat16:
        reason = f"FlashInfer's caches take bfloat16 queries; the model computes in {dtype}"
    if reason is None:
        return f"flashinfer-{name}", f"--kv {name}: {attention_description(name)}"
    if name == "fp8":
        raise ValueError(f"--kv fp8 runs on FlashInfer's kernels: {reason}")
    return "sdpa-bf16", (f"--kv bf16: {reason}; the engine's own BF16 cache and its paged SDPA "
                         "path serve instead")
