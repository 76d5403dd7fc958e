"""``foscar bench --e2e`` on the CPU: what can run without a GPU (a small model, every piece but
the timing), and the clear refusal of the real run."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from conftest import HAS_CUDA

pytest.importorskip("transformers", reason="the e2e benchmark needs transformers (foscar[hf])")

from foscar.bench import e2e  # noqa: E402


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda():
    res = subprocess.run(
        [sys.executable, "-m", "foscar", "bench", "--e2e"], capture_output=True, text=True
    )
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return e2e.build_model(
        torch.device("cpu"),
        layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )


def test_decode_points_on_a_small_model(small_model, tmp_path):
    """Synthetic prompts of 400 tokens (past foscar's 64 + 256 BF16 windows), 3 timed steps."""
    assert small_model.config.head_dim == 128 and small_model.dtype == torch.bfloat16
    rows = [
        e2e.decode_point(small_model, m, 2, 400, new_tokens=3, warmup=1)
        for m in (
            "bf16",
            "foscar-int4",
            "foscar-int2",
            "foscar-oscar-int2",
            "foscar-oscar-k4third-int2",
            "foscar-oscar-k4half-v4third-int2",
        )
    ]
    for r in rows:
        assert math.isfinite(r["tpot_ms"]) and r["tokens_per_s_aggregate"] > 0
        assert r["tokens_per_s_aggregate"] == pytest.approx(2 * r["tokens_per_s_per_user"])
    kv = {r["method"]: r["kv_cache_gib"] for r in rows}
    # 2 users x 404 tokens x 2 layers x 2 heads x 128 x (K, V) in BF16
    assert kv["bf16"] * 2**30 == 2 * 404 * 2 * 2 * 128 * 2 * 2
    assert kv["foscar-int2"] < kv["foscar-int4"] < kv["bf16"]
    assert kv["foscar-oscar-int2"] == kv["foscar-int2"]  # OSCAR stores the same format
    # OSCAR's cache: every layer rotated per KV head, clipped, its keys rounded by GPTQ
    cache = e2e.make_cache("foscar-oscar-int2", small_model, 2, 400, 8, seed=0)
    for tr in cache.kv.transforms:
        assert tr.key_rotation.shape == tr.value_rotation.shape == (2, 128, 128)
        assert (tr.key_clip, tr.value_clip) == (0.85, 0.92) and tr.key_gptq.shape == (2, 128, 128)
    # INT4 keys in every third layer (layer 1 of 0-1 here), each layer clipped for its widths
    assert kv["foscar-int2"] < kv["foscar-oscar-k4third-int2"] < kv["foscar-int4"]
    cache = e2e.make_cache("foscar-oscar-k4third-int2", small_model, 2, 400, 8, seed=0)
    assert [f.key.bits for f in cache.kv.formats] == [2, 4]
    for layer, tr in enumerate(cache.kv.transforms):
        assert tr.key_clip == (0.99 if layer == 1 else 0.85) and tr.value_clip == 0.92
    # INT4 keys in every other layer and INT4 values in every third (layer 1 of 0-1 here):
    # both roles of layer 1 at INT4, each clipped for its width
    assert kv["foscar-oscar-k4third-int2"] < kv["foscar-oscar-k4half-v4third-int2"]
    assert kv["foscar-oscar-k4half-v4third-int2"] < kv["foscar-int4"]
    cache = e2e.make_cache("foscar-oscar-k4half-v4third-int2", small_model, 2, 400, 8, seed=0)
    assert [(f.key.bits, f.value.bits) for f in cache.kv.formats] == [(2, 2), (4, 4)]
    for layer, tr in enumerate(cache.kv.transforms):
        assert (tr.key_clip, tr.value_clip) == ((0.99, 0.99) if layer == 1 else (0.85, 0.92))
    # which layers, on a deeper model: keys 1, 3, 5, ..., values 1, 4, 7, ...
    formats = e2e.method_formats("foscar-oscar-k4half-v4third-int2", 12)
    assert [i for i, f in enumerate(formats) if f.key.bits == 4] == [1, 3, 5, 7, 9, 11]
    assert [i for i, f in enumerate(formats) if f.value.bits == 4] == [1, 4, 7, 10]
    # folded: the value rotations live in the weights, the cache rotates K and Q only
    cache = e2e.make_cache("foscar-oscar-folded-int2", small_model, 2, 400, 8, seed=0)
    for tr in cache.kv.transforms:
        assert tr.value_rotation is None and tr.key_rotation.shape == (2, 128, 128)
        assert tr.key_gptq is not None
    result = {
        "config": {
            "contexts": [400],
            "methods": ["bf16", "foscar-int4", "foscar-int2"],
            "kv_budget_gib": 1.0,
        },
        "env": {"gpu": "cpu"},
        "notes": ["test"],
        "points": rows + [{"method": "bf16", "context": 400, "batch": 64, "oom": True}],
        "budget": e2e.budget_table(["bf16", "foscar-int2"], [400], small_model.config, 1.0, 3),
    }
    e2e.write_results(result, tmp_path, "e2e")
    assert "| bf16 | 400 | 64 | OOM |" in (tmp_path / "e2e.md").read_text()
    assert (tmp_path / "e2e.png").stat().st_size > 10000


def test_kv_budget_at_qwen3_8b_shapes():
    """At 32K tokens a BF16 user costs 4.5 GiB of KV; foscar's INT2 about 2.5 / 16 of that."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(**e2e.QWEN3_8B)
    rows = {r["method"]: r for r in e2e.budget_table(e2e.METHODS, [32768], cfg, 96.0, 0)}
    assert rows["bf16"]["kv_gib_per_user"] == pytest.approx(4.5)
    assert rows["bf16"]["max_batch"] == 21
    ratio = rows["foscar-int2"]["kv_gib_per_user"] / rows["bf16"]["kv_gib_per_user"]
    assert ratio == pytest.approx(e2e.effective_bits(32768, e2e.foscar_format(2)) / 16)
    assert rows["foscar-int2"]["max_batch"] > 5 * rows["bf16"]["max_batch"]
