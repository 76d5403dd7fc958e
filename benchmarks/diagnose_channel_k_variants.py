"""Which launch variant makes the Gluon kernel's channel-wise K outputs repeatable (session 5):
INT2 KcVt at the 32K paper shape, 6 calls per variant, the worst per-sequence error and the
largest difference between calls. ``repeat_check`` is also ``gluon_variants.py --repeat-check``.

    python benchmarks/diagnose_channel_k_variants.py
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kernel_cases import build_cache, queries, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402
from foscar.configs import gluon_decode_config  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402


def repeat_check(configs, calls=6, label=""):
    """Decode INT2 K channel-wise, V token-wise (32768 and 4099 tokens, 32/8 heads) ``calls``
    times with each of ``configs`` ({name: GluonDecodeConfig}); prints and returns a line per
    config: the worst error against fp64 per sequence and the largest difference between calls
    (a race shows as outputs that change from call to call)."""
    fmt = KVFormat(QuantFormat(2, "channel", 128), QuantFormat(2, "token", 128))
    cache, batch = build_cache(fmt, (32768, 4099), num_kv_heads=8, device="cuda", seed=2)
    q = queries(batch, 32, 128, "cuda")
    sm = 128**-0.5
    ref, _ = attend_dequantized(q.double(), cache, batch, sm)
    lines = []
    for name, cfg in configs.items():
        head = f"{label}{name} ({cfg.ctas_per_sm} CTA/SM)"
        try:
            outs = [
                gluon_backend.decode(q, cache, batch, sm, config=cfg).clone() for _ in range(calls)
            ]
        except Exception as exc:  # a variant that does not compile or launch
            lines.append(f"{head}: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            worst = [max(rel_l2(o[i], ref[i]) for o in outs) for i in (0, 1)]
            spread = max(float((o - outs[0]).abs().max()) for o in outs)
            lines.append(
                f"{head}: worst per seq {[f'{e:.2e}' for e in worst]}, "
                f"max diff between calls {spread:.2e}"
            )
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    base = gluon_decode_config()
    repeat_check(
        {
            "default": base,
            "late-arrive (opt|8)": dataclasses.replace(base, opt=base.opt | 8),
            "zq by convert_layout (opt|256)": dataclasses.replace(base, opt=base.opt | 256),
            "2 stages per consumer": dataclasses.replace(base, stages_per_consumer=2),
            "1 CTA/SM (no maxnreg)": dataclasses.replace(
                base, maxnreg=None, ctas_per_sm=1, consumer_regs=232, producer_regs=40
            ),
        }
    )
