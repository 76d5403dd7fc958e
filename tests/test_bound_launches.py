"""Note [bound launches] (foscar.triton_runtime): a decode call's launches recorded once per key
and replayed with the query and outputs swapped in, only where the JIT would pick the same
kernels. The machinery runs here against stand-in kernels (the interpreter bypasses it, so the
real launches are covered by the GPU tests of the backends)."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from foscar import triton_runtime


class FakeKernel:
    """A compiled kernel: ``run`` records each launch's grid and arguments."""

    def __init__(self, log):
        self.log = log
        self.function = "fn"
        self.packed_metadata = "meta"

    def run(self, g0, g1, g2, stream, function, meta, launch_metadata, enter, exit_, *args):
        self.log.append(("replay", (g0, g1, g2), args))


class FakeJit:
    """A JIT function: ``fn[grid](**kwargs)`` launches through the 'JIT' and returns the
    kernel; its parameters are those of ``signature``."""

    def __init__(self, signature):
        self.log = []
        self.kernel = FakeKernel(self.log)
        self.params = [
            types.SimpleNamespace(name=p.name, default=p.default)
            for p in inspect.signature(signature).parameters.values()
        ]

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.log.append(("jit", tuple(grid), kwargs))
            return self.kernel

        return launch


def split(q_ptr, o_ptr, pool, n, BLOCK=64):  # noqa: N803
    pass


@pytest.fixture
def compiled(monkeypatch):
    """Bound launches as on a GPU: no interpreter, no launch hooks, a stream to launch on."""
    monkeypatch.setattr(triton_runtime, "interpreting", lambda: False)
    monkeypatch.setattr(triton_runtime, "launch_hooks_installed", lambda: False)
    monkeypatch.setattr(triton_runtime, "_current_stream", lambda device: 7)
    monkeypatch.setattr(triton_runtime, "_current_device", lambda: 0)


def call(fn, memo, key, q, out, pool, launches=None):
    def run():
        if q.shape[0] == 0:
            raise ValueError("q must hold a row")
        triton_runtime.launch(fn, (2, 3), q_ptr=q, o_ptr=out, pool=pool, n=q.shape[0], BLOCK=32)

    triton_runtime.bound_call(memo, key, {"q": q, "out": out}, run)


def test_the_second_call_records_and_later_ones_replay_with_their_tensors(compiled):
    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    q0, out0 = torch.zeros(3, 8), torch.zeros(3, 8)
    call(fn, memo, "k", q0, out0, pool)
    assert memo == {"k": None}  # the first call only marks the key
    call(fn, memo, "k", q0, out0, pool)
    assert [e[0] for e in fn.log] == ["jit", "jit"] and memo["k"] is not None
    q1, out1 = torch.ones(3, 8), torch.ones(3, 8)
    call(fn, memo, "k", q1, out1, pool)
    kind, grid, args = fn.log[-1]
    assert (kind, grid) == ("replay", (2, 3, 1))
    # positional, in the kernel's parameter order, the named tensors swapped in
    assert args[0] is q1 and args[1] is out1 and args[2] is pool and args[3:] == (3, 32)


@pytest.mark.parametrize(
    "change",
    [
        lambda q: q.to(torch.float64),  # dtype
        lambda q: torch.zeros(4, 8),  # shape
        lambda q: torch.zeros(8, 3).t(),  # strides
        lambda q: torch.zeros(3 * 8 + 1)[1:].view(3, 8),  # 16-byte alignment
    ],
)
def test_a_tensor_the_jit_would_specialize_differently_takes_the_jit_again(compiled, change):
    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    q0 = torch.zeros(3, 8)
    for _ in range(2):  # marked, then recorded
        call(fn, memo, "k", q0, torch.zeros(3, 8), pool)
    call(fn, memo, "k", change(q0), torch.zeros(3, 8), pool)
    assert [e[0] for e in fn.log] == ["jit", "jit", "jit"]  # recorded for the new kind
    call(fn, memo, "k", change(q0), torch.zeros(3, 8), pool)
    assert fn.log[-1][0] == "replay"


