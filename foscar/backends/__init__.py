"""Decode backends: a registry from a name to a :class:`Backend`, which
:func:`foscar.decode_attention` dispatches through.

A backend says whether it can run on a device (``available``), whether it covers a cache and a
query head count (``supports``: None, or the reason it does not) and launches (``launch``).
Registered names:

* ``"gluon"``: the warp-specialized Hopper kernel (foscar.backends.gluon);
* ``"gluon-e4m3"``: the same kernel with FP8 (E4M3) operands, faster and less accurate;
* ``"triton"``: the Triton split kernel on any GPU, or the CPU interpreter (foscar.backends.triton);
* ``"triton-reconstruct"``, ``"gluon-reconstruct"``: the kernels with per-value
  reconstruction instead of the folds, the baselines ``foscar bench`` compares against;
* ``"reference"``: the folded torch computation (:func:`foscar.reference.attend_folded`).

The launcher modules: ``triton.py``, ``gluon.py`` and ``combine.py`` (the split workspace, the
BF16 window partial and the LSE merge both kernels share).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from .. import reference
from ..cache import DecodeBatch, QuantizedKVCache
from ..triton_runtime import on_device
from . import gluon, triton

__all__ = ["Backend", "REFERENCE_BLOCK_N", "get", "names", "register"]

#: Tokens per tile of the CPU reference backend. Per-tile Python work dominates on a CPU: at
#: 8K tokens (3 KV heads, D=64) one call takes 67 ms with 256-token tiles and 31 ms with 1024
#: (2 cores); the result changes only by fp32 rounding.
REFERENCE_BLOCK_N = 1024


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
        """None if it covers ``cache`` (every layer's format) and ``num_q_heads``, else why not."""

    def launch(
        self,
        q: torch.Tensor,
        cache: QuantizedKVCache,
        batch: DecodeBatch,
        sm_scale: float,
        *,
        out: torch.Tensor | None,
        lse: torch.Tensor | None,
        return_lse: bool,
    ):
        """Attention of ``q: [B, Hq, D]`` over ``batch`` in the stored coordinates; returns
        ``o`` (``out`` when given), and ``lse: [B, Hq]`` float32 with ``return_lse``."""


#: each cache's coverage answers, by (backend, query heads): a cache's formats, head_dim, page
#: size and KV heads never change, and the checks walk every layer's format (70-80 us a call at
#: 36 layers on a CPU; decode_attention asks up to twice per layer and step)
_COVERAGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class KernelBackend:
    """A kernel launcher module (``available``, ``supports``, ``decode``) with fixed keyword
    arguments of its ``decode``; ``extra_check``: a coverage check run before ``supports``."""

    name: str
    module: ModuleType
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

    def launch(self, q, cache, batch, sm_scale, *, out, lse, return_lse):
        with on_device(q.device):  # a cache on cuda:1 while cuda:0 is current
            return self.module.decode(
                q,
                cache,
                batch,
                sm_scale,
                out=out,
                lse=lse,
                return_lse=return_lse,
                **dict(self.options),
            )


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

    def launch(self, q, cache, batch, sm_scale, *, out, lse, return_lse):
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        o, lse_ref = reference.attend_folded(
            q, cache, batch, sm_scale, block_n=self.block_n, dtype=dtype
        )
        o = o.to(q.dtype)
        if out is not None:
            out.copy_(o)
            o = out
        if not return_lse:
            return o
        if lse is not None:
            lse.copy_(lse_ref)
            return o, lse
        return o, lse_ref.to(torch.float32)


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
    KernelBackend("gluon", gluon, _GLUON_NEEDS, (("reconstruct", False),)),
    KernelBackend("triton", triton, _TRITON_NEEDS, (("reconstruct", False),)),
    ReferenceBackend(),
    KernelBackend("triton-reconstruct", triton, _TRITON_NEEDS, (("reconstruct", True),)),
    KernelBackend("gluon-reconstruct", gluon, _GLUON_NEEDS, (("reconstruct", True),)),
    KernelBackend(
        "gluon-e4m3",
        gluon,
        _GLUON_NEEDS,
        (("reconstruct", False), ("operands", "e4m3")),
        extra_check=gluon.supports_e4m3,
    ),
):
    register(_backend)
del _backend
