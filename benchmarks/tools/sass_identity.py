"""Do two versions of the Gluon kernel compile to the same SASS? Hashes of the sm_90a SASS
(addresses stripped) of 14 configs, compiled on the CPU (triton's ptxas and cuobjdump) from
each git ref's ``foscar`` package (``WORKTREE``: this checkout as it is):

    python benchmarks/tools/sass_identity.py REF HEAD
    python benchmarks/tools/sass_identity.py HEAD WORKTREE

A refactor of a kernel validated on the H200 keeps its device results when every hash of the
configs it touches is equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HASHES = r"""
import dataclasses, hashlib, json, os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import triton
import foscar
from foscar import configs
from foscar.backends.gluon import compile_sm90
assert foscar.__file__.startswith(sys.argv[1]), foscar.__file__
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
E4M3, RECONSTRUCT = 1024, 128
one = configs.gluon_decode_config("token")
p2, p4 = configs.gluon_packed_config(2, 2), configs.gluon_packed_config(4, 4)
e4 = lambda c: dataclasses.replace(c, opt=c.opt | E4M3)
CASES = {
    "one-page bf16 INT2": (one, 4, 2, 2, {}),
    "one-page bf16 INT4": (one, 4, 4, 4, {}),
    "one-page E4M3 INT2": (e4(one), 4, 2, 2, {}),
    "one-page E4M3 INT4": (e4(one), 4, 4, 4, {}),
    "packed bf16 INT2": (p2, 4, 2, 2, {}),
    "packed E4M3 INT2": (e4(p2), 4, 2, 2, {}),
    "packed E4M3 INT4": (e4(p4), 4, 4, 4, {}),
    "E4M3 3 CTAs, 8 heads": (configs.gluon_e4m3_config(2, 2, 10**6, heads_per_kv=8), 8, 2, 2, {}),
    "channel-wise K": (configs.gluon_decode_config("channel"), 4, 2, 2, {"k_channel": True}),
    "KcVc one-page INT2/INT4": (
        configs.gluon_decode_config("channel", tile_pages=1), 4, 2, 4,
        {"k_channel": True, "v_channel": True},
    ),
    "KtVc": (one, 4, 2, 2, {"v_channel": True}),
    "head_dim 64": (one, 4, 2, 2, {"head_dim": 64}),
    "two-page token-wise": (configs.gluon_decode_config("token", tile_pages=2), 4, 2, 2, {}),
    "reconstruct": (dataclasses.replace(one, opt=one.opt | RECONSTRUCT), 4, 2, 2, {}),
}
out = {}
with tempfile.TemporaryDirectory() as tmp:
    for name, (cfg, heads, kb, vb, kw) in CASES.items():
        ck = compile_sm90(cfg, heads, kb, vb, **kw)
        path = os.path.join(tmp, "k.cubin")
        open(path, "wb").write(ck.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
        body = "\n".join(re.sub(r"/\*[0-9a-fx]+\*/", "", l).strip()
                         for l in sass.splitlines() if "/*0" in l)
        out[name] = hashlib.md5(body.encode()).hexdigest()[:12]
print(json.dumps(out))
"""


def hashes(ref: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if ref == "WORKTREE":
            root = REPO
        else:
            root = os.path.join(tmp, "src")
            os.makedirs(root)
            archive = subprocess.run(
                ["git", "-C", REPO, "archive", ref, "foscar"], capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
        env = dict(os.environ, PYTHONPATH=root, TRITON_INTERPRET="0")
        done = subprocess.run(
            [sys.executable, "-c", _HASHES, root],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
        )
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])


def main(refs):
    table = {ref: hashes(ref) for ref in refs}
    names = list(next(iter(table.values())))
    print("| config | " + " | ".join(refs) + " | same |")
    print("|---|" + "---|" * (len(refs) + 1))
    for n in names:
        row = [table[r][n] for r in refs]
        print(f"| {n} | " + " | ".join(row) + f" | {'yes' if len(set(row)) == 1 else 'NO'} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["HEAD", "WORKTREE"])
