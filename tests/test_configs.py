"""Launch-config heuristics (foscar/configs.py): what the H200 tuning rounds decided."""

import pytest

from foscar import KVFormat, QuantFormat
from foscar.configs import TritonDecodeConfig, triton_decode_config, triton_num_splits


@pytest.mark.parametrize("batch,kv_heads", [(1, 8), (3, 8), (8, 8), (17, 2), (64, 8), (200, 8)])
@pytest.mark.parametrize("ctas_per_sm,sms", [(2, 132), (4, 132), (3, 78)])
def test_splits_fill_the_resident_slots_once(batch, kv_heads, ctas_per_sm, sms):
    cfg = TritonDecodeConfig(block_n=64, ctas_per_sm=ctas_per_sm)
    slots = ctas_per_sm * sms
    s = triton_num_splits(batch, kv_heads, 1 << 20, cfg, sms)
    ctas = batch * kv_heads
    if ctas >= slots:
        assert s == 1
    else:
        assert ctas * s <= slots < ctas * (s + 1)  # one wave, no slot left for another split


def test_split_counts_of_the_tuned_points():
    cfg = triton_decode_config(KVFormat(QuantFormat(2, "token", 128)), 128, 4, ctas=64)
    assert (cfg.block_n, cfg.maxnreg, cfg.ctas_per_sm) == (64, 128, 4)
    # tuning round 4 (benchmarks/results/h200/tune/tune_round4.log)
    assert [triton_num_splits(b, 8, 131072, cfg, 132) for b in (1, 8, 64)] == [66, 8, 1]


@pytest.mark.parametrize("tokens,expected", [(0, 1), (1, 1), (64, 1), (128, 1), (129, 1), (256, 2)])
def test_splits_keep_whole_tiles(tokens, expected):
    cfg = TritonDecodeConfig(block_n=64, ctas_per_sm=4, min_tiles_per_split=2)
    assert triton_num_splits(1, 1, tokens, cfg, 132) == expected


def test_token_wise_key_with_many_groups_uses_small_tiles():
    for bits in (2, 4):
        fmt = KVFormat(QuantFormat(bits, "token", 32), QuantFormat(2, "token", 128))
        assert triton_decode_config(fmt, 128, 4).block_n == 32
    fmt = KVFormat(QuantFormat(4, "token", 64), QuantFormat(2, "token", 128))
    assert triton_decode_config(fmt, 128, 4).block_n == 64


def test_channel_wise_key_configs():
    """Channel-wise K: 168 registers keep 3 CTAs per SM without the spills of the 128 cap;
    g = 32 needs more and gets 2 CTAs per SM uncapped."""
    for bits in (2, 4):
        for va in ("token", "channel"):
            for g in (64, 128):
                fmt = KVFormat(QuantFormat(bits, "channel", g), QuantFormat(bits, va, 128))
                cfg = triton_decode_config(fmt, 128, 4, ctas=64)
                assert (cfg.block_n, cfg.maxnreg, cfg.ctas_per_sm) == (64, 168, 3)
            fmt = KVFormat(QuantFormat(bits, "channel", 32), QuantFormat(bits, va, 128))
            cfg = triton_decode_config(fmt, 128, 4, ctas=64)
            assert (cfg.block_n, cfg.maxnreg, cfg.ctas_per_sm) == (64, None, 2)
    # 32-column products, uncapped: token-wise V with 4 groups per row needs ~199 registers
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 32))
    assert triton_decode_config(fmt, 128, 4).ctas_per_sm == 2
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "channel", 32))
    assert triton_decode_config(fmt, 128, 4).ctas_per_sm == 3
    # the reconstruct baseline keeps its own config (uncapped, 2 CTAs per SM)
    fmt = KVFormat(QuantFormat(2, "channel", 128), QuantFormat(2, "token", 128))
    cfg = triton_decode_config(fmt, 128, 4, reconstruct=True)
    assert (cfg.maxnreg, cfg.ctas_per_sm) == (None, 2)


def _sass_count(*args) -> str:
    """benchmarks/tools/sass_count.py's output for ``args`` (in a subprocess: the tests run with
    TRITON_INTERPRET=1); skips where sm_90a does not compile here."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks/tools/sass_count.py"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_INTERPRET="0"),
        cwd=root,
    )
    if r.returncode != 0 or "regs=" not in r.stdout:
        pytest.skip(f"cannot compile for sm_90a here: {r.stderr.strip()[-300:]}")
    return r.stdout


@pytest.mark.parametrize("head_dim", [64, 128])
def test_token_wise_key_fold_has_no_fp32_dot_at_16_query_heads(head_dim):
    """The offset term of token-wise K in several channel groups stays fp32 FMAs: at 16 query
    columns Triton rewrote its broadcast product into a TF32 dot of K = 2 or 4 (Note [no fp32
    dot] in foscar/kernels/triton_decode.py); the config takes 32-token tiles there."""
    pytest.importorskip("triton")
    out = _sass_count("--config", "--group", "32", "--head-dim", str(head_dim), "--ratio", "16")
    assert "fp32_dots=0" in out, out
    assert "block_n=32" in out, out


def _registers_and_smem(ka, va, sink, recent, reconstruct=False):
    """Compile the Triton kernel for sm_90a with foscar's config (:func:`_sass_count`) ->
    (registers, dynamic smem bytes)."""
    import re

    args = ["--k-axis", ka, "--v-axis", va, "--sink", str(sink), "--recent", str(recent)]
    args += ["--reconstruct"] if reconstruct else []
    m = re.search(r"regs=(\d+) .*dyn_smem=(\d+)", _sass_count("--config", *args))
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize(
    "ka,va,sink,recent,reconstruct",
    [
        ("token", "token", 0, 0, False),
        ("token", "token", 64, 256, False),
        ("token", "channel", 0, 0, False),
        ("channel", "token", 0, 0, False),
        ("channel", "channel", 64, 256, False),
        ("token", "token", 0, 0, True),
        ("channel", "token", 0, 0, True),
    ],
)
def test_config_ctas_fit_on_an_sm(ka, va, sink, recent, reconstruct):
    """The CTAs per SM a config assumes (the split count fills them) fit in an H100/H200 SM's
    registers (64K) and shared memory (228 KB, 1 KB reserved per CTA): every format with a BF16
    tail once took 102 KB per CTA (2 per SM) against 4 assumed."""
    pytest.importorskip("triton")
    fmt = KVFormat(
        QuantFormat(2, ka, 128),
        QuantFormat(2, va, 128),
        sink_tokens=sink,
        recent_tokens=recent,
    )
    cfg = triton_decode_config(fmt, 128, 4, reconstruct, ctas=64)
    regs, smem = _registers_and_smem(ka, va, sink, recent, reconstruct)
    regs_alloc = -(-regs // 8) * 8
    assert cfg.ctas_per_sm * regs_alloc * 32 * cfg.num_warps <= 65536, (regs, cfg)
    assert cfg.ctas_per_sm * (smem + 1024) <= 228 * 1024, (smem, cfg)
