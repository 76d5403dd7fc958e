"""GPU diagnostics of the cases the kernel suite failed on the H200 (session 1).

    python benchmarks/diagnose_gpu.py

For each case, the relative L2 error against fp64 over the dequantized cache under several
launch configs, beside the bf16 torch attention's error (the bar is twice that).
"""

import math
import sys

import torch

sys.path.insert(0, "tests")
from kernel_cases import bf16_torch_attention, build_cache, queries, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.backends import triton as tb  # noqa: E402
from foscar.configs import TritonDecodeConfig as C  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402

CASES = {
    "paper INT2 tok/tok 32K": (
        KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128)),
        (32768, 4099),
        8,
        1,
    ),
    "paper INT2 ch/tok 32K": (
        KVFormat(QuantFormat(2, "channel", 128), QuantFormat(2, "token", 128)),
        (32768, 4099),
        8,
        2,
    ),
    "K4 tok g32 / V2 tok g128": (
        KVFormat(QuantFormat(4, "token", 32), QuantFormat(2, "token", 128)),
        (1, 17, 113, 263),
        2,
        8,
    ),
    "ragged K2 tok / V4 ch g64": (
        KVFormat(QuantFormat(2, "token", 128), QuantFormat(4, "channel", 64)),
        None,
        8,
        2,
    ),
    "ragged K2 tok / V2 tok g64": (
        KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 64)),
        None,
        8,
        0,
    ),
}
CONFIGS = [
    ("default", None),
    ("128/4/3", C(128, 4, 3)),
    ("128/4/3 carried", C(128, 4, 3, tile_acc=False)),
    ("64/4/3", C(64, 4, 3)),
    ("64/4/3 r128", C(64, 4, 3, maxnreg=128)),
    ("64/4/1", C(64, 4, 1)),
]

for name, (fmt, lengths, hkv, seed) in CASES.items():
    if lengths is None:
        lengths = torch.randint(
            1, 20000, (16,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
    cache, batch = build_cache(fmt, lengths, num_kv_heads=hkv, device="cuda", seed=seed)
    q = queries(batch, 4 * hkv, 128, "cuda")
    sm = 1 / math.sqrt(128)
    ref, _ = attend_dequantized(q.double(), cache, batch, sm)
    bar = rel_l2(bf16_torch_attention(q, cache, batch, sm), ref)
    line = [f"{name}: bar {bar:.2e}"]
    for label, cfg in CONFIGS:
        try:
            o = tb.decode(q, cache, batch, sm, config=cfg)
            torch.cuda.synchronize()
            err = rel_l2(o, ref) if torch.isfinite(o).all() else float("nan")
            line.append(f"{label}: {err:.2e}")
        except Exception as exc:
            line.append(f"{label}: FAIL {type(exc).__name__} {str(exc)[:80]}")
    print(" | ".join(line), flush=True)
