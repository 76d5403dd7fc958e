"""Where foscar's Triton kernels can run: the CPU interpreter, the launch device, bound launches.

The cache's fused decode-step write (foscar.cache.fused_write) and the decode backends
(foscar.backends) import their kernel modules themselves (None where Triton cannot be
imported); this module decides whether a device can run them (:func:`available`), holds the one
interpreter switch (:func:`interpreting`) and patches the interpreter. It also binds a decode
plan's launches (:func:`bound_call`, Note [bound launches]).

Note [bound launches]: triton's JIT spends most of an eager launch's host time before the kernel
starts: it specializes every argument (types, 16-byte alignment, integers equal to 1), hashes a
cache key and looks the kernel up, and foscar's own code rebuilds the launch's 30-40 arguments. A
decode call over one plan repeats all of it with the same values except the query and the outputs.
:func:`bound_call` runs a key's (the plan's layer, the config and split count, the pools) second
call through the JIT while recording each compiled kernel with its positional arguments; a later
call with the same key passes them to the compiled kernels' launchers, with only the named tensors
(``q``, ``out``, ``lse``) swapped in. The first call only marks the key, so a plan made for one
call (an eager ``generate()`` step) pays nothing. It replays only where the JIT would have chosen
the same kernels: each named tensor with the recorded dtype, shape, strides, device and 16-byte
alignment, the same current device (the recorded kernels were loaded for its context); no launch
hook (a profiler), pre-run hook or triton debug mode; not under the interpreter. The JIT's
per-launch checks that a kernel's globals have not changed are not repeated: foscar's kernels read
constants only. Every other tensor a bound launch reads must outlive the plan (the cache's pools,
the plan's tables, its workspaces): a launch argument sharing storage with a named tensor without
being it (a view of ``q``) is refused at recording, and so are named tensors that share storage
(``out=q``): that key is never bound. A replay issues the same launches on the current stream, so
it is CUDA-graph safe as the JIT launch is.
"""

from __future__ import annotations

import contextlib
import os
import threading
from types import ModuleType

import torch

__all__ = [
    "UNBINDABLE",
    "available",
    "bound_call",
    "interpreting",
    "launch",
    "launch_hooks_installed",
    "on_device",
]


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device, kernels: ModuleType | None) -> bool:
    """The kernel module ``kernels`` imported (a launcher's ``from ..kernels import ...``, None
    where Triton could not be imported) and can run on ``device`` (CUDA, or the CPU
    interpreter, patched here: Note [interpreter and numpy >= 2.4])."""
    if kernels is None:
        return False
    if device.type == "cpu" and interpreting():
        _patch_interpreter_for_numpy2()
        return True
    return device.type == "cuda"


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


# ---------------------------------------------------------------------------- bound launches
#: bound calls kept per plan: its layers x the configs and split counts it is decoded with
MAX_BOUND_CALLS = 256
_recording = threading.local()  # .launches: the launches of the call being recorded, or None
_UNSEEN = object()  # a key not called yet
#: the memo value of a key whose launches cannot be bound (replayed): each call goes through
#: the JIT
UNBINDABLE = object()


def launch(fn, grid: tuple, **kwargs):
    """``fn[grid](**kwargs)``; inside :func:`bound_call`'s recording call of a key, also
    recorded (Note [bound launches]). Returns what the JIT returns (the compiled kernel)."""
    if interpreting():
        _patch_interpreter_for_numpy2()
    kernel = fn[grid](**kwargs)
    launches = getattr(_recording, "launches", None)
    if launches is not None:
        if kernel is None or hasattr(kernel, "result") or getattr(fn, "pre_run_hooks", None):
            # nothing to replay, or hooks the JIT runs before every launch
            _recording.launches = None
            _recording.refused = True
        else:
            args = []
            for param in fn.params:
                if param.name in kwargs:
                    args.append(kwargs[param.name])
                else:
                    args.append(param.default)
            launches.append((kernel, tuple(grid) + (1,) * (3 - len(grid)), args))
    return kernel


