# ruff: noqa: E401, E402, E501, E701, E702, E741
"""Compile one kernel config for sm_90a and dump cubin/ptx/sass/line-info SASS.
usage: python compile_one.py NAME PKGROOT KAXIS TILE_PAGES OPT_OR K_BITS V_BITS K_CHANNEL V_CHANNEL HEADS
PKGROOT: the repository (HEAD) or $OUT_DIR/old (the 1847b6b package, compile_all.sh).
Writes $OUT_DIR/NAME.* (default /tmp/sass_uninit)."""

import dataclasses
import os
import subprocess
import sys

name, root, kaxis, tp, opt_or, kb, vb, kc, vc, hpk = sys.argv[1:11]
sys.path.insert(0, root)
os.environ["TRITON_INTERPRET"] = "0"
import triton

import foscar

assert foscar.__file__.startswith(root), foscar.__file__
from foscar.backends.gluon import compile_sm90
from foscar.configs import gluon_decode_config

cfg = gluon_decode_config(kaxis, tile_pages=None if tp == "None" else int(tp))
cfg = dataclasses.replace(cfg, opt=cfg.opt | int(opt_or))
ck = compile_sm90(cfg, int(hpk), int(kb), int(vb), vc == "1", kc == "1")
out = os.path.join(os.environ.get("OUT_DIR", "/tmp/sass_uninit"), name)
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
open(out + ".cubin", "wb").write(ck.asm["cubin"])
open(out + ".ptx", "w").write(ck.asm["ptx"])
open(out + ".cfg", "w").write(
    f"{foscar.__file__}\n{cfg}\nheads_per_kv={hpk} k_bits={kb} v_bits={vb} k_channel={kc} v_channel={vc}\n"
)
sass = subprocess.run(
    [os.path.join(bindir, "cuobjdump"), "-sass", out + ".cubin"],
    capture_output=True,
    text=True,
    check=True,
).stdout
open(out + ".sass", "w").write(sass)
li = subprocess.run(
    [os.path.join(bindir, "nvdisasm"), "--print-line-info", "-c", out + ".cubin"],
    capture_output=True,
    text=True,
)
open(out + ".lines", "w").write(li.stdout + li.stderr)
print(name, "ok", cfg)