def test_another_key_is_another_binding(compiled):
    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    q = torch.zeros(3, 8)
    call(fn, memo, "a", q, torch.zeros(3, 8), pool)
    call(fn, memo, "b", q, torch.zeros(3, 8), pool)
    assert [e[0] for e in fn.log] == ["jit", "jit"]


@pytest.mark.parametrize("alias", ["view", "out=q"])
def test_named_storage_shared_at_recording_is_never_bound(compiled, alias):
    """A launch reading a view of q would replay the first call's view; with out=q recorded, a
    later call's separate out would be left unwritten: both refused at recording, for good."""
    fn, memo = FakeJit(split), {}
    q = torch.zeros(3, 8)
    for _ in range(4):
        if alias == "view":
            call(fn, memo, "k", q, torch.zeros(3, 8), q[:1])  # pool is a view of q
        else:
            call(fn, memo, "k", q, q, torch.zeros(4))
    assert memo["k"] is triton_runtime.UNBINDABLE
    assert [e[0] for e in fn.log] == ["jit"] * 4


def test_a_refused_call_records_nothing_and_raises_again(compiled):
    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    for _ in range(3):
        with pytest.raises(ValueError, match="q must hold a row"):
            call(fn, memo, "k", torch.zeros(0, 8), torch.zeros(0, 8), pool)
    assert not [r for r in memo.values() if r is not None] and fn.log == []


def test_launch_hooks_and_the_interpreter_bypass_the_binding(monkeypatch, compiled):
    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    q = torch.zeros(3, 8)
    monkeypatch.setattr(triton_runtime, "launch_hooks_installed", lambda: True)  # a profiler
    call(fn, memo, "k", q, torch.zeros(3, 8), pool)
    call(fn, memo, "k", q, torch.zeros(3, 8), pool)
    assert memo == {} and [e[0] for e in fn.log] == ["jit", "jit"]
    monkeypatch.setattr(triton_runtime, "launch_hooks_installed", lambda: False)
    monkeypatch.setattr(triton_runtime, "interpreting", lambda: True)
    call(fn, memo, "k", q, torch.zeros(3, 8), pool)
    assert memo == {}


def test_hooks_are_read_from_triton():
    """No launch hook is installed by default (triton 3.6's hook chains are empty)."""
    assert triton_runtime.launch_hooks_installed() is False


def test_a_binding_keeps_no_named_tensor_alive(compiled):
    import weakref

    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    q = torch.zeros(3, 8)
    ref = weakref.ref(q)
    for _ in range(2):
        call(fn, memo, "k", q, torch.zeros(3, 8), pool)
    fn.log.clear()  # the JIT's log holds the call's arguments
    del q
    assert ref() is None and memo["k"] is not None


def test_a_plan_keeps_at_most_max_bound_calls(compiled, monkeypatch):
    monkeypatch.setattr(triton_runtime, "MAX_BOUND_CALLS", 3)
    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    q = torch.zeros(3, 8)
    for key in range(7):
        call(fn, memo, key, q, torch.zeros(3, 8), pool)
        assert len(memo) <= 3
    assert 6 in memo


def test_another_current_device_takes_the_jit(compiled, monkeypatch):
    """The recorded kernels were loaded for the recording device's context."""
    fn, memo, pool = FakeJit(split), {}, torch.zeros(4)
    q = torch.zeros(3, 8)
    for _ in range(2):
        call(fn, memo, "k", q, torch.zeros(3, 8), pool)
    monkeypatch.setattr(triton_runtime, "_current_device", lambda: 1)
    call(fn, memo, "k", q, torch.zeros(3, 8), pool)
    assert [e[0] for e in fn.log] == ["jit"] * 3


@pytest.mark.parametrize("hook", [None, print])
def test_a_launch_hook_set_without_triton_s_hook_chain(monkeypatch, hook):
    """triton 3.6 also takes a hook assigned as a plain function (or None): a function is a
    hook, None is none."""
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    assert triton_runtime.launch_hooks_installed() is (hook is not None)


def test_triton_debug_mode_bypasses_the_binding(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert triton_runtime.launch_hooks_installed() is True
