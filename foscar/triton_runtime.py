"""Where foscar's Triton kernels can run: importing them, the CPU interpreter, the launch device.

The cache's fused decode-step write (foscar.cache.fused_write) and the decode backends
(foscar.backends) both launch Triton kernels; this module is the one place that imports the
kernel modules, decides whether a device can run them, and patches the interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

__all__ = ["available", "interpreting", "kernel_module", "on_device"]


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def kernel_module(name: str):
    """``foscar.kernels.<name>`` (e.g. ``"triton_decode"``, ``"cache_write"``), or None where
    Triton or the module cannot be imported. Under the interpreter, patches it first
    (Note [interpreter and numpy >= 2.4])."""
    try:
        import triton  # noqa: F401

        module = importlib.import_module(f"foscar.kernels.{name}")
    except Exception:  # ImportError, or a broken install without a backend
        return None
    if interpreting():
        _patch_interpreter_for_numpy2()
    return module


def available(device: torch.device, kernels: str = "triton_decode") -> bool:
    """The kernel module ``kernels`` imports and can run on ``device`` (CUDA, or the CPU
    interpreter)."""
    if kernel_module(kernels) is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def on_device(device: torch.device):
    """Triton launches on the current CUDA device's stream: make it ``device`` for the launch
    (a no-op when it already is, or off CUDA)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _patch_interpreter_for_numpy2() -> None:
    """Note [interpreter and numpy >= 2.4]: triton 3.6's interpreter turns scalar tensors into
    Python ints with ``int(array)`` on 1-element 1-d arrays (in ``range(t0, t1)`` with tensor
    bounds), which numpy 2.4 rejects. Read the single element instead."""
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_foscar_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        )

    patched._foscar_patched = True
    interp._patch_lang_tensor = patched
