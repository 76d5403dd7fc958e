"""Decode backends: a registry from a name to a :class:`Backend`, which
:func:`foscar.decode_attention` dispatches through.

A backend says whether it can run on a device (``available``), whether it covers a cache and a
query head count (``supports``: None, or the reason it does not), and makes plans (``plan``):
FlashInfer's wrapper pattern, a plan made once per DecodeBatch (one layer's page tables and
lengths) owns what its launches keep between calls (split workspaces, bound launches, TMA
descriptors), and its ``run(q, out=, lse=, return_lse=)`` takes what changes per call. A
backend writes nothing onto the cache or the batch. Registered names:

* ``"gluon"``: the warp-specialized Hopper kernel (foscar.backends.gluon);
* ``"gluon-e4m3"``: the same kernel with FP8 (E4M3) operands, faster and less accurate;
* ``"triton"``: the Triton split kernel on any GPU, or the CPU interpreter (foscar.backends.triton);
* ``"triton-reconstruct"``, ``"gluon-reconstruct"``: the kernels with per-value
  reconstruction instead of the folds, the baselines ``foscar bench`` compares against;
* ``"reference"``: the folded torch computation (foscar.backends.folded).

The launcher modules: ``triton.py`` (the Triton split kernel), ``gluon.py`` (the Gluon kernel;
the window partial of ``triton.py``), ``folded.py`` (torch) and ``combine.py`` (the split
workspace, the partials' conventions and the LSE merge both kernels share).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from ..cache import DecodeBatch, QuantizedKVCache
from . import folded, gluon, triton

__all__ = ["Backend", "DecodeRun", "REFERENCE_BLOCK_N", "get", "names", "register"]

#: Tokens per tile of the CPU reference backend. Per-tile Python work dominates on a CPU, so
#: fewer, larger tiles take less time per call; the result changes only by fp32 rounding.
REFERENCE_BLOCK_N = 1024


class DecodeRun(Protocol):
    """A backend's plan over one DecodeBatch: what :meth:`Backend.plan` returns."""

    def run(
        self,
        q: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Attention of ``q: [B, Hq, D]`` over the batch in the stored coordinates; returns
        ``o`` (``out`` when given), and ``lse: [B, Hq]`` float32 with ``return_lse``."""


class Backend(Protocol):
    """What :func:`foscar.decode_attention` needs of a backend.

    ``name``: its registry name; ``requirement``: what :meth:`available` needs, said when it is
    missing; ``query_dtypes``: the query dtypes it takes (None: any floating dtype).
    """

    name: str
    requirement: str
    query_dtypes: tuple[torch.dtype, ...] | None

    def available(self, device: torch.device) -> bool:
        """Whether it can run on ``device`` here (software and hardware)."""

    def supports(self, cache: QuantizedKVCache, num_q_heads: int) -> str | None:
        """None if it covers ``cache`` (every layer's format) and ``num_q_heads``, else why not;
        ``cache`` may be a :class:`foscar.cache.CacheLayout` (its sizes, nothing allocated)."""

    def plan(
        self, cache: QuantizedKVCache, batch: DecodeBatch, num_q_heads: int, sm_scale: float
    ) -> DecodeRun:
        """A plan of its launches over ``batch`` (``batch.layer`` of ``cache``) for queries of
        ``num_q_heads`` heads at ``sm_scale``."""


#: each cache's (or CacheLayout's) coverage answers, by (backend, query heads): a cache's
#: formats, head_dim, page size and KV heads never change, and the checks walk every layer's
#: format (decode_attention asks up to twice per layer and step; docs/tuning.md, Serving path,
#: row "kernel backends' coverage checks")
_COVERAGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class KernelBackend:
    """A kernel launcher module (``available``, ``supports``) and its plan class, made with
    fixed keyword arguments ``options``; ``extra_check``: a coverage check run before
    ``supports``."""

    name: str
    module: ModuleType
    plan_class: type
    requirement: str
    options: tuple[tuple[str, object], ...] = ()
    extra_check: Callable[[QuantizedKVCache], str | None] | None = None
    query_dtypes: tuple[torch.dtype, ...] | None = (torch.bfloat16,)

    def available(self, device: torch.device) -> bool:
        return self.module.available(device)

    def supports(self, cache: QuantizedKVCache, num_q_heads: int) -> str | None:
        answers = _COVERAGE.setdefault(cache, {})
        key = (self.name, num_q_heads)
        if key not in answers:
            answers[key] = (self.extra_check and self.extra_check(cache)) or self.module.supports(
                cache, num_q_heads
            )
        return answers[key]

    def plan(self, cache, batch, num_q_heads, sm_scale):
        return self.plan_class(cache, batch, num_q_heads, sm_scale, **dict(self.options))


@dataclass(frozen=True)
class ReferenceBackend:
    """The folded torch computation in fp32 (fp64 for fp64 queries), tiles of ``block_n``."""

    name: str = "reference"
    requirement: str = "torch"
    query_dtypes: tuple[torch.dtype, ...] | None = None
    block_n: int = REFERENCE_BLOCK_N

    def available(self, device: torch.device) -> bool:
        return True

    def supports(self, cache: QuantizedKVCache, num_q_heads: int) -> str | None:
        return None

    def plan(self, cache, batch, num_q_heads, sm_scale):
        return folded.FoldedDecodePlan(cache, batch, num_q_heads, sm_scale, block_n=self.block_n)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Add ``backend`` under ``backend.name`` (replacing one of that name)."""
    _REGISTRY[backend.name] = backend


def get(name: str) -> Backend:
    """The backend registered as ``name``; raises ``ValueError`` naming the choices."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {names()}, got {name!r}") from None


def names() -> tuple[str, ...]:
    """Registered backend names, in registration order."""
    return tuple(_REGISTRY)


_GLUON_NEEDS = "triton's Gluon and a Hopper (sm_90) GPU"
_TRITON_NEEDS = "Triton and a CUDA device (or TRITON_INTERPRET=1 on the CPU)"
for _backend in (
    KernelBackend("gluon", gluon, gluon.GluonDecodePlan, _GLUON_NEEDS),
    KernelBackend("triton", triton, triton.TritonDecodePlan, _TRITON_NEEDS),
    ReferenceBackend(),
    KernelBackend(
        "triton-reconstruct", triton, triton.TritonDecodePlan, _TRITON_NEEDS,
        (("reconstruct", True),),
    ),
    KernelBackend(
        "gluon-reconstruct", gluon, gluon.GluonDecodePlan, _GLUON_NEEDS, (("reconstruct", True),)
    ),
    KernelBackend(
        "gluon-e4m3",
        gluon,
        gluon.GluonDecodePlan,
        _GLUON_NEEDS,
        (("operands", "e4m3"),),
        extra_check=gluon.supports_e4m3,
    ),
):
    register(_backend)
del _backend