class _Replay:
    """The recorded launches of one call and the named tensors' properties they assume."""

    def __init__(self, launches: list, tensors: dict):
        named = [t for t in tensors.values() if t is not None]
        storages = {t.untyped_storage().data_ptr() for t in named}
        if len(storages) < len(named):  # out=q: a replay with separate tensors would differ
            raise _NotBindable("two named tensors share storage")
        self.meta = {name: _properties(t) for name, t in tensors.items()}
        self.device = _current_device()  # the kernels were loaded for this device's context
        self.launches = []
        for kernel, grid, args in launches:
            slots = []
            for i, a in enumerate(args):
                for name, t in tensors.items():
                    if t is not None and a is t:
                        slots.append((i, name))
                        args[i] = None  # swapped in at each replay; not kept alive here
                        break
                else:
                    if isinstance(a, torch.Tensor) and _shares_storage(a, tensors):
                        raise _NotBindable(f"argument {i} is a view of a named tensor")
            self.launches.append((kernel, grid, args, slots))

    def accepts(self, tensors: dict) -> bool:
        if _current_device() != self.device:
            return False
        meta = self.meta
        for name, t in tensors.items():
            if meta.get(name, 0) != _properties(t):
                return False
        return True

    def __call__(self, tensors: dict) -> None:
        stream = _current_stream(self.device)
        for kernel, (g0, g1, g2), args, slots in self.launches:
            if slots:
                args = list(args)
                for i, name in slots:
                    args[i] = tensors[name]
            kernel.run(
                g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                *args,
            )


def _current_device() -> int:
    """The device triton's JIT would launch on (and load its kernels for): the current one."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device()


def _current_stream(device: int):
    """The stream triton's JIT would launch on: ``device``'s current stream."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device)


class _NotBindable(Exception):
    pass


def _properties(t):
    if t is None:
        return None
    return (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16 == 0)


def _shares_storage(a: torch.Tensor, tensors: dict) -> bool:
    base = a.untyped_storage().data_ptr()
    return any(
        t is not None and t.untyped_storage().data_ptr() == base for t in tensors.values()
    )


def launch_hooks_installed() -> bool:
    """A launch hook (a profiler) or triton's debug mode is on: the JIT must see every launch.
    A hook set as a plain function (or None) rather than triton's hook chain counts by
    whether it is None."""
    try:
        from triton import knobs
    except ImportError:  # older triton: no hook chains
        return True
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        calls = getattr(hook, "calls", None)
        if (hook is not None and calls is None) or calls:
            return True
    return bool(runtime.debug)


def bound_call(memo: dict, key, tensors: dict, run) -> None:
    """Run ``run()``, a call whose kernels launch through :func:`launch`, bound once per ``key``
    in ``memo`` (a plan's): the key's second call records its launches (the first only marks
    the key, so that a plan used once pays nothing), a later one with named ``tensors``
    (``{name: tensor or None}``) of the recorded dtype, shape, strides, device and alignment
    replays them with these tensors swapped in (Note [bound launches]). ``run`` validates and
    raises before any launch; a call it refuses is not recorded."""
    recording = getattr(_recording, "launches", None) is not None
    if interpreting() or launch_hooks_installed() or recording:
        run()
        return
    replay = memo.get(key, _UNSEEN)
    if replay is UNBINDABLE:  # its launches cannot be replayed (a view of a named tensor, ...)
        run()
        return
    if replay is _UNSEEN:  # a key's first call only marks it: a plan made per call never records
        if len(memo) >= MAX_BOUND_CALLS:  # a plan's keys are few; never let them pile up
            memo.clear()
        memo[key] = None
        run()
        return
    if replay is not None and replay.accepts(tensors):
        replay(tensors)
        return
    _recording.launches, _recording.refused = [], False
    try:
        run()
        launches, refused = _recording.launches, _recording.refused
    finally:
        _recording.launches = None
    if refused:  # a launch without a compiled kernel, or with pre-run hooks
        memo[key] = UNBINDABLE
        return
    if not launches:
        return
    try:
        memo[key] = _Replay(launches, tensors)
    except _NotBindable:
        memo[key] = UNBINDABLE
