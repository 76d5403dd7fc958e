"""Compile the Triton decode kernel for sm_90a on any machine (no GPU needed) and count SASS.

    python benchmarks/tools/sass_count.py [--bits 2] [--k-axis channel] [--v-axis token]
        [--group 128] [--head-dim 128] [--ratio 4] [--block-n 64] [--config] [--reconstruct]
        [--dump out.sass]

Counts the instructions of the main loop (the largest backward branch's body) by class and
prints lane-instructions per stored value = loop instructions * 32 * num_warps / (2 * tokens * D),
where one iteration covers BLOCK_N tokens, or a whole channel-wise K group when the group is
longer than a tile (the kernel folds Q once per group and runs the group's tiles in one iteration).
Uses triton's bundled ptxas and cuobjdump.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from foscar.configs import TritonDecodeConfig, column_widths, triton_decode_config
from foscar.formats import KVFormat, QuantFormat
from foscar.kernels import triton_decode as kern


def compile_kernel(
    fmt: KVFormat,
    *,
    head_dim=128,
    ratio=4,
    page=64,
    block_n=128,
    num_warps=4,
    num_stages=1,
    reconstruct=False,
    maxnreg=None,
    block_window=None,
):
    hs, hpk, hpv = column_widths(fmt, head_dim, ratio, block_n, reconstruct)
    consts = dict(
        H=ratio,
        HS=hs,
        D=head_dim,
        PAGE=page,
        BLOCK_N=block_n,
        K_BITS=fmt.key.bits,
        V_BITS=fmt.value.bits,
        K_CHANNEL=fmt.key.axis.value == "channel",
        V_CHANNEL=fmt.value.axis.value == "channel",
        K_GROUP=fmt.key.group_size,
        V_GROUP=fmt.value.group_size,
        SINK=fmt.sink_tokens,
        TAIL=fmt.tail_capacity,
        HAS_WINDOWS=fmt.sink_tokens > 0 or fmt.tail_capacity > 1,
        BLOCK_W=block_window or TritonDecodeConfig().block_window,
        HPK=hpk,
        HPV=hpv,
        RECONSTRUCT=reconstruct,
        INTERP=False,
        TILE_ACC=True,
    )
    options = {
        "num_warps": num_warps,
        "num_stages": num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    }
    return compile_sm90(kern.decode_split_kernel, consts, DECODE_POINTERS, options)


#: the decode split kernel's pointer arguments by element type (the rest are int32)
DECODE_POINTERS = {
    "q_ptr": "*bf16",
    "k_sink_ptr": "*bf16",
    "v_sink_ptr": "*bf16",
    "k_tail_ptr": "*bf16",
    "v_tail_ptr": "*bf16",
    "k_words_ptr": "*i32",
    "v_words_ptr": "*i32",
    "k_scales_ptr": "*fp32",
    "v_scales_ptr": "*fp32",
    "o_part_ptr": "*fp32",
    "lse_part_ptr": "*fp32",
}


def compile_sm90(fn, consts: dict, pointers: dict, options: dict):
    """``fn`` compiled for sm_90a as a real launch of foscar's Triton kernels specializes it:
    ``consts`` its constexprs; pointer arguments typed by ``pointers`` (others ``*i32``), all
    16-byte aligned; ``qk_scale`` and ``zero`` fp32, every other argument int32, the strides but
    the LSE partials' divisible by 16 (a real launch specializes every integer divisible by 16;
    at the benchmark shapes all strides but the LSE partials' are)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "zero"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_") and not name.startswith("stride_lp"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(compiled, flag: str) -> str:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run(
            [os.path.join(tools, "cuobjdump"), flag, f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout


def sass_of(compiled) -> str:
    return cuobjdump(compiled, "--dump-sass")


def fp32_dots(compiled) -> int:
    """Dots of fp32 operands in the kernel's TTGIR. The kernels' products take bf16 (or E4M3)
    operands; an fp32 one is a sum of broadcast products that Triton rewrote into a TF32 dot
    (Note [no fp32 dot] in foscar/kernels/triton_decode.py)."""
    return len(re.findall(r"tt\.dot .*: tensor<[0-9x]+xf32, #ttg\.dot_op", compiled.asm["ttgir"]))


def resources(compiled) -> str:
    """``REG:.. STACK:.. SHARED:..`` of the kernel, as ptxas reports them, and its fp32 dots."""
    text = cuobjdump(compiled, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    if not m:
        return text.strip() + f" fp32_dots={fp32_dots(compiled)}"
    # "smem" is the static part; the pipeliner's buffers are the dynamic shared memory
    return (
        f"regs={m.group(1)} stack={m.group(2)} smem={m.group(3)} "
        f"dyn_smem={compiled.metadata.shared} fp32_dots={fp32_dots(compiled)}"
    )


def main_loop(sass: str) -> list[str]:
    """Instructions of the longest loop: from a branch target to the backward BRA to it."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    best = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?.*?0x([0-9a-f]+)", ln)
        if m:
            target = int(m.group(1), 16)
            if target < addr[i]:
                body = [x for x, a in zip(lines, addr) if target <= a <= addr[i]]
                if len(body) > len(best):
                    best = body
    return best


def classify(body: list[str]) -> collections.Counter:
    c = collections.Counter()
    for ln in body:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            c[m.group(1).split(".")[0]] += 1
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--k-axis", default="token")
    ap.add_argument("--v-axis", default="token")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--ratio", type=int, default=4, help="query heads per KV head (4)")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--reconstruct", action="store_true")
    ap.add_argument("--num-stages", type=int, default=1)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument(
        "--config",
        action="store_true",
        help="compile with the launch config foscar picks (block_n, stages, register cap)",
    )
    ap.add_argument("--sink", type=int, default=0, help="BF16 sink tokens of the format")
    ap.add_argument("--recent", type=int, default=0, help="BF16 recent tokens of the format")
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    fmt = KVFormat(
        QuantFormat(a.bits, a.k_axis, a.group),
        QuantFormat(a.bits, a.v_axis, a.group),
        sink_tokens=a.sink,
        recent_tokens=a.recent,
    )
    if a.config:
        cfg = triton_decode_config(fmt, a.head_dim, a.ratio, a.reconstruct, ctas=64)
        a.block_n, a.num_stages, a.maxnreg = cfg.block_n, cfg.num_stages, cfg.maxnreg
        print(f"config: {cfg}")
    c = compile_kernel(
        fmt,
        head_dim=a.head_dim,
        ratio=a.ratio,
        block_n=a.block_n,
        num_stages=a.num_stages,
        reconstruct=a.reconstruct,
        maxnreg=a.maxnreg,
    )
    sass = sass_of(c)
    if a.dump:
        open(a.dump, "w").write(sass)
    body = main_loop(sass)
    counts = classify(body)
    # channel-wise K groups longer than a tile: one loop iteration runs the group's tiles
    tokens = a.block_n
    if a.k_axis == "channel" and not a.reconstruct and a.group > a.block_n:
        tokens = a.group
    per_value = len(body) * 32 * 4 / (2 * tokens * a.head_dim)
    print(
        f"{fmt.short()} block_n={a.block_n} stages={a.num_stages} maxnreg={a.maxnreg} "
        f"reconstruct={a.reconstruct}: "
        f"{resources(c)} loop={len(body)} instr ({tokens} tokens, "
        f"{len(body) * a.block_n / tokens:.0f} per {a.block_n}-token tile) -> "
        f"{per_value:.2f} lane-instr/value"
    )
    print("  " + " ".join(f"{k}={v}" for k, v in counts.most_common(18)))


if __name__ == "__main__":
    main()
