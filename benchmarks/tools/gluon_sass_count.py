"""Instructions, barriers and local-memory accesses in the Gluon kernel's tile loops, per 64
tokens, compiled for sm_90a on the CPU (triton's bundled ptxas and cuobjdump; no GPU):

    python benchmarks/tools/gluon_sass_count.py

The configs: one-page tiles (bf16 and E4M3 operands at 2 CTAs per SM, E4M3 INT2 at 3) and
packed heads (configs.gluon_packed_config, bf16 and E4M3), INT2 and INT4 token-wise K and V,
4 query heads per KV head.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from test_gluon_kernel import tile_loops  # noqa: E402

from foscar import configs  # noqa: E402
from foscar.backends.gluon import compile_sm90  # noqa: E402

E4M3 = configs.GluonFlag.E4M3


def loops(cfg, bits):
    ck = compile_sm90(cfg, 4, bits, bits)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run(
            [os.path.join(bindir, "cuobjdump"), "-sass", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return tile_loops(sass)


def main():
    os.environ.setdefault("TRITON_INTERPRET", "0")
    print("| config | bits | instructions per 64 tokens | BAR per 64 tokens | local memory |")
    print("|---|---|---|---|---|")
    for bits in (2, 4):
        one = configs.gluon_decode_config("token")
        packed = configs.gluon_packed_config(bits, bits)
        rows = [
            ("one-page, bf16", one, 1),
            ("one-page, E4M3", dataclasses.replace(one, flags=one.flags | E4M3), 1),
            ("packed heads, bf16", packed, 2),
            ("packed heads, E4M3", dataclasses.replace(packed, flags=packed.flags | E4M3), 2),
        ]
        if bits == 2:
            three = configs.gluon_e4m3_config(2, 2, configs.E4M3_THREE_CTAS_MIN_TILES, 8)
            rows.insert(
                2,
                ("one-page, E4M3, 3 CTAs", dataclasses.replace(three, flags=three.flags | E4M3), 1),
            )
        for name, cfg, pages in rows:
            body = max(loops(cfg, bits), key=len)
            bars = sum("BAR.SYNC" in t for t in body)
            local = sum(bool(re.search(r"\b(LDL|STL)\b", t)) for t in body)
            print(
                f"| {name} | INT{bits} | {len(body) / pages:.0f} | {bars / pages:.1f} | {local} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
