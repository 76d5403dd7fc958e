"""GPU timing helpers for short (sub-100 us) decode kernels.

Timing model, per timed call:

    [L2 flush]  [GPU spin]  start-event  fn()  end-event
     untimed     untimed    |<--- timed --->|

* L2 flush (default ``"write_read"``): ``zero_()`` a 256 MiB buffer, then read
  the first 3/4 of it. The write evicts everything; the read evicts the
  flush's own *dirty* lines, so the timed call does not pay for writing back
  ~60 MB of dirty L2 (H200 L2 = 60 MB, per torch device properties).
  ``"write"`` is the FlashInfer/Triton style (``buffer.zero_()`` only).
* GPU spin (``torch.cuda._sleep``): keeps the GPU busy while the CPU enqueues
  the start event and the whole call, so host-side launch latency between the
  kernels of one decode step is not timed (only GPU gaps are). Set
  ``spin_us=0`` to disable.
* ``cuda_graph=True`` captures ``fn`` once in a CUDA graph and times
  ``graph.replay()`` instead (no per-kernel launch gaps at all; PDL edges are
  kept). The flush and spin stay outside the graph.

Only ``torch`` is imported at module import; nothing touches CUDA until a
function is called, so the module imports on CPU-only machines.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

try:  # keep the module importable even without torch
    import torch
except Exception:  # pragma: no cover
    torch = None  # type: ignore[assignment]

__all__ = [
    "L2Flusher",
    "capture_graph",
    "bench",
    "bench_stats",
]

_MiB = 1 << 20


def _require_cuda() -> None:
    if torch is None:
        raise RuntimeError("timing: torch is not importable")
    if not torch.cuda.is_available():
        raise RuntimeError("timing: CUDA is not available on this machine")


class L2Flusher:
    """Evicts the L2 cache between timed calls (the flush itself is not timed).

    mode: "write_read" (default), "write" (zero_ only), or "read" (read only).
    nbytes: buffer size; default max(256 MiB, 4 x L2 size).
    """

    def __init__(
        self,
        nbytes: int | None = None,
        device: torch.device | str | None = None,
        mode: str = "write_read",
    ) -> None:
        _require_cuda()
        if mode not in ("write_read", "write", "read"):
            raise ValueError(f"unknown flush mode {mode!r}")
        dev = torch.device(device if device is not None else "cuda")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 0)
        if nbytes is None:
            nbytes = max(256 * _MiB, 4 * l2)
        nbytes = int(math.ceil(nbytes / 4096) * 4096)
        self.mode = mode
        self.nbytes = nbytes
        self.device = dev
        # float32 view: zero_ is a memset, the read is a vectorised sum.
        self._buf = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
        self._buf.zero_()
        # Read 3/4 of the buffer from the start: those lines were evicted by
        # the tail of the write, so every read misses and pushes out the
        # dirty tail lines (written back here, untimed).
        self._read_view = self._buf[: (3 * self._buf.numel()) // 4]
        self._sink = torch.empty((), dtype=torch.float32, device=dev)

    def __call__(self) -> None:
        if self.mode in ("write_read", "write"):
            self._buf.zero_()
        if self.mode in ("write_read", "read"):
            torch.sum(self._read_view, dim=0, out=self._sink)

    def free(self) -> None:
        self._buf = self._read_view = self._sink = None  # type: ignore[assignment]


_SPIN_CYCLES_PER_US: dict[int, float] = {}


def _spin_cycles_per_us(device_index: int) -> float:
    """Calibrates torch.cuda._sleep (cycles -> microseconds) once per device."""
    if device_index in _SPIN_CYCLES_PER_US:
        return _SPIN_CYCLES_PER_US[device_index]
    cycles = 2_000_000
    with torch.cuda.device(device_index):
        torch.cuda._sleep(cycles)  # warm
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        e.synchronize()
        us = s.elapsed_time(e) * 1e3
    rate = cycles / max(us, 1e-3)
    _SPIN_CYCLES_PER_US[device_index] = rate
    return rate


def capture_graph(fn: Callable[[], object], warmup: int = 3, pool=None) -> torch.cuda.CUDAGraph:
    """Captures one call of ``fn`` into a CUDA graph (after side-stream warm-up).

    The caller must keep ``fn`` (and the tensors it closes over) alive for as
    long as the graph is replayed: the graph holds raw pointers, not refs.
    """
    _require_cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    except Exception as exc:  # re-raise with a hint
        raise RuntimeError(
            "CUDA graph capture of the decode step failed "
            f"({type(exc).__name__}: {exc}). The callable probably syncs with "
            "the host or allocates outside the graph pool; time it with "
            "cuda_graph=False, or build it in a graph-safe mode."
        ) from exc
    torch.cuda.synchronize()
    return graph


def _time_calls(
    fn: Callable[[], object],
    iters: int,
    warmup: int,
    flusher: L2Flusher | None,
    spin_cycles: int,
) -> list[float]:
    for _ in range(warmup):
        if flusher is not None:
            flusher()
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flusher is not None:
            flusher()
        if spin_cycles > 0:
            torch.cuda._sleep(spin_cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def bench_stats(
    fn: Callable[[], object],
    *,
    iters: int = 100,
    warmup: int = 10,
    flush: bool = True,
    flush_mode: str = "write_read",
    flush_bytes: int | None = None,
    cuda_graph: bool = False,
    spin_us: float = 100.0,
    flusher: L2Flusher | None = None,
) -> dict[str, object]:
    """Times ``fn`` (zero-arg, one decode step) and returns statistics in ms.

    Returns a dict with median_ms (the headline number), mean_ms, min_ms,
    p10_ms, p90_ms, std_ms, n, mode, and times_ms (all samples).
    Pass a prebuilt ``flusher`` to reuse one flush buffer across many calls.
    """
    _require_cuda()
    if iters < 1:
        raise ValueError("iters must be >= 1")
    own_flusher = False
    if flush and flusher is None:
        flusher = L2Flusher(flush_bytes, mode=flush_mode)
        own_flusher = True
    if not flush:
        flusher = None
    dev = torch.cuda.current_device()
    spin_cycles = int(spin_us * _spin_cycles_per_us(dev)) if spin_us > 0 else 0

    graph = None
    target = fn
    if cuda_graph:
        graph = capture_graph(fn)
        target = graph.replay
    try:
        times = _time_calls(target, iters, warmup, flusher, spin_cycles)
    finally:
        if own_flusher and flusher is not None:
            flusher.free()
        del graph
    times_sorted = sorted(times)

    def q(p: float) -> float:
        k = min(len(times_sorted) - 1, max(0, int(round(p * (len(times_sorted) - 1)))))
        return times_sorted[k]

    return {
        "median_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "min_ms": times_sorted[0],
        "p10_ms": q(0.10),
        "p90_ms": q(0.90),
        "std_ms": statistics.pstdev(times) if len(times) > 1 else 0.0,
        "n": len(times),
        "mode": ("graph" if cuda_graph else "eager") + ("+flush" if flusher else ""),
        "times_ms": times,
    }


def bench(fn: Callable[[], object], **kwargs) -> float:
    """Median time of one call of ``fn`` in milliseconds (see bench_stats)."""
    return float(bench_stats(fn, **kwargs)["median_ms"])
