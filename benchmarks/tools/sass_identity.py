"""Do two versions of foscar compile their kernels to the same SASS?

Compiles every shipped kernel configuration for sm_90a on the CPU (triton's bundled ptxas and
cuobjdump; no GPU needed) from each version's ``foscar`` package, hashes each kernel's SASS with
the instruction addresses stripped, and compares the versions config by config:

    python benchmarks/tools/sass_identity.py REF [REF ...] [--out FILE] [--only KINDS] [-k TEXT]
        [--jobs N]

REF is a git ref of this repository, ``WORKTREE`` (this checkout as it is), or a directory that
holds a ``foscar/`` package. One REF prints its hashes; several print, per config, whether all
agree. A refactor keeps every device measurement of a config whose hash it leaves unchanged.
``--jobs N`` compiles each version's configs in N processes (about 7 s of one core per Gluon
config; all kinds of both versions take about 16 minutes in one process).

The configs (``--only`` picks kinds, ``-k`` a substring of the names):

- ``gluon``: the warp-specialized Hopper kernel at every launch config ``backends.gluon.decode``
  ships (``configs.gluon_decode_config`` by key axis, packed heads, the E4M3 operand path's
  one-page / 3-CTA / packed configs), for every axis pair and bit pair at head_dim 128 and 64,
  query heads per KV head 1-8, cache pages of 16, 32 and 64 tokens (128 and 256 compile too);
  both tile sizes (``FOSCAR_TEST_GLUON_TILE_PAGES``); the reconstruct ablation
  (``"gluon-reconstruct"``); the flag variants the tests compile (scaled extraction off, Q
  staged in the prologue, the merge launched without PDL).
- ``triton``: the Triton decode kernel at ``configs.triton_decode_config``'s choice for each
  branch of it (token- and channel-wise groups of 32-128, head_dim 64 and 128, BF16 windows,
  page sizes, heads per KV head, the reconstruct ablation ``"triton-reconstruct"``).
- ``merge``: the split merge (head_dim, part counts, with and without LSE and PDL).
- ``write``: the fused decode-step cache write (bit widths, head_dims, group sizes, windows,
  clipping, GPTQ keys, both operand mappings).

Flag bits are given by value (``E4M3`` 1024, ``RECONSTRUCT`` 128, ...: the kernel's numbering,
the same in every version), so that versions whose configs hold them as ``opt`` (an int) and as
``flags`` (``configs.GluonFlag``) compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("gluon", "triton", "merge", "write")

# kernel flag bits by value (configs.GluonFlag)
FAST_MAX, FAST_RCP, RECONSTRUCT, SCALED_INT2 = 1, 4, 128, 512
E4M3, Q_IN_CONSUMERS, MERGE_PDL, PACKED_HEADS = 1024, 2048, 8192, 262144
BIT_PAIRS = ((2, 2), (4, 4), (2, 4), (4, 2))
AXIS_PAIRS = (
    ("token", "token"),
    ("token", "channel"),
    ("channel", "token"),
    ("channel", "channel"),
)


# ------------------------------------------------------------------------------ configs
def _flags(cfg, add=0, remove=0):
    """``cfg`` with kernel flag bits added and removed, whichever way the version holds them."""
    import dataclasses

    if hasattr(cfg, "opt"):
        return dataclasses.replace(cfg, opt=(cfg.opt | add) & ~remove)
    flags = type(cfg.flags)((int(cfg.flags) | add) & ~remove)
    return dataclasses.replace(cfg, flags=flags)


def _axes_name(k_axis, v_axis):
    return f"K{k_axis[0]}V{v_axis[0]}"


def gluon_cases():
    """name -> (config, compile_sm90 keywords)."""
    from foscar import configs

    cases = {}

    def add(name, cfg, k_bits, v_bits, k_axis="token", v_axis="token", heads=4, hd=128, ps=64):
        cases[name] = (
            cfg,
            dict(
                heads_per_kv=heads,
                k_bits=k_bits,
                v_bits=v_bits,
                k_channel=k_axis == "channel",
                v_channel=v_axis == "channel",
                head_dim=hd,
                page_size=ps,
            ),
        )

    def by_axis(k_axis, tile_pages=None):
        return configs.gluon_decode_config(k_axis, tile_pages=tile_pages)

    # the default config of each key axis, and the other tile size (the tests' switch)
    for k_axis, v_axis in AXIS_PAIRS:
        default_tp = by_axis(k_axis).tile_pages
        for tp in (default_tp, 3 - default_tp):
            tag = "default" if tp == default_tp else "switch"
            for kb, vb in BIT_PAIRS:
                name = f"bf16 {_axes_name(k_axis, v_axis)} TP{tp} ({tag}) K{kb}V{vb}"
                add(name, by_axis(k_axis, tp), kb, vb, k_axis, v_axis)
    for tp in (1, 2):
        for kb, vb in BIT_PAIRS:
            add(f"bf16 KtVt d64 TP{tp} K{kb}V{vb}", by_axis("token", tp), kb, vb, hd=64)
    # query heads per KV head
    for h in (1, 2, 3, 5, 8):
        add(f"bf16 KtVt TP1 H{h} K2V2", by_axis("token"), 2, 2, heads=h)
    for h in (1, 8):
        add(f"bf16 KcVt TP2 H{h} K2V2", by_axis("channel"), 2, 2, "channel", heads=h)
        add(f"bf16 KtVc TP1 H{h} K2V2", by_axis("token"), 2, 2, v_axis="channel", heads=h)
    add("bf16 KtVt d64 TP1 H3 K2V2", by_axis("token"), 2, 2, heads=3, hd=64)
    # packed heads, bf16 operands (shipped for INT2; compiled for every bit pair)
    for kb, vb in BIT_PAIRS:
        add(f"bf16 packed K{kb}V{vb}", configs.gluon_packed_config(kb, vb), kb, vb)
    for h in (1, 2, 3):
        add(f"bf16 packed H{h} K2V2", configs.gluon_packed_config(2, 2), 2, 2, heads=h)
    # E4M3 operands: one-page, 3 CTAs per SM (INT2, more than 4 heads per KV head), packed
    one = by_axis("token")
    for kb, vb in BIT_PAIRS:
        add(f"e4m3 one-page K{kb}V{vb}", _flags(one, E4M3), kb, vb)
        add(f"e4m3 packed K{kb}V{vb}", _flags(configs.gluon_packed_config(kb, vb), E4M3), kb, vb)
    for h in (1, 3, 8):
        add(f"e4m3 one-page H{h} K2V2", _flags(one, E4M3), 2, 2, heads=h)
    for h in (1, 2, 3):
        add(
            f"e4m3 packed H{h} K2V2", _flags(configs.gluon_packed_config(2, 2), E4M3), 2, 2, heads=h
        )
    three = configs.gluon_e4m3_config(2, 2, configs.E4M3_THREE_CTAS_MIN_TILES, heads_per_kv=8)
    for h in (5, 8):
        add(f"e4m3 3-CTA H{h} K2V2", _flags(three, E4M3), 2, 2, heads=h)
    # cache pages other than 64 tokens (token-wise K and V at head_dim 128; 128 and 256 are
    # compiled by the tests though left to Triton)
    for ps in (16, 32):
        for kb, vb in ((2, 2), (4, 4)):
            add(f"bf16 KtVt TP1 page{ps} K{kb}V{vb}", one, kb, vb, ps=ps)
            add(f"e4m3 one-page page{ps} K{kb}V{vb}", _flags(one, E4M3), kb, vb, ps=ps)
        pk = configs.gluon_packed_config(2, 2)
        add(f"bf16 packed page{ps} K2V2", pk, 2, 2, ps=ps)
        add(
            f"e4m3 packed page{ps} K4V4",
            _flags(configs.gluon_packed_config(4, 4), E4M3),
            4,
            4,
            ps=ps,
        )
        add(f"e4m3 3-CTA H8 page{ps} K2V2", _flags(three, E4M3), 2, 2, heads=8, ps=ps)
        add(f"bf16 reconstruct KtVt page{ps} K2V2", _flags(one, RECONSTRUCT), 2, 2, ps=ps)
    for ps in (128, 256):
        add(f"bf16 KtVt TP1 page{ps} K2V2", one, 2, 2, ps=ps)
        add(f"bf16 packed page{ps} K2V2", configs.gluon_packed_config(2, 2), 2, 2, ps=ps)
    # the reconstruct ablation ("gluon-reconstruct": the key axis's config, never packed)
    for k_axis, v_axis in AXIS_PAIRS:
        default_tp = by_axis(k_axis).tile_pages
        for kb, vb in ((2, 2), (2, 4)):
            cfg = _flags(by_axis(k_axis), RECONSTRUCT)
            add(
                f"reconstruct {_axes_name(k_axis, v_axis)} TP{default_tp} K{kb}V{vb}",
                cfg,
                kb,
                vb,
                k_axis,
                v_axis,
            )
        cfg = _flags(by_axis(k_axis, 3 - default_tp), RECONSTRUCT)
        add(
            f"reconstruct {_axes_name(k_axis, v_axis)} TP{3 - default_tp} K2V4",
            cfg,
            2,
            4,
            k_axis,
            v_axis,
        )
    add("reconstruct KtVt d64 K2V2", _flags(one, RECONSTRUCT), 2, 2, hd=64)
    # flag variants the tests compile beside the defaults
    add("bf16 KtVt TP1 unscaled K2V2", _flags(one, remove=SCALED_INT2), 2, 2)
    add(
        "bf16 KcVt TP2 unscaled K2V2",
        _flags(by_axis("channel"), remove=SCALED_INT2),
        2,
        2,
        "channel",
    )
    for kb, vb in ((2, 2), (2, 4)):
        add(f"e4m3 one-page unscaled K{kb}V{vb}", _flags(one, E4M3, SCALED_INT2), kb, vb)
    add("bf16 KtVt TP1 Q in prologue K2V2", _flags(one, remove=Q_IN_CONSUMERS), 2, 2)
    add("bf16 KtVt TP1 merge without PDL K2V2", _flags(one, remove=MERGE_PDL), 2, 2)
    return cases


def triton_formats():
    """name -> (KVFormat, head_dim, heads per KV head, page size, reconstruct)."""
    from foscar.formats import KVFormat, QuantFormat

    def fmt(kb, ka, kg, vb, va, vg, sink=0, recent=0):
        return KVFormat(
            QuantFormat(kb, ka, kg), QuantFormat(vb, va, vg), sink_tokens=sink, recent_tokens=recent
        )

    cases = {}
    for kb, vb in BIT_PAIRS:
        cases[f"KtVt g128 K{kb}V{vb}"] = (
            fmt(kb, "token", 128, vb, "token", 128),
            128,
            4,
            64,
            False,
        )
    cases["KtVt g64 K2V2"] = (fmt(2, "token", 64, 2, "token", 64), 128, 4, 64, False)
    cases["Kt g32 Vt g128 K2V2 (32-token tiles)"] = (
        fmt(2, "token", 32, 2, "token", 128),
        128,
        4,
        64,
        False,
    )
    cases["Kt g128 Vt g32 K2V2"] = (fmt(2, "token", 128, 2, "token", 32), 128, 4, 64, False)
    cases["Kt g128 Vt g32 K4V4"] = (fmt(4, "token", 128, 4, "token", 32), 128, 4, 64, False)
    for kb, vb in ((2, 2), (4, 4), (2, 4)):
        cases[f"Kc g128 Vt g128 K{kb}V{vb}"] = (
            fmt(kb, "channel", 128, vb, "token", 128),
            128,
            4,
            64,
            False,
        )
        cases[f"Kt g128 Vc g128 K{kb}V{vb}"] = (
            fmt(kb, "token", 128, vb, "channel", 128),
            128,
            4,
            64,
            False,
        )
    cases["Kc g64 Vt g128 K2V2"] = (fmt(2, "channel", 64, 2, "token", 128), 128, 4, 64, False)
    cases["Kc g32 Vt g128 K2V2"] = (fmt(2, "channel", 32, 2, "token", 128), 128, 4, 64, False)
    cases["Kt g128 Vc g64 K2V2"] = (fmt(2, "token", 128, 2, "channel", 64), 128, 4, 64, False)
    cases["KcVc g128 K2V2"] = (fmt(2, "channel", 128, 2, "channel", 128), 128, 4, 64, False)
    cases["KcVc g128 K4V2"] = (fmt(4, "channel", 128, 2, "channel", 128), 128, 4, 64, False)
    for kb, vb in ((2, 2), (4, 4), (2, 4)):
        cases[f"KtVt d64 g64 K{kb}V{vb}"] = (
            fmt(kb, "token", 64, vb, "token", 64),
            64,
            4,
            64,
            False,
        )
    cases["KtVt d64 g64 H3 windows K2V2"] = (
        fmt(2, "token", 64, 2, "token", 64, 64, 256),
        64,
        3,
        64,
        False,
    )
    cases["KtVt g128 windows K2V2"] = (
        fmt(2, "token", 128, 2, "token", 128, 64, 256),
        128,
        4,
        64,
        False,
    )
    cases["KtVt g128 windows K2V4"] = (
        fmt(2, "token", 128, 4, "token", 128, 4, 37),
        128,
        4,
        64,
        False,
    )
    cases["Kc g128 Vt g128 windows K2V2"] = (
        fmt(2, "channel", 128, 2, "token", 128, 64, 256),
        128,
        4,
        64,
        False,
    )
    for h in (1, 8, 16):
        cases[f"KtVt g128 H{h} K2V2"] = (fmt(2, "token", 128, 2, "token", 128), 128, h, 64, False)
    cases["Kc g128 Vc g128 H8 K2V2"] = (
        fmt(2, "channel", 128, 2, "channel", 128),
        128,
        8,
        64,
        False,
    )
    for ps in (16, 32, 128, 256):
        cases[f"KtVt g128 page{ps} K2V2"] = (
            fmt(2, "token", 128, 2, "token", 128),
            128,
            4,
            ps,
            False,
        )
    cases["Kc g128 Vt g128 page32 K2V2"] = (
        fmt(2, "channel", 128, 2, "token", 128),
        128,
        4,
        32,
        False,
    )
    cases["Kt g128 Vc g128 page128 K2V2"] = (
        fmt(2, "token", 128, 2, "channel", 128),
        128,
        4,
        128,
        False,
    )
    for name, f in (
        ("KtVt g128 K2V2", fmt(2, "token", 128, 2, "token", 128)),
        ("KtVt g128 K4V4", fmt(4, "token", 128, 4, "token", 128)),
        ("Kt g128 Vc g128 K2V4", fmt(2, "token", 128, 4, "channel", 128, 3, 0)),
        ("Kc g128 Vt g128 K2V4", fmt(2, "channel", 128, 4, "token", 128)),
        ("KcVc g128 K2V2", fmt(2, "channel", 128, 2, "channel", 128)),
        ("Kt g32 Vt g128 K2V2", fmt(2, "token", 32, 2, "token", 128)),
    ):
        cases[f"reconstruct {name}"] = (f, 128, 4, 64, True)
    cases["reconstruct KtVt d64 g64 K2V2"] = (fmt(2, "token", 64, 2, "token", 64), 64, 4, 64, True)
    return cases


# ------------------------------------------------------------------------------ compiling
def _sass_hash(cubin: bytes, tmp: str) -> tuple[str, int]:
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run(
        [os.path.join(tools, "cuobjdump"), "-sass", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # every instruction line (``/*addr*/ OPCODE ...``; the encodings are ``/* 0x... */``): the
    # whole kernel, not only its first 4 KiB of code (addresses 0x0000-0x0ff0)
    body = [
        re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).strip()
        for ln in sass.splitlines()
        if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)
    ]
    return hashlib.md5("\n".join(body).encode()).hexdigest()[:12], len(body)


def _compile_triton(fn, consts, dtypes, options, divisible=()):
    """triton.compile of ``fn`` for sm_90a: pointers by ``dtypes`` (16-byte aligned), the other
    non-constexpr arguments fp32 if named in ``dtypes`` else i32 (divisible by 16 if named in
    ``divisible``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in dtypes:
            sig[name] = dtypes[name]
            if dtypes[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _triton_decode_kernel(fmt, d, ratio, page, reconstruct):
    from foscar import configs
    from foscar.kernels import triton_decode

    cfg = configs.triton_decode_config(fmt, d, ratio, reconstruct, ctas=64)
    hs, hpk, hpv = configs.column_widths(fmt, d, ratio, cfg.block_n, reconstruct)
    consts = dict(
        H=ratio,
        HS=hs,
        D=d,
        PAGE=page,
        BLOCK_N=cfg.block_n,
        K_BITS=fmt.key.bits,
        V_BITS=fmt.value.bits,
        K_CHANNEL=fmt.key.axis.value == "channel",
        V_CHANNEL=fmt.value.axis.value == "channel",
        K_GROUP=fmt.key.group_size,
        V_GROUP=fmt.value.group_size,
        SINK=fmt.sink_tokens,
        TAIL=fmt.tail_capacity,
        HAS_WINDOWS=fmt.sink_tokens > 0 or fmt.tail_capacity > 1,
        BLOCK_W=cfg.block_window,
        HPK=hpk,
        HPV=hpv,
        RECONSTRUCT=reconstruct,
        INTERP=False,
        TILE_ACC=cfg.tile_acc,
    )
    fn = triton_decode.decode_split_kernel
    dtypes = {n: "*i32" for n in fn.arg_names if n.endswith("_ptr")}
    dtypes.update(
        {n: "*bf16" for n in ("q_ptr", "k_sink_ptr", "v_sink_ptr", "k_tail_ptr", "v_tail_ptr")}
    )
    dtypes.update(
        {n: "*fp32" for n in ("k_scales_ptr", "v_scales_ptr", "o_part_ptr", "lse_part_ptr")}
    )
    dtypes.update(qk_scale="fp32", zero="fp32")
    divisible = [
        n for n in fn.arg_names if n.startswith("stride_") and not n.startswith("stride_lp")
    ]
    options = dict(
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return _compile_triton(fn, consts, dtypes, options, divisible)


def merge_cases():
    return {
        f"merge d{d} parts<={p}{' lse' if lse else ''}{' pdl' if pdl else ''}": (d, p, lse, pdl)
        for d, p, lse, pdl in (
            (128, 2, False, False),
            (128, 2, True, False),
            (128, 8, True, False),
            (128, 8, False, True),
            (128, 64, True, True),
            (64, 4, True, False),
            (64, 4, False, True),
        )
    }


def _merge_kernel(d, block_p, lse, pdl):
    from foscar.kernels import triton_decode

    consts = dict(D=d, BLOCK_P=block_p, WRITE_LSE=lse, INTERP=False, PDL=pdl)
    dtypes = dict(o_part_ptr="*fp32", lse_part_ptr="*fp32", o_ptr="*bf16", lse_ptr="*fp32")
    return _compile_triton(triton_decode.merge_splits_kernel, consts, dtypes, dict(num_warps=4))


def write_cases():
    """name -> (bits, head_dim, group, sink, recent, clip, gptq, mapping)."""
    return {
        "write K2 d128 g128": (2, 128, 128, 0, 0, False, False, "bf16"),
        "write K4 d128 g128": (4, 128, 128, 0, 0, False, False, "bf16"),
        "write K2 d128 g32 windows": (2, 128, 32, 64, 256, False, False, "bf16"),
        "write K2 d128 g128 clip": (2, 128, 128, 0, 0, True, False, "bf16"),
        "write K2 d128 g128 clip gptq windows": (2, 128, 128, 64, 256, True, True, "bf16"),
        "write K4 d128 g128 gptq": (4, 128, 128, 0, 0, False, True, "bf16"),
        "write K2 d64 g64": (2, 64, 64, 0, 0, False, False, "bf16"),
        "write K4 d64 g64 clip gptq": (4, 64, 64, 4, 37, True, True, "bf16"),
        "write K2 d128 g128 e4m3": (2, 128, 128, 0, 0, False, False, "e4m3"),
    }


def _write_kernel(bits, d, group, sink, recent, clip, gptq, mapping):
    from foscar.formats import OperandMapping
    from foscar.kernels import cache_write

    alpha, beta = OperandMapping(mapping).alpha_beta(bits)
    consts = dict(
        D=d,
        GROUP=group,
        BITS=bits,
        LEVELS=float((1 << bits) - 1),
        ALPHA_INV=1.0 / alpha,
        BETA=float(beta),
        CLIP=clip,
        GPTQ=gptq,
        PREFETCH=True,
    )
    dtypes = dict(
        src_ptr="*bf16",
        desc_ptr="*i32",
        sink_ptr="*bf16",
        tail_ptr="*bf16",
        words_ptr="*i32",
        scales_ptr="*fp32",
        order_ptr="*i32",
        shifts_ptr="*i32",
        factor_ptr="*fp32",
    )
    options = dict(num_warps=1 if d <= 64 else 2, enable_fp_fusion=False)
    return _compile_triton(cache_write.decode_write_kernel, consts, dtypes, options)


def hashes(kinds, pattern, shard=0, shards=1):
    """name -> (hash, instructions) of every config of ``kinds`` whose name holds ``pattern``
    (of those, every ``shards``-th from the ``shard``-th), compiled from the ``foscar`` on
    sys.path (a child process of :func:`ref_hashes`)."""
    os.environ["TRITON_INTERPRET"] = "0"
    jobs = {}
    if "gluon" in kinds:
        from foscar.backends.gluon import compile_sm90

        for name, (cfg, kw) in gluon_cases().items():
            jobs[f"gluon {name}"] = lambda cfg=cfg, kw=kw: compile_sm90(cfg, **kw)
    if "triton" in kinds:
        for name, args in triton_formats().items():
            jobs[f"triton {name}"] = lambda args=args: _triton_decode_kernel(*args)
    if "merge" in kinds:
        for name, args in merge_cases().items():
            jobs[name] = lambda args=args: _merge_kernel(*args)
    if "write" in kinds:
        for name, args in write_cases().items():
            jobs[name] = lambda args=args: _write_kernel(*args)
    picked = [name for name in jobs if pattern in name][shard::shards]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, job in jobs.items():
            if name in picked:
                try:
                    out[name] = _sass_hash(job().asm["cubin"], tmp)
                except Exception as e:  # reported in the table, the other configs go on
                    out[name] = (f"error: {type(e).__name__}: {str(e)[:200]}", 0)
                print(json.dumps({name: out[name]}), flush=True)
    return out


# ------------------------------------------------------------------------------ versions
def _root(ref: str, tmp: str) -> str:
    if ref == "WORKTREE":
        return REPO
    if os.path.isdir(os.path.join(ref, "foscar")):
        return os.path.abspath(ref)
    root = os.path.join(tmp, re.sub(r"\W", "_", ref))
    os.makedirs(root)
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", ref, "foscar"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    return root


def ref_hashes(ref: str, kinds, pattern, jobs=1) -> dict:
    """Compile in ``jobs`` fresh processes whose ``foscar`` is the one of ``ref``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = _root(ref, tmp)
        env = dict(os.environ, PYTHONPATH=root, TRITON_INTERPRET="0")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            root,
            "--only",
            ",".join(kinds),
            "-k",
            pattern,
        ]
        procs = []
        for shard in range(jobs):
            shard_dir = os.path.join(tmp, f"shard{shard}")
            os.makedirs(shard_dir)
            procs.append(
                subprocess.Popen(
                    cmd + ["--shard", f"{shard}/{jobs}"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    cwd=shard_dir,
                )
            )
        per_shard = []
        for proc in procs:
            stdout, stderr = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"{ref}: {stderr[-3000:]}")
            per_shard.append(
                [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            )
        # shard i holds configs i, i + jobs, ...: round robin restores the configs' order
        out = {}
        for i in range(max(map(len, per_shard))):
            for rows in per_shard:
                if i < len(rows):
                    out.update(rows[i])
        return out


def describe(ref: str) -> str:
    """``ref`` and the commit it names (a git ref, or a directory that is a git checkout)."""
    where = REPO if ref == "WORKTREE" or not os.path.isdir(ref) else ref
    rev = ref if where is REPO and ref != "WORKTREE" else "HEAD"
    done = subprocess.run(
        ["git", "-C", where, "rev-parse", "--short", rev], capture_output=True, text=True
    )
    commit = done.stdout.strip() if done.returncode == 0 else "not a git checkout"
    dirty = ""
    if ref == "WORKTREE":
        status = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "--", "foscar"],
            capture_output=True,
            text=True,
        ).stdout
        dirty = " plus uncommitted changes to foscar/" if status.strip() else " (foscar/ clean)"
    return f"{ref}: commit {commit}{dirty}"


def table(refs, results) -> tuple[str, int, int]:
    """The markdown table, the number of configs, and how many have one hash in every ref."""
    names = list(dict.fromkeys(n for r in refs for n in results[r]))
    lines = [
        "| config | " + " | ".join(refs) + " | instructions | same |",
        "|---|" + "---|" * (len(refs) + 2),
    ]
    same_count = 0
    for n in names:
        row = [results[r].get(n) for r in refs]
        digests = [x[0] if x else "-" for x in row]
        count = next((x[1] for x in row if x), 0)
        ok = all(len(d) == 12 for d in digests)  # a hash, not "-" or an error
        same = "yes" if ok and len(set(digests)) == 1 else "NO"
        same_count += same == "yes"
        lines.append(f"| {n} | " + " | ".join(digests) + f" | {count} | {same} |")
    return "\n".join(lines), len(names), same_count


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "refs",
        nargs="*",
        default=["HEAD", "WORKTREE"],
        help="git refs, WORKTREE, or directories holding foscar/ (default: HEAD WORKTREE)",
    )
    ap.add_argument(
        "--only",
        default=",".join(KINDS),
        help=f"comma-separated kinds of kernels among {','.join(KINDS)}",
    )
    ap.add_argument("-k", default="", help="only configs whose names contain this text")
    ap.add_argument("--out", help="also write the table (and the command) to this file")
    ap.add_argument(
        "--jobs", type=int, default=1, help="compiling processes per version (default: 1)"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    kinds = a.only.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"--only takes {','.join(KINDS)}, got {','.join(sorted(unknown))}")
    if a.jobs < 1:
        ap.error(f"--jobs takes a positive count, got {a.jobs}")
    if a.child:
        sys.path.insert(0, a.child)
        shard, shards = (int(x) for x in a.shard.split("/"))
        hashes(kinds, a.k, shard, shards)
        return
    results = {ref: ref_hashes(ref, kinds, a.k, a.jobs) for ref in a.refs}
    text, total, same = table(a.refs, results)
    import triton

    command = " ".join(
        ["python benchmarks/tools/sass_identity.py", *a.refs]
        + (["--only", a.only] if kinds != list(KINDS) else [])
        + (["-k", a.k] if a.k else [])
        + (["--jobs", str(a.jobs)] if a.jobs > 1 else [])
    )
    head = [
        f"SASS of foscar's kernels for sm_90a, compiled on the CPU (triton {triton.__version__}'s "
        "ptxas, cuobjdump), instruction addresses stripped, md5 (first 12 hex digits).",
        f"Regenerate: {command}",
        *[describe(ref) for ref in a.refs],
        f"{same} of {total} configs have the same SASS in every version.",
    ]
    print("\n".join(head) + "\n\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(head) + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
