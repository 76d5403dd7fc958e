"""Compile-only helpers for Gluon kernels on a machine without a GPU (sm_90a target).

compile_gluon(fn, signature, constexprs, num_warps=..., maxnreg=...) -> CompiledKernel
sass(ck), resources(ck), loops(sass) ... as in /work/main/benchmarks/sass_count.py, extended to
report every loop body (one per warp-specialized partition) instead of only the longest.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".triton_cache"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def desc_sig(dtype: str, block_shape, layout) -> str:
    """Signature string of a Gluon TMA descriptor argument (parsed by triton.language.str_to_ty)."""
    return f"tensordesc<{dtype}[{', '.join(map(str, block_shape))}],{layout!r}>"


def compile_gluon(fn, signature: dict, constexprs: dict, *, attrs=None, num_warps=4, maxnreg=None,
                  num_stages=1):
    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    # keep the kernel's argument order
    sig = {name: sig[name] for name in fn.arg_names}
    src = GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs or {})
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=TARGET, options=opts)


def _tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def cuobjdump(ck, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass(ck) -> str:
    return cuobjdump(ck, "--dump-sass")


def resources(ck) -> str:
    text = cuobjdump(ck, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    return f"regs={m.group(1)} stack={m.group(2)} smem_static={m.group(3)}" if m else text.strip()


_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def instructions(text: str):
    """[(addr, instr_text)] of a SASS dump."""
    out = []
    for ln in text.splitlines():
        m = _LINE.match(ln)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(text: str):
    """Every backward branch: (start_addr, end_addr, body) sorted by start; nested loops included."""
    ins = instructions(text)
    res = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(?:0x)([0-9a-f]+)", t)
        if m:
            target = int(m.group(1), 16)
            if target < a:
                body = [x for x in ins if target <= x[0] <= a]
                res.append((target, a, body))
    return sorted(res)


def opcode(t: str) -> str:
    m = re.match(r"(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", t)
    return m.group(1) if m else "?"


def classify(body) -> collections.Counter:
    c = collections.Counter()
    for _, t in body:
        c[opcode(t)] += 1
    return c


def fmt_counts(c: collections.Counter, n=40) -> str:
    return " ".join(f"{k}={v}" for k, v in c.most_common(n))


def ptxas_info(ck, arch="sm_90a") -> str:
    """Re-run the bundled ptxas with -v --warn-on-spills on the kernel's PTX (spills, warnings)."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ck.asm["ptx"])
        r = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-v", "--warn-on-spills", p, "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True)
        return (r.stdout + r.stderr).strip()


def setmaxnreg_values(text: str):
    return re.findall(r"USETMAXREG\.(\w+)\.CTAPOOL(?: UP\d,)? (0x[0-9a-f]+)", text)


def minimal_loops(text: str, must: str, count: int | None = None):
    """Innermost loops whose body contains opcode `must` (count times if given), no nested such loop."""
    cands = []
    for a, b, body in loops(text):
        c = classify(body)
        if c.get(must, 0) and (count is None or c[must] == count) and "USETMAXREG" not in c:
            cands.append((a, b, body))
    res = []
    for a, b, body in cands:
        if not any((a2, b2) != (a, b) and a <= a2 and b2 <= b for a2, b2, _ in cands):
            res.append((a, b, body))
    return res


def report_loops(ck, values_per_tile=64 * 128 * 2, warps=4):
    s = sass(ck)
    out = []
    for a, b, body in minimal_loops(s, "HGMMA"):
        c = classify(body)
        n = len(body)
        out.append(dict(kind="consumer", start=hex(a), end=hex(b), instr=n,
                        lane_per_value=n * 32 * warps / values_per_tile, counts=c))
    for a, b, body in minimal_loops(s, "UTMALDG"):
        out.append(dict(kind="producer", start=hex(a), end=hex(b), instr=len(body), counts=classify(body)))
    return out
