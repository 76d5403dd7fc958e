"""Every KV format on the paper's stress input (what ``foscar demo`` shows).

For each format: write the stress K/V into a quantized cache, decode one query token per
sequence with the best backend on this machine, and report effective bits per element, memory
against BF16, the relative L2 error against an fp32 attention over the unquantized cache (the
quantization error), and against an fp64 attention over the dequantized cache (the decode
arithmetic's own error, which folding keeps at the level of the backend's precision).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

from .cache import QuantizedKVCache
from .decode import decode_attention, default_backend
from .formats import KVFormat, QuantFormat
from .reference import attend_dequantized, attention
from .synthetic import stress_inputs

CLIP_K, CLIP_V = 0.96, 0.92  # OSCAR's released per-token clipping ratios


@dataclass(frozen=True)
class DemoFormat:
    name: str
    fmt: KVFormat


def demo_formats(head_dim: int, length: int) -> list[DemoFormat]:
    rows = [DemoFormat("BF16", KVFormat(recent_tokens=length))]
    g = 128
    for bits in (4, 2):
        for axis in ("token", "channel"):
            for clipped in (False, True):
                fk = QuantFormat(bits, axis, g, CLIP_K if clipped else None)
                fv = QuantFormat(bits, axis, g, CLIP_V if clipped else None)
                name = f"INT{bits} {axis} {'clipped' if clipped else 'min-max'}"
                rows.append(DemoFormat(name, KVFormat(fk, fv)))
    rows.append(
        DemoFormat(
            "INT2 KIVI (K channel, V token)",
            KVFormat(QuantFormat(2, "channel", g), QuantFormat(2, "token", g)),
        )
    )
    rows.append(
        DemoFormat(
            "INT2 token clipped + BF16 64/256",
            KVFormat(
                QuantFormat(2, "token", g, CLIP_K),
                QuantFormat(2, "token", g, CLIP_V),
                sink_tokens=64,
                recent_tokens=256,
            ),
        )
    )
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def run_demo(
    *,
    length: int = 8192,
    batch: int = 2,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 64,
    seed: int = 0,
    outlier_gain: float = 2.0,
    ramp: tuple[float, float] = (1.0, 2.0),
    device: str | None = None,
    out=sys.stdout,
) -> list[dict]:
    """Run the demo and print its table; returns one dict per format."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    formats = demo_formats(head_dim, length)
    steps = len(formats) + 2
    t_start = time.perf_counter()

    def progress(i: int, text: str) -> None:
        print(
            f"[{i:2d}/{steps}] {time.perf_counter() - t_start:6.1f}s  {text}", file=out, flush=True
        )

    progress(
        1,
        f"stress input: batch={batch}, L={length}, H_q={num_q_heads}, H_kv={num_kv_heads}, "
        f"D={head_dim}; 8 K channels x{outlier_gain:g}, K ramped {ramp[0]:g}->{ramp[1]:g}, "
        "unit-std logits",
    )
    q, k, v = stress_inputs(
        length,
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=seed,
        outlier_gain=outlier_gain,
        ramp=ramp,
    )
    sm_scale = 1.0 / math.sqrt(head_dim)
    ratio = num_q_heads // num_kv_heads
    progress(2, "fp32 reference attention over the unquantized cache")
    ref = torch.stack(
        [
            attention(
                q[b].float().reshape(num_kv_heads, ratio, head_dim),
                k[b].float().transpose(0, 1),
                v[b].float().transpose(0, 1),
                sm_scale,
            )[0].reshape(num_q_heads, head_dim)
            for b in range(batch)
        ]
    )
    rows = []
    for i, item in enumerate(formats, start=3):
        pages = batch * (math.ceil(length / page_size) + 1)
        cache = QuantizedKVCache(
            item.fmt,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_pages=pages,
            max_seqs=batch,
            page_size=page_size,
            device=device,
        )
        ids = [cache.add_sequence() for _ in range(batch)]
        cache.append(
            ids,
            k.reshape(-1, num_kv_heads, head_dim).to(device),
            v.reshape(-1, num_kv_heads, head_dim).to(device),
            [length] * batch,
        )
        plan = cache.plan(ids)
        backend = default_backend(cache, q.to(device))
        o = decode_attention(q.to(device), cache, plan, sm_scale=sm_scale)
        o_deq, _ = attend_dequantized(q.double().to(device), cache, plan, sm_scale)
        stats = cache.memory_stats()
        row = {
            "format": item.name,
            "spec": item.fmt.short(),
            "bits_per_element": stats["effective_bits"],
            "memory_vs_bf16": stats["used_bytes"] / stats["bf16_bytes"],
            "rel_l2_vs_fp32": _rel(o.cpu(), ref),
            "rel_l2_vs_dequantized": _rel(o.cpu(), o_deq.cpu()),
            "backend": backend,
        }
        rows.append(row)
        progress(i, f"{item.name:34s} rel L2 {row['rel_l2_vs_fp32']:.3f}  ({backend})")
    print(file=out)
    print(format_table(rows), file=out)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'format':34s} {'bits/elem':>9s} {'memory':>8s} {'rel L2 vs fp32':>15s} "
        f"{'decode error':>13s}  backend"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['format']:34s} {r['bits_per_element']:9.3f} {r['memory_vs_bf16']:7.1%} "
            f"{r['rel_l2_vs_fp32']:15.4f} {r['rel_l2_vs_dequantized']:13.2e}  {r['backend']}"
        )
    lines.append("")
    lines.append(
        "memory: bytes of the cache (codes, fp32 scales and offsets, BF16 windows) as a "
        "share of a BF16 cache."
    )
    lines.append(
        "rel L2 vs fp32: output error against fp32 attention over the unquantized cache "
        "(quantization error)."
    )
    lines.append(
        "decode error: output error against fp64 attention over the dequantized cache "
        "(the decode arithmetic alone)."
    )
    return "\n".join(lines)
