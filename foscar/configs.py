"""Launch configurations of the decode kernels and the heuristics that pick them.

Knobs live in frozen dataclasses; :func:`triton_decode_config` and :func:`num_splits` own the
heuristics. TUNING (H200; `bash benchmarks/h200_run.sh tune`, results in
benchmarks/results/h200/tune/, discussion in benchmarks/NOTES.md):
    block_n=128, num_warps=4, num_stages=3: INT2 B=64 L=16K 818 -> 546 us against
        num_stages=1 (cp.async prefetch of the next tiles; the kernel is latency-bound at
        2 CTAs/SM), better than block_n=64 (730 us) and 8 warps (999 us).
    block_n=64 when a product needs more than 16 columns (more registers per token), and for
        the reconstruct baseline, which spills at block_n=128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TritonDecodeConfig", "triton_decode_config", "num_splits", "column_widths"]


@dataclass(frozen=True)
class TritonDecodeConfig:
    block_n: int = 128  # tokens per tile of the quantized history
    num_warps: int = 4  # one warpgroup: tokens are the wgmma M dimension
    num_stages: int = 3  # cp.async stages: the next tiles' words load while this one computes
    block_window: int = 64  # tokens per tile of the BF16 sink/tail
    maxnreg: int | None = None  # register cap per thread (more CTAs per SM, maybe spills)
    tile_acc: bool = True  # token-wise V: fresh PV accumulator per tile (triton_decode Note)
    min_tiles_per_split: int = 2
    # CTAs of this config resident per SM (ptxas registers: 254 -> 2, ~160 -> 3, capped at
    # 128 -> 4; `python benchmarks/sass_count.py` prints them): the split count fills them
    ctas_per_sm: int = 2


def column_widths(fmt, head_dim: int, heads_per_kv: int, block_n: int, reconstruct: bool):
    """``(HS, HPK, HPV)``: padded heads and the column counts of the QK and PV products.

    A product's columns are (block, head) pairs: channel groups for token-wise folds, token
    groups of a tile for channel-wise ones; at least 16 (the smallest wgmma N Triton uses).
    """
    hs = max(8, 1 << (heads_per_kv - 1).bit_length())

    def width(blocks: int) -> int:
        return max(16, blocks * hs)

    if reconstruct:
        return hs, width(1), width(1)

    def blocks(f) -> int:
        if f.axis.value == "token":
            return head_dim // f.group_size
        return max(1, block_n // f.group_size)

    return hs, width(blocks(fmt.key)), width(blocks(fmt.value))


def triton_decode_config(
    fmt, head_dim: int, heads_per_kv: int, reconstruct: bool = False, ctas: int = 1
) -> TritonDecodeConfig:
    """``ctas``: sequences x KV heads of the call. From 64 up, 64-token tiles capped at 128
    registers (4 CTAs/SM, some spills) beat 128-token tiles at 2 CTAs/SM: INT2 B=64 L=16K
    548 -> 492 us, B=8 L=128K 784 -> 711 us; at B=1 they lose (28 -> 35 us)."""
    _, hpk, hpv = column_widths(fmt, head_dim, heads_per_kv, 128, reconstruct=False)
    if reconstruct or hpk > 16 or hpv > 16:
        return TritonDecodeConfig(block_n=64, ctas_per_sm=3)
    if ctas >= 64:
        return TritonDecodeConfig(block_n=64, maxnreg=128, ctas_per_sm=4)
    return TritonDecodeConfig()


def num_splits(
    batch: int, num_kv_heads: int, max_tokens: int, cfg: TritonDecodeConfig, num_sms: int
) -> int:
    """Splits per (sequence, KV head): enough CTAs to fill every resident slot once.

    With 2 CTAs/SM this is the 2 x SMs of the first tuning round (B=1, L=32K: 33 splits beat
    66). Configs with more CTAs per SM get more splits: round 1 measured 9 splits faster than 5
    at B=8, L=128K (128/4/2: 703 vs 822 us) and 2 faster than 1 at B=64, L=16K (64/4/3: 604 vs
    730 us); the capped config (4/SM) had been run with the 2/SM split counts.
    """
    tiles = math.ceil(max_tokens / cfg.block_n)
    if tiles == 0:
        return 1
    ctas = batch * num_kv_heads
    wanted = math.ceil(cfg.ctas_per_sm * num_sms / ctas)
    return max(1, min(wanted, tiles // cfg.min_tiles_per_split, tiles))
