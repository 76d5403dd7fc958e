"""Launch-config heuristics (foscar/configs.py): what the H200 tuning rounds decided."""

import pytest

from foscar import KVFormat, QuantFormat
from foscar.configs import TritonDecodeConfig, num_splits, triton_decode_config


@pytest.mark.parametrize("batch,kv_heads", [(1, 8), (3, 8), (8, 8), (17, 2), (64, 8), (200, 8)])
@pytest.mark.parametrize("ctas_per_sm,sms", [(2, 132), (4, 132), (3, 78)])
def test_splits_fill_the_resident_slots_once(batch, kv_heads, ctas_per_sm, sms):
    cfg = TritonDecodeConfig(block_n=64, ctas_per_sm=ctas_per_sm)
    slots = ctas_per_sm * sms
    s = num_splits(batch, kv_heads, 1 << 20, cfg, sms)
    ctas = batch * kv_heads
    if ctas >= slots:
        assert s == 1
    else:
        assert ctas * s <= slots < ctas * (s + 1)  # one wave, no slot left for another split


def test_split_counts_of_the_tuned_points():
    cfg = triton_decode_config(KVFormat(QuantFormat(2, "token", 128)), 128, 4, ctas=64)
    assert (cfg.block_n, cfg.maxnreg, cfg.ctas_per_sm) == (64, 128, 4)
    # tuning round 4 (benchmarks/results/h200/tune/tune_round4.log)
    assert [num_splits(b, 8, 131072, cfg, 132) for b in (1, 8, 64)] == [66, 8, 1]


@pytest.mark.parametrize("tokens,expected", [(0, 1), (1, 1), (64, 1), (128, 1), (129, 1), (256, 2)])
def test_splits_keep_whole_tiles(tokens, expected):
    cfg = TritonDecodeConfig(block_n=64, ctas_per_sm=4, min_tiles_per_split=2)
    assert num_splits(1, 1, tokens, cfg, 132) == expected


def test_token_wise_key_with_many_groups_uses_small_tiles():
    for bits in (2, 4):
        fmt = KVFormat(QuantFormat(bits, "token", 32), QuantFormat(2, "token", 128))
        assert triton_decode_config(fmt, 128, 4).block_n == 32
    fmt = KVFormat(QuantFormat(4, "token", 64), QuantFormat(2, "token", 128))
    assert triton_decode_config(fmt, 128, 4).block_n == 64


def test_channel_wise_key_configs():
    """Channel-wise K: 168 registers keep 3 CTAs per SM without the spills of the 128 cap
    (benchmarks/NOTES.md 11); g = 32 needs more and gets 2 CTAs per SM uncapped."""
    for bits in (2, 4):
        for va in ("token", "channel"):
            for g in (64, 128):
                fmt = KVFormat(QuantFormat(bits, "channel", g), QuantFormat(bits, va, 128))
                cfg = triton_decode_config(fmt, 128, 4, ctas=64)
                assert (cfg.block_n, cfg.maxnreg, cfg.ctas_per_sm) == (64, 168, 3)
            fmt = KVFormat(QuantFormat(bits, "channel", 32), QuantFormat(bits, va, 128))
            cfg = triton_decode_config(fmt, 128, 4, ctas=64)
            assert (cfg.block_n, cfg.maxnreg, cfg.ctas_per_sm) == (64, None, 2)
    # the reconstruct baseline keeps its own config
    fmt = KVFormat(QuantFormat(2, "channel", 128), QuantFormat(2, "token", 128))
    assert triton_decode_config(fmt, 128, 4, reconstruct=True).maxnreg is None
