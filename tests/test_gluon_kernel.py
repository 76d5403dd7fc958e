"""The warp-specialized Hopper kernel (backend "gluon") against the fp64 reference.

On the CPU (CI): what can be checked without a GPU: the kernel compiles for sm_90a with the
package's launch config (the compile proves that the operand bit programs land in the wgmma
register fragments: ``convert_layout(..., assert_trivial=True)``) without spills, the backend's
coverage and its errors, the dispatch of ``backend="auto"`` and the split rule. Gluon kernels do
not run in the interpreter, so everything that launches the kernel is GPU-only (sm_90); on the
device these run the Triton path's checks over this backend: NaN-poisoned outputs, odd
lengths, every GQA ratio it covers, windows, ragged batches, the paper shape, CUDA graphs.
"""

import atexit
import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import types
import warnings

import pytest
import torch
from kernel_cases import (
    build_cache,
    check_against_reference,
    check_e4m3_against_reference,
    queries,
    rel_l2,
)

from foscar import DecodePlan, KVFormat, QuantFormat, QuantizedKVCache, configs, decode_attention
from foscar.configs import GluonDecodeConfig, GluonFlag, gluon_decode_config

pytest.importorskip("triton")
gluon_backend = pytest.importorskip("foscar.backends.gluon")
if gluon_backend.kernel_module() is None:
    pytest.skip(
        f"the Gluon kernel is written for triton {gluon_backend.GLUON_TRITON_VERSIONS} "
        "(pyproject's triton extra pins it)",
        allow_module_level=True,
    )

#: FOSCAR_TEST_GLUON_TILE_PAGES=1 or 2 runs the launching cases with that many pages per tile
#: (configs.gluon_decode_config otherwise picks by shape); the device test runs take both
TILE_PAGES = int(os.environ.get("FOSCAR_TEST_GLUON_TILE_PAGES", "0"))
sm90_only = pytest.mark.gpu(
    capability=(9, 0), reason="launches the Gluon kernel: no interpreter path"
)
INT2 = QuantFormat(2, "token", 128)
INT4 = QuantFormat(4, "token", 128)
FMT = KVFormat(INT2, INT2)
BIT_PAIRS = [(2, 2), (4, 4), (2, 4), (4, 2)]
V_AXES = ["token", "channel"]
AXIS_PAIRS = [(k, v) for k in V_AXES for v in V_AXES]  # (key axis, value axis)
# lengths 1, primes, a page multiple and its neighbours: single-token, partial-page, multi-page
LENGTHS = (1, 17, 63, 64, 65, 263, 4099)


# ---------------------------------------------------------------------------- CPU
_COMPILE = """
import json, os, subprocess, sys, tempfile, traceback
import triton
from foscar.backends.gluon import compile_sm90
from foscar.configs import GluonDecodeConfig
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def compile_one(cfg, heads_per_kv, **kw):
    ck = compile_sm90(GluonDecodeConfig(**cfg), heads_per_kv, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        open(path, "w").write(ck.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass",
                               path + ".cubin"], capture_output=True, text=True, check=True).stdout
    return dict(warps=ck.metadata.num_warps, info=info, sass=sass, ptx=ck.asm["ptx"],
                shared=ck.metadata.shared, wgmma=ck.asm["ptx"].count("wgmma.mma_async"))

for line in sys.stdin:  # a compile per line of arguments, its result or error on a line
    try:
        print("RESULT", json.dumps(compile_one(**json.loads(line))), flush=True)
    except Exception:
        print("ERROR", json.dumps(traceback.format_exc()), flush=True)
"""


def tile_loops(sass):
    """The consumers' tile loops in a SASS dump: innermost backward branches around HGMMAs (QGMMA
    for E4M3 operands), as
    lists of instruction texts. Branches back from the out-of-line mbarrier retry blocks (placed
    after the kernel's EXIT) are not loops of the code they return into."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    addr = [int(a, 16) for a, _ in ins]
    spans = []
    for i, (_, text) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr[i]:
            lo = addr.index(int(m.group(1), 16))
            body = [t for _, t in ins[lo:i]]
            if any(re.search(r"[HQ]GMMA", t) for t in body) and not any("EXIT" in t for t in body):
                spans.append((lo, i))
    inner = [(a, b) for a, b in spans if not any(a < c and d < b for c, d in spans)]
    return [[t for _, t in ins[a : b + 1]] for a, b in inner]


@functools.cache
def _page_size_compile(kind, page_size):
    """compile_in_subprocess of one config of test_page_sizes_compile_as_page_64 (page 64, its
    reference, compiled once per kind)."""
    one = gluon_decode_config("token")
    cfg, bits, d = {
        "bf16": (one, 2, 128),
        "e4m3": (dataclasses.replace(one, flags=one.flags | GluonFlag.E4M3), 4, 128),
        "packed": (configs.gluon_packed_config(2, 2), 2, 128),
        "head_dim_64": (one, 4, 64),
    }[kind]
    return compile_in_subprocess(cfg, bits, bits, head_dim=d, page_size=page_size)


# each kind at two page sizes (below and above a 64-token tile; packed heads at two it serves),
# each page size in one kind or more: a grid reduced from the 16 compiles of the cross product
@pytest.mark.parametrize(
    "kind,page_size",
    [("bf16", 16), ("bf16", 256), ("e4m3", 16), ("e4m3", 128), ("packed", 16), ("packed", 32),
     ("head_dim_64", 32), ("head_dim_64", 128)],
)  # fmt: skip
def test_page_sizes_compile_as_page_64(kind, page_size):
    """Pages other than 64 tokens change the producer only (a tile is 64 tokens: 64 / page_size
    whole pages, or a 64-row part of a larger page): the same registers, spills and shared
    memory as page 64, no local memory in the tile loops, and loops within 2% of page 64's
    length (ptxas schedules the consumers a little differently: packed INT2 at page 16 432 ->
    439 instructions for two pages)."""
    res, ref = _page_size_compile(kind, page_size), _page_size_compile(kind, 64)
    assert res["shared"] == ref["shared"]
    for pattern in (r"Used (\d+) registers", r"(\d+) bytes spill stores"):
        assert re.findall(pattern, res["info"]) == re.findall(pattern, ref["info"]), res["info"]
    loops, ref_loops = tile_loops(res["sass"]), tile_loops(ref["sass"])
    assert len(loops) == len(ref_loops) >= 2
    for body, ref_body in zip(loops, ref_loops):
        assert not [t for t in body if re.search(r"\b(LDL|STL)\b", t)]
        assert abs(len(body) - len(ref_body)) <= 0.02 * len(ref_body), (len(body), len(ref_body))


def unpaired_pack_merges(sass):
    """SASS instructions ``F2FP ..._MERGE_C Rd, Ra, Rb, Rc`` whose Rc (the upper 16 bits of Rd)
    was not last written by an F2FP, in program order: the upper half then comes from a
    register that holds no converted pair. ptxas (triton 3.6.0's) emitted
    ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R10, R10, R10, R3`` with R3 never written when all
    of a Q row's E4M3 pairs were one value (the constant zeros of a masked load)."""
    last_writer, found = {}, []
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(\S+)\s+([^;]*);", sass):
        op, regs = m.group(1), re.findall(r"\bR(?:\d+|Z)\b", m.group(2))
        if op.startswith("F2FP") and "MERGE_C" in op:
            if regs[3] != "RZ" and not last_writer.get(regs[3], "").startswith("F2FP"):
                found.append(m.group(0))
        if regs and not op.startswith(("ST", "BAR", "BRA", "ISETP", "FSETP")):
            last_writer[regs[0]] = op
    return found


@pytest.mark.parametrize(
    "heads_per_kv,packed", [(1, False), (3, False), (4, False), (8, False), (3, True), (4, True)]
)
def test_e4m3_q_staging_packs_only_converted_pairs(heads_per_kv, packed):
    """Q^'s padding rows (heads past H) are zero from a product of loaded values, not from a
    masked load's constants: with constants, ptxas packed those rows' E4M3 pairs with the upper
    half from a register never written, and the stored rows held junk on the H200 (and
    racecheck reported a write-write hazard on that store)."""
    base = configs.gluon_packed_config(2, 2) if packed else gluon_decode_config("token")
    cfg = dataclasses.replace(base, flags=base.flags | GluonFlag.E4M3)
    res = compile_in_subprocess(cfg, 2, 2, heads_per_kv=heads_per_kv)
    assert unpaired_pack_merges(res["sass"]) == []
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C" in res["sass"]  # the pattern checked


def test_unpaired_pack_merges_finds_the_pattern():
    """The checker above flags the instruction ptxas emitted at the Q staging with constants."""
    sass = """
        /*0950*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R11, R10, R11, RZ ;
        /*0990*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R20, R9, R20, R11 ;
        /*09b0*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R10, R10, R10, R3 ;
        /*09c0*/                   LOP3.LUT R3, R8, UR12, RZ, 0x3c, !PT ;
    """
    found = unpaired_pack_merges(sass)
    assert len(found) == 1 and "R10, R10, R10, R3" in found[0]


def _spill_cases():
    """Every bit pair and shape at its key axis's default tile pages (the configs that ship),
    the other tile size once per shape over every bit pair: a grid reduced from the 40 compiles
    (~3 s each) of the full cross product, still covering every pair of the three axes."""
    shapes = [(128, *axes) for axes in AXIS_PAIRS] + [(64, "token", "token")]
    for i, (head_dim, k_axis, v_axis) in enumerate(shapes):
        default = gluon_decode_config(k_axis).tile_pages
        for k_bits, v_bits in BIT_PAIRS:
            yield default, k_bits, v_bits, head_dim, k_axis, v_axis
        yield 3 - default, *BIT_PAIRS[i % len(BIT_PAIRS)], head_dim, k_axis, v_axis


@pytest.mark.parametrize("tile_pages,k_bits,v_bits,head_dim,k_axis,v_axis", list(_spill_cases()))
def test_compiles_for_sm90_without_spills(tile_pages, k_bits, v_bits, head_dim, k_axis, v_axis):
    cfg = gluon_decode_config(k_axis, tile_pages=tile_pages)
    res = compile_in_subprocess(cfg, k_bits, v_bits, head_dim, k_axis, v_axis)
    assert res["warps"] == 12  # 2 consumer warpgroups + the producer's warpgroup
    # at 2 CTAs/SM consumer 0 (104 registers) spills outside its tile loop: up to 20 bytes for
    # token-wise K at head_dim 128, 8 for channel-wise K with one-page tiles (not the default);
    # the default channel-wise K (two-page tiles) and head_dim 64 do not spill
    spilled = int(re.search(r"(\d+) bytes spill stores", res["info"]).group(1))
    allowed = {("token", 128): 20, ("channel", 1): 8}
    assert spilled <= allowed.get((k_axis, head_dim if k_axis == "token" else tile_pages), 0), (
        res["info"]
    )
    loops = tile_loops(res["sass"])
    assert len(loops) >= 2  # one per consumer
    for body in loops:  # no local memory traffic where the time goes
        assert not [t for t in body if re.search(r"\b(LDL|STL)\b", t)]
    assert cfg.maxnreg == 80 and cfg.ctas_per_sm == 2  # 2 CTAs/SM of 12 warps
    assert f"Used {cfg.maxnreg} registers" in res["info"], res["info"]
    assert res["wgmma"] >= 16  # QK and PV on the tensor cores


@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
def test_e4m3_operands_compile_without_spills(k_bits, v_bits, scaled):
    """The E4M3 operand path (GluonFlag.E4M3, FP8 wgmma m64n8k32) at the token-wise config: 2 CTAs
    per SM without spills, and its tile loops carry no more instructions than the bf16 path's
    (the point of it: one shift and one mask per four values, half the wgmma count; INT2 230
    against 255 per tile when it was written, INT4 244 against 278)."""
    base = gluon_decode_config("token")
    flags = base.flags if scaled else base.flags & ~GluonFlag.SCALED_INT2
    bf16 = compile_in_subprocess(dataclasses.replace(base, flags=flags), k_bits, v_bits)
    e4m3 = compile_in_subprocess(
        dataclasses.replace(base, flags=flags | GluonFlag.E4M3), k_bits, v_bits
    )
    # at most the bf16 path's 20 bytes, outside the tile loops (INT2 keeps one more running sum)
    assert int(re.search(r"(\d+) bytes spill stores", e4m3["info"]).group(1)) <= 20, e4m3["info"]
    assert f"Used {base.maxnreg} registers" in e4m3["info"], e4m3["info"]
    assert e4m3["wgmma"] == bf16["wgmma"] // 2  # k32 instead of k16
    loops, bf16_loops = tile_loops(e4m3["sass"]), tile_loops(bf16["sass"])
    assert len(loops) >= 2 and all(any("QGMMA" in t for t in body) for body in loops)
    for body in loops:
        assert not [t for t in body if re.search(r"\b(LDL|STL)\b", t)]
    assert max(map(len, loops)) < min(map(len, bf16_loops)), (
        [len(b) for b in loops],
        [len(b) for b in bf16_loops],
    )


@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
def test_packed_heads_compile_without_spills(k_bits, v_bits):
    """E4M3 with packed heads (configs.gluon_packed_config: two pages' scores in one [64, 8]
    tile): no local memory in the tile loops, and per 64 tokens fewer instructions than the
    one-page E4M3 loop (the softmax side runs once per 128 tokens; INT2 175 against 231 when
    it was written)."""
    packed = configs.gluon_packed_config(k_bits, v_bits)
    res = compile_in_subprocess(
        dataclasses.replace(packed, flags=packed.flags | GluonFlag.E4M3), k_bits, v_bits
    )
    one = gluon_decode_config("token")
    one = compile_in_subprocess(
        dataclasses.replace(one, flags=one.flags | GluonFlag.E4M3), k_bits, v_bits
    )
    assert f"Used {packed.maxnreg} registers" in res["info"], res["info"]
    assert int(re.search(r"(\d+) bytes spill stores", res["info"]).group(1)) <= 20, res["info"]
    loops = tile_loops(res["sass"])
    assert len(loops) >= 2 and all(sum("QGMMA" in t for t in body) == 16 for body in loops)
    for body in loops:
        assert not [t for t in body if re.search(r"\b(LDL|STL)\b", t)]
    per_64 = max(map(len, loops)) / 2
    assert per_64 < 0.85 * min(map(len, tile_loops(one["sass"]))), per_64


@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
def test_packed_heads_bf16_compile_without_spills(k_bits, v_bits):
    """Packed heads with bf16 operands (configs.gluon_packed_config without the E4M3 bit): no
    local memory in the tile loops, fewer instructions per 64 tokens than the one-page bf16
    loop (INT2 219 against 255 when it was written)."""
    res = compile_in_subprocess(configs.gluon_packed_config(k_bits, v_bits), k_bits, v_bits)
    one = compile_in_subprocess(gluon_decode_config("token"), k_bits, v_bits)
    loops = tile_loops(res["sass"])
    assert len(loops) >= 2
    for body in loops:
        assert not [t for t in body if re.search(r"\b(LDL|STL)\b", t)]
    per_64 = max(map(len, loops)) / 2
    assert per_64 < 0.92 * min(map(len, tile_loops(one["sass"]))), per_64


@pytest.mark.parametrize(
    "fmt, heads, tile_pages, match",
    [
        (FMT, 8, 2, "at most 4 query heads per KV head"),
        (KVFormat(INT2, QuantFormat(2, "channel", 128)), 4, 2, "token-wise K and V"),
        (FMT, 4, 1, "two-page tiles"),
        (KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64)), 4, 2, "head_dim 128"),
    ],
)
def test_packed_heads_refuse_what_they_do_not_cover(fmt, heads, tile_pages, match):
    """A packed-heads config is refused before any launch (on the CPU here): more than 4 query
    heads per KV head, a channel-wise role, one-page tiles, head_dim 64, the reconstruct
    ablation, Q staged in the prologue."""
    d = fmt.key.group_size
    cache, batch = build_cache(fmt, (100,), num_kv_heads=2, head_dim=d)
    q = queries(batch, 2 * heads, d, "cpu")
    cfg = dataclasses.replace(configs.gluon_packed_config(2, 2), tile_pages=tile_pages)
    with pytest.raises(ValueError, match=match):
        gluon_backend.decode(q, cache, batch, 128**-0.5, config=cfg)
    if (fmt, heads, tile_pages) == (FMT, 4, 1):
        cfg = configs.gluon_packed_config(2, 2)
        with pytest.raises(ValueError, match="with the folds"):
            gluon_backend.decode(q, cache, batch, 128**-0.5, config=cfg, reconstruct=True)
        with pytest.raises(ValueError, match="Q staged by each consumer"):
            no_qc = dataclasses.replace(cfg, flags=cfg.flags & ~GluonFlag.Q_IN_CONSUMERS)
            gluon_backend.decode(q, cache, batch, 128**-0.5, config=no_qc)


def test_reconstruct_ablation_never_takes_packed_heads():
    """backend "gluon-reconstruct" at a launch where the folds pack heads (8K INT2 tiles)
    keeps one page per tile (the ablation reconstructs every value; packed heads fold)."""
    cache = QuantizedKVCache(FMT, num_kv_heads=8, head_dim=128, num_pages=1, max_seqs=1)
    batch = types.SimpleNamespace(num_quantized_host=[8192] * 8, layer=0, fixed_split_history=None)
    assert gluon_backend.default_config(cache, batch, "bf16", 4).flags & GluonFlag.PACKED_HEADS
    cfg = gluon_backend.default_config(cache, batch, "bf16", 4, reconstruct=True)
    assert cfg == gluon_backend.gluon_decode_config("token")


def test_a_fixed_split_history_fixes_the_config():
    """A plan for a CUDA graph (fixed_split_history) gets the config of the history its splits
    are planned for, whatever its sequences hold now: a launch captured at a short step is the
    launch of a long one."""
    cache = QuantizedKVCache(FMT, num_kv_heads=8, head_dim=128, num_pages=1, max_seqs=1)

    def config(lengths, fixed):
        batch = types.SimpleNamespace(num_quantized_host=lengths, layer=0, batch_size=8,
                                      fixed_split_history=fixed)
        return gluon_backend.default_config(cache, batch, "bf16", 4)

    assert config([8192] * 8, None) != config([64] * 8, None)  # by the tiles of the launch
    assert config([64] * 8, 8192) == config([8192] * 8, 8192) == config([8192] * 8, None)


@pytest.mark.parametrize("in_consumers", [True, False])
def test_q_is_staged_after_the_partitions_start(in_consumers):
    """GluonFlag.Q_IN_CONSUMERS (the default): the consumers load Q, so the prologue issues no
    global load before the partitions start (``barrier.sync 1``, triton's warp-specialize
    dispatch) and the producer's first copies do not wait for one. With the prologue staging Q
    it loads Q there."""
    base = gluon_decode_config("token")
    assert base.flags & GluonFlag.Q_IN_CONSUMERS
    flags = base.flags if in_consumers else base.flags & ~GluonFlag.Q_IN_CONSUMERS
    ptx = compile_in_subprocess(dataclasses.replace(base, flags=flags), 2, 2)["ptx"]
    prologue = ptx[: ptx.index("barrier.sync \t1;")]
    assert ("ld.global" in prologue) != in_consumers


def test_merge_launch_is_signalled_after_the_partials():
    """GluonFlag.MERGE_PDL (the default): the merge is a programmatic dependent launch, and the
    split kernel signals it (``griddepcontrol.launch_dependents``) once, after the partitions
    joined and its partial is stored, so waiting merge CTAs never hold SM slots while tiles
    stream (a signal at the kernel's start measured slower; docs/tuning.md)."""
    cfg = gluon_decode_config("token")
    assert cfg.flags & GluonFlag.MERGE_PDL
    ptx = compile_in_subprocess(cfg, 2, 2)["ptx"]
    signals = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", ptx)]
    assert len(signals) == 1
    # the partial's stores (o and lse) precede the signal in its basic block, and nothing is
    # stored to global memory after it
    block = ptx[ptx.rfind("\n$L__BB", 0, signals[0]) : signals[0]]
    assert len(re.findall(r"st\.global", block)) >= 2, block[-600:]
    assert "st.global" not in ptx[signals[0] : ptx.index("ret;", signals[0])]


def compile_in_subprocess(
    cfg, k_bits, v_bits, head_dim=128, k_axis="token", v_axis="token", heads_per_kv=4, page_size=64
):
    """compile_sm90 + ptxas -v + the SASS, in another process: the interpreter
    (TRITON_INTERPRET=1, set for the CPU suite) replaces triton's own jit functions, which the
    Gluon compiler cannot reference."""
    args = dict(
        cfg={**dataclasses.asdict(cfg), "flags": int(cfg.flags)},
        k_bits=k_bits,
        v_bits=v_bits,
        v_channel=v_axis == "channel",
        k_channel=k_axis == "channel",
        head_dim=head_dim,
        heads_per_kv=heads_per_kv,
        page_size=page_size,
    )
    return _compile(json.dumps(args, sort_keys=True))


@functools.cache  # tests share configs (the default one compiles in five): compile each once
def _compile(args: str) -> dict:
    """A compile by the process of _COMPILE, started at the first one and kept for the next
    (its imports take more time than a compile)."""
    if not _COMPILER or _COMPILER[0].poll() is not None:
        errors = tempfile.TemporaryFile()
        process = subprocess.Popen(
            [sys.executable, "-c", _COMPILE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=dict(os.environ, TRITON_INTERPRET="0"),
        )
        _COMPILER[:] = [process, errors]
        atexit.register(process.communicate)  # closes its stdin, and it ends
    process, errors = _COMPILER
    process.stdin.write(args + "\n")
    process.stdin.flush()
    for line in process.stdout:
        kind, _, result = line.partition(" ")
        if kind == "RESULT":
            return json.loads(result)
        if kind == "ERROR":
            raise AssertionError(json.loads(result)[-2000:])
    process.wait()  # it died: the next compile starts another
    errors.seek(0)
    raise AssertionError(errors.read().decode(errors="replace")[-2000:])


#: the compile process of _compile and the file of its stderr
_COMPILER = []


@pytest.mark.parametrize(
    "fmt, heads, reason",
    [
        (KVFormat(QuantFormat(4, "channel", 64), INT2), 8, "key is i4c64"),
        (KVFormat(INT4, QuantFormat(4, "token", 32)), 8, "value is i4t32"),
        (KVFormat(INT2, QuantFormat(2, "channel", 64)), 8, "value is i2c64"),
        (KVFormat(INT2, QuantFormat(2, "token", 64)), 8, "value is i2t64"),
        (KVFormat(INT2, INT2, mapping="e4m3"), 8, "mapping is 'e4m3'"),
        (FMT, 18, "at most 8 query heads per KV head, got 9"),
    ],
)
def test_supports_names_what_it_does_not_cover(fmt, heads, reason):
    cache, _ = build_cache(fmt, (5,))
    assert reason in gluon_backend.supports(cache, heads)


def test_supports_head_dim_and_page_size():
    fmt64 = KVFormat(QuantFormat(2, "token", 64), QuantFormat(4, "token", 64))
    cache, _ = build_cache(fmt64, (5,), head_dim=64)
    assert gluon_backend.supports(cache, 4) is None
    g32 = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 64))
    cache, _ = build_cache(g32, (5,), head_dim=64)
    assert "g=head_dim=64; key is i2t32" in gluon_backend.supports(cache, 4)
    for v in (QuantFormat(2, "channel", 64), QuantFormat(2, "channel", 128)):
        cache, _ = build_cache(KVFormat(QuantFormat(2, "token", 64), v), (5,), head_dim=64)
        reason = gluon_backend.supports(cache, 4)
        assert f"at head_dim 128 only (got 64); value is {v.short()}" in reason
    cache, _ = build_cache(KVFormat(QuantFormat(2, "channel", 64), INT2), (5,))
    assert "groups of 128 tokens (2 pages); key is i2c64" in gluon_backend.supports(cache, 4)
    fmt256 = KVFormat(INT2, INT2)
    cache, _ = build_cache(fmt256, (5,), head_dim=256)
    assert "head_dim 128 or 64, got 256" in gluon_backend.supports(cache, 4)
    for page_size in (16, 32):  # token-wise K and V at head_dim 128
        cache, _ = build_cache(FMT, (5,), page_size=page_size)
        assert gluon_backend.supports(cache, 4) is None
        cache, _ = build_cache(
            KVFormat(INT2, QuantFormat(2, "channel", 128)), (5,), page_size=page_size
        )
        assert f"channel-wise groups at page_size 64 (a group is two pages), got {page_size}" in (
            gluon_backend.supports(cache, 4)
        )
    for page_size in (128, 256):  # compile and were timed; GPU cases not (all) run: Triton's
        cache, _ = build_cache(FMT, (5,), page_size=page_size)
        assert f"page sizes (16, 32, 64), got {page_size}" in gluon_backend.supports(cache, 4)
    cache, _ = build_cache(fmt64, (5,), head_dim=64, page_size=16)
    assert "page_size 16 at head_dim 128 (got 64)" in gluon_backend.supports(cache, 4)
    for fmt in (
        FMT,
        KVFormat(INT4, INT2),
        KVFormat(INT2, INT4, sink_tokens=64, recent_tokens=256),
        KVFormat(INT2, QuantFormat(2, "channel", 128)),
        KVFormat(QuantFormat(4, "channel", 128), QuantFormat(2, "channel", 128)),
    ):
        cache, _ = build_cache(fmt, (5,))
        assert gluon_backend.supports(cache, 8) is None


def test_cpu_call_is_refused_and_auto_does_not_pick_it():
    cache, batch = build_cache(FMT, (70, 3))
    q = queries(batch, 8, 128, "cpu")
    for backend in ("gluon", "gluon-reconstruct", "gluon-e4m3"):
        with pytest.raises(ValueError, match=f"backend '{backend}' needs .* Hopper"):
            decode_attention(q, cache, batch, backend=backend)
    from foscar.decode import default_backend

    assert default_backend(cache, q) != "gluon"


@pytest.mark.parametrize(
    "fmt,head_dim,reason",
    [
        (KVFormat(INT2, QuantFormat(2, "channel", 128)), 128, "token-wise K and V"),
        (KVFormat(QuantFormat(4, "channel", 128), INT4), 128, "token-wise K and V"),
        (KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64)), 64, "head_dim 128"),
        (KVFormat(INT4, INT4, mapping="e4m3"), 128, "mapping 'bf16'"),
    ],
)
def test_e4m3_operands_name_what_they_do_not_cover(fmt, head_dim, reason):
    cache, _ = build_cache(fmt, (70,), head_dim=head_dim)
    assert reason in gluon_backend.supports_e4m3(cache)
    assert gluon_backend.supports_e4m3(build_cache(FMT, (70,))[0]) is None


def test_tma_descriptors_cover_the_pools_and_are_cached():
    """One TMA box is one page of one KV head: the words of 64 tokens ([1, 1, 64, D * bits / 32])
    and the page's 128 scale floats; built once per plan (the plan owns them, the cache holds
    none)."""
    fmt = KVFormat(INT4, QuantFormat(2, "channel", 128))
    cache, batch = build_cache(fmt, (100, 300), num_kv_heads=2)
    plan = gluon_backend.GluonDecodePlan(cache, batch, 8, 128**-0.5)
    kw, ks, vw, vs = plan.descriptors()
    st = cache.layers[0]
    assert (kw.block_shape, kw.shape) == ([1, 1, 64, 16], list(st.k_words.shape))
    assert (vw.block_shape, vw.shape) == ([1, 1, 64, 8], list(st.v_words.shape))
    for desc, scales in ((ks, st.k_scales), (vs, st.v_scales)):
        assert desc.block_shape == [1, 1, 128]
        assert desc.shape == [scales.shape[0], scales.shape[1], scales[0, 0].numel()]
    assert plan.descriptors()[0] is kw
    other = gluon_backend.GluonDecodePlan(cache, batch, 8, 128**-0.5)
    assert other.descriptors()[0] is not kw
    fmt64 = KVFormat(QuantFormat(2, "token", 64), QuantFormat(4, "token", 64))
    cache, _ = build_cache(fmt64, (100,), head_dim=64)
    kw, ks, vw, _ = gluon_backend.tma_descriptors(cache, 0)
    assert (kw.block_shape, vw.block_shape, ks.block_shape) == (
        [1, 1, 64, 4],
        [1, 1, 64, 8],
        [1, 1, 128],
    )


@pytest.mark.parametrize(
    "batch, tokens, expected",
    [(1, 32768, 33), (1, 131072, 33), (8, 131072, 4), (64, 131072, 1), (1, 64, 1), (1, 300, 2)],
)
def test_split_rule(batch, tokens, expected):
    """2 CTAs per SM on 132 SMs filled once (rounded down), at least a tile (one page) for each
    of the two consumers per split."""
    cfg = GluonDecodeConfig()
    assert configs.gluon_num_splits(batch, 8, tokens, cfg, 132) == expected


@pytest.mark.parametrize(
    "k_bits, v_bits, lengths, heads, expected",
    [
        (2, 2, (8192,) * 8, 4, "packed"),  # 8 x 128 pages x 8 KV heads = 8K tiles
        (2, 2, (8192,) * 7 + (8128,), 4, "one-page"),  # one page fewer
        (2, 2, (131072,) * 64, 4, "packed"),
        (2, 2, (131072,) * 64, 8, "3 CTAs"),  # 8 query heads per KV head: no packing
        (2, 2, (32768,) * 8, 8, "3 CTAs"),  # 32K tiles
        (2, 2, (32768,) * 7 + (32704,), 8, "one-page"),
        (2, 2, (524288,), 8, "3 CTAs"),
        (4, 4, (4096,) * 8, 4, "packed"),  # INT4 packs from 4K tiles
        (4, 4, (4096,) * 7 + (4032,), 4, "one-page"),
        (4, 4, (131072,) * 64, 8, "one-page"),  # INT4 stays at 2 CTAs per SM (its rings)
        (2, 4, (4096,) * 8, 4, "packed"),  # mixed widths: the INT4 threshold
    ],
)
def test_e4m3_launch_config_follows_the_measurements(k_bits, v_bits, lengths, heads, expected):
    """E4M3 operands take packed heads from configs.E4M3_PACKED_MIN_TILES on when a KV head
    serves at most 4 query heads (H200), else 3 CTAs per SM for INT2 from 32K tiles on
    (configs.E4M3_THREE_CTAS_MIN_TILES), with more splits to fill them; the bf16
    path packs INT2 from 8K tiles and keeps its config otherwise."""
    fmt = KVFormat(QuantFormat(k_bits, "token", 128), QuantFormat(v_bits, "token", 128))
    cache = QuantizedKVCache(fmt, num_kv_heads=8, head_dim=128, num_pages=1, max_seqs=1)
    batch = types.SimpleNamespace(
        num_quantized_host=list(lengths), layer=0, fixed_split_history=None
    )
    cfg = gluon_backend.default_config(cache, batch, "e4m3", heads)
    got = (
        "packed"
        if cfg.flags & GluonFlag.PACKED_HEADS
        else ("3 CTAs" if cfg.ctas_per_sm == 3 else "one-page")
    )
    assert got == expected
    if expected == "packed":
        assert cfg == configs.gluon_packed_config(k_bits, v_bits)
        assert (cfg.tile_pages, cfg.ctas_per_sm) == (2, 2)
    elif expected == "3 CTAs":
        assert (cfg.maxnreg, cfg.consumer_regs, cfg.producer_regs) == (56, 72, 24)
        assert configs.gluon_num_splits(8, 8, 32768, cfg, 132) == 6  # 396 slots / 64 rows
    else:
        assert cfg == gluon_backend.gluon_decode_config("token")
    bf16 = gluon_backend.default_config(cache, batch, "bf16", heads)
    if k_bits == v_bits == 2 and heads <= 4 and expected == "packed":  # INT2 packs from 8K too
        assert bf16 == configs.gluon_packed_config(2, 2)
    else:  # (the module's function: the tile-pages fixture may patch it)
        assert bf16 == gluon_backend.gluon_decode_config("token")


@pytest.mark.parametrize(
    "k_axis, v_axis, bits, lengths, heads, head_dim, packed",
    [
        ("token", "token", 2, (8192,) * 8, 4, 128, True),  # 8K tiles
        ("token", "token", 2, (8192,) * 7 + (8128,), 4, 128, False),
        ("token", "token", 2, (8192,) * 8, 8, 128, False),  # 8 query heads per KV head
        ("token", "token", 4, (131072,) * 64, 4, 128, False),  # INT4 measured slower packed
        ("token", "channel", 2, (131072,) * 64, 4, 128, False),
        ("channel", "token", 2, (131072,) * 64, 4, 128, False),
        ("token", "token", 2, (131072,) * 64, 4, 64, False),  # head_dim 64
    ],
)
def test_bf16_launch_config_follows_the_measurements(
    k_axis, v_axis, bits, lengths, heads, head_dim, packed
):
    """The bf16 operand path takes packed heads for INT2 token-wise K and V at head_dim 128 from
    configs.BF16_PACKED_MIN_TILES on, at most 4 query heads per KV head (H200); every
    other launch keeps the key axis's config."""
    g = 64 if head_dim == 64 else 128
    fmt = KVFormat(QuantFormat(bits, k_axis, g), QuantFormat(bits, v_axis, g))
    cache = QuantizedKVCache(fmt, num_kv_heads=8, head_dim=head_dim, num_pages=1, max_seqs=1)
    batch = types.SimpleNamespace(
        num_quantized_host=list(lengths), layer=0, fixed_split_history=None
    )
    cfg = gluon_backend.default_config(cache, batch, "bf16", heads)
    if packed:
        assert cfg == configs.gluon_packed_config(bits, bits)
    else:
        assert cfg == gluon_backend.gluon_decode_config(k_axis)


def test_e4m3_three_ctas_per_sm_compile_to_fit():
    """The 3-CTA E4M3 config (INT2): 56 registers at launch for 12 warps, shared memory for three
    CTAs (228 KiB per SM, 1 KiB reserved per CTA), tile loops without local memory."""
    cfg = configs.gluon_e4m3_config(2, 2, configs.E4M3_THREE_CTAS_MIN_TILES, heads_per_kv=8)
    assert cfg.ctas_per_sm == 3
    res = compile_in_subprocess(dataclasses.replace(cfg, flags=cfg.flags | GluonFlag.E4M3), 2, 2)
    assert "Used 56 registers" in res["info"], res["info"]
    assert 56 * 32 * res["warps"] * 3 <= 65536, res["warps"]  # the register file of an SM
    assert 3 * (res["shared"] + 1024) <= 228 * 1024, res["shared"]
    loops = tile_loops(res["sass"])
    assert len(loops) >= 2 and all(any("QGMMA" in t for t in body) for body in loops)
    for body in loops:
        assert not [t for t in body if re.search(r"\b(LDL|STL)\b", t)]


@pytest.mark.parametrize("tokens, expected", [(64, 1), (300, 1), (512, 2), (131072, 33)])
def test_split_rule_counts_two_page_tiles(tokens, expected):
    """With two-page tiles a split holds at least two 128-token tiles (one per consumer)."""
    cfg = gluon_decode_config("channel")  # 2 CTAs per SM, two-page tiles
    assert configs.gluon_num_splits(1, 8, tokens, cfg, 132) == expected


def test_default_tile_pages_follow_the_measurements():
    """Two-page tiles (2 stages per consumer) for channel-wise K, one-page tiles for token-wise
    K (configs.gluon_decode_config, as the H200 measured); anything else is refused."""
    chan, tok = gluon_decode_config("channel"), gluon_decode_config("token")
    assert (chan.tile_pages, chan.stages_per_consumer) == (2, 2)
    assert (tok.tile_pages, tok.stages_per_consumer) == (1, 4)
    two = gluon_decode_config("token", tile_pages=2)
    assert (two.tile_pages, two.stages_per_consumer, two.ctas_per_sm) == (2, 2, 2)
    with pytest.raises(ValueError, match="tile_pages must be 1 or 2, got 3"):
        gluon_decode_config("token", tile_pages=3)


def test_channel_wise_keys_launch_two_ctas_per_sm():
    """Channel-wise K's config fills 2 CTAs per SM with two-page tiles (whose late stage release
    made its outputs repeatable there), and a one-page config at 2 CTAs is warned about."""
    cfg = gluon_decode_config("channel")
    assert (cfg.ctas_per_sm, cfg.maxnreg, cfg.tile_pages) == (2, 80, 2)
    assert configs.gluon_num_splits(8, 8, 131072, cfg, 132) == 4  # 264 // 64


@pytest.mark.gpu(reason="launches the kernel")
def test_one_page_two_cta_config_for_channel_wise_keys_warns():
    fmt = KVFormat(QuantFormat(2, "channel", 128), INT2)
    cache, batch = build_cache(fmt, (300,), device="cuda")
    q = queries(batch, 8, 128, "cuda")
    with pytest.warns(RuntimeWarning, match="CTAs per SM"):
        gluon_backend.decode(q, cache, batch, 128**-0.5, config=GluonDecodeConfig())


def test_two_page_tiles_release_their_stage_after_the_last_product():
    """Note [late stage release]: in a two-page tile loop the empty-barrier arrive comes after
    the tile's last wgmma wait (before it, the refill raced the tile at 2 CTAs per SM)."""
    ptx = compile_in_subprocess(gluon_decode_config("channel"), 2, 2, k_axis="channel")["ptx"]
    loops = re.findall(r"mbarrier.try_wait.*?(?=mbarrier.try_wait|\Z)", ptx, re.S)
    consumer_loops = [body for body in loops if "wgmma.mma_async" in body]
    assert len(consumer_loops) >= 2
    for body in consumer_loops:
        arrive = body.index("mbarrier.arrive.shared")
        assert arrive > body.rindex("wgmma.wait_group"), "stage released before the last wait"


@pytest.mark.parametrize("k_axis", V_AXES)
@pytest.mark.parametrize("v_axis", V_AXES)
@pytest.mark.parametrize("tile_pages", [1, 2])
@pytest.mark.parametrize("ctas", [1, 2])
def test_config_warnings_name_the_configs_that_raced(k_axis, v_axis, tile_pages, ctas):
    """The launcher warns for exactly the configs whose outputs changed between calls:
    channel-wise K with one-page tiles at more than 1 CTA per SM, channel-wise K and V at
    one-page tiles (each message points to docs/tuning.md); the defaults of every axis pair warn
    for nothing."""
    fmt = KVFormat(QuantFormat(2, k_axis, 128), QuantFormat(2, v_axis, 128))
    cfg = dataclasses.replace(gluon_decode_config(k_axis), tile_pages=tile_pages, ctas_per_sm=ctas)
    messages = gluon_backend.config_warnings(fmt, cfg)
    expected = []
    if k_axis == "channel" and ctas > 1 and tile_pages == 1:
        expected.append("CTAs per SM")
    if k_axis == v_axis == "channel" and tile_pages == 1:
        expected.append("one-page tiles")
    assert len(messages) == len(expected)
    for message, phrase in zip(messages, expected):
        assert phrase in message and "docs/tuning.md" in message
    assert gluon_backend.config_warnings(fmt, gluon_decode_config(k_axis)) == []


@pytest.mark.gpu(reason="launches the kernel")
def test_one_page_tiles_for_channel_wise_keys_and_values_warn():
    """KcVc with one-page tiles was not repeatable on the H200 at 1 CTA per SM; the
    default two-page config was, and does not warn."""
    fmt = KVFormat(QuantFormat(2, "channel", 128), QuantFormat(2, "channel", 128))
    cache, batch = build_cache(fmt, (300,), device="cuda")
    q = queries(batch, 8, 128, "cuda")
    with pytest.warns(RuntimeWarning, match="one-page tiles"):
        gluon_backend.decode(
            q, cache, batch, 128**-0.5, config=gluon_decode_config("channel", tile_pages=1)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gluon_backend.decode(q, cache, batch, 128**-0.5, config=gluon_decode_config("channel"))


# ---------------------------------------------------------------------------- sm_90 only
def test_scaled_extraction_exponents_match_the_cache_layout():
    """GluonFlag.SCALED_INT2's powers of 4 per channel (gluon.operands.scaled_exponent_k / _v)
    are where the cache puts each INT2 field (foscar.formats.kernel_bit_location): a field at
    bit p of its 16-bit half (K) or byte piece (V) is taken after a shift by 6 (p // 6) and
    lands at mantissa bit p - 6 (p // 6), so its operand is 128 + 2^(p - 6 (p // 6)) q."""
    from foscar.formats import kernel_bit_location
    from foscar.kernels.gluon import operands

    for role, width, exponent in (
        ("key", 16, operands.scaled_exponent_k.fn),
        ("value", 8, operands.scaled_exponent_v.fn),
    ):
        for c in range(128):
            _, bit = kernel_bit_location(role, c, 128, 2)
            p = bit % width
            assert 2 * exponent(c) == p - 6 * (p // 6), (role, c, bit)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode, no sign replication): byte i is byte sel[4i:4i+3] of {b, a}."""
    both = (b << 32) | a
    return sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _e4m3_fields(x: int, f: int, bits: int, scaled: bool) -> int:
    """foscar.kernels.gluon.operands._fields_e4m3 on one 32-bit word."""
    if scaled:
        return (x >> (4 * (f // 2))) & (0x03030303 << (2 * (f % 2)))
    return (x >> (bits * f)) & (((1 << bits) - 1) * 0x01010101)


@pytest.mark.parametrize("bits,scaled", [(2, False), (2, True), (4, False)])
def test_e4m3_operand_programs_read_the_cache_layout(bits, scaled):
    """The E4M3 operand programs (GluonFlag.E4M3) replayed per thread on words packed by the cache's
    own packer: every byte of every A-fragment register (wgmma m64nNk32 e4m3: thread (w, l) holds
    rows l//4 + 8i + 16w (+ 64 for V^T's second m-tile), columns 4 (l%4) + j + 16 i' + 32 kb)
    is the code its row and column stand for: K's column k is channel _e4m3_key_channel(k) (Q is
    stored in that order), V^T's column is the token itself; scaled INT2 fields carry 4^a with
    a = (k // 16) % 2 for K (the kernel folds 4^-a into Q) and a = (c // 8) % 2 for V (into the
    output). This pins the bit programs, as written out here (the selectors and masks are
    restated, not called: they are Gluon code), to foscar.formats. The compile test's
    assert_trivial conversions pin which thread holds which value, not the order of values
    within a thread (a swap of two register dimensions compiles); the device tests, against
    fp64, pin the rest."""
    from foscar.formats import Role, channel_order, pack_codes
    from foscar.kernels.gluon import operands

    hd, tokens = 128, 64
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (tokens, hd), generator=gen)
    words = {}
    for role in ("key", "value"):
        w = pack_codes(codes, bits, "bf16", channel_order(Role(role), bits, hd))
        words[role] = [[int(v) & 0xFFFFFFFF for v in row] for row in w.tolist()]
    key_channel = operands.e4m3_key_channel.fn
    nf, e_words = 8 // bits, hd * bits // 128
    piece_bits = bits * hd // 32
    pw, pby = 32 // piece_bits, piece_bits // 8
    for warp in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            # K [64 tokens, 128 columns]: register (i, i', kb) of the thread's rows
            for i in range(2):
                row = g + 8 * i + 16 * warp
                for col16 in range(hd // 16):  # 16 i' + 32 kb = 16 (f + NF e)
                    f, e = col16 % nf, col16 // nf
                    x = _e4m3_fields(words["key"][row][e_words * t + e], f, bits, scaled)
                    for j in range(4):
                        k = 16 * col16 + 4 * t + j
                        shift = 2 * ((k // 16) % 2) if scaled else 0
                        want = int(codes[row, key_channel(k, bits)]) << shift
                        assert (x >> (8 * j)) & 0xFF == want, ("key", warp, lane, row, k)
            # V^T [128 channels, 64 tokens]: piece 8w + g of 4 tokens per register
            piece = 8 * warp + g
            wi, xi = piece // pw, piece % pw
            lo = xi * pby
            sel = (
                lo | ((lo + 1) << 4) | ((lo + 4) << 8) | ((lo + 5) << 12)
                if pby == 2
                else lo | ((lo + 4) << 4) | (lo << 8) | ((lo + 4) << 12)
            )
            for quad in range(4):  # (kb, i'): tokens 16 quad + 4 t + j
                tok = [16 * quad + 4 * t + j for j in range(4)]
                a = _prmt(words["value"][tok[0]][wi], words["value"][tok[1]][wi], sel)
                b = _prmt(words["value"][tok[2]][wi], words["value"][tok[3]][wi], sel)
                for hb in range(pby):
                    sel2 = hb | ((pby + hb) << 4) | ((4 + hb) << 8) | ((4 + pby + hb) << 12)
                    gathered = _prmt(a, b, sel2)
                    for fb in range(8 // bits):
                        fld = hb * (8 // bits) + fb  # 2 b + a
                        c = g + 8 * (fld % 2) + 16 * warp + 64 * (fld // 2)
                        x = _e4m3_fields(gathered, fb, bits, scaled)
                        shift = 2 * ((c // 8) % 2) if scaled else 0
                        for j in range(4):
                            want = int(codes[tok[j], c]) << shift
                            assert (x >> (8 * j)) & 0xFF == want, ("value", warp, lane, c, tok[j])
    # every channel once: the K columns are a permutation of the channels
    assert sorted(key_channel(k, bits) for k in range(hd)) == list(range(hd))


@pytest.fixture(autouse=True)
def _forced_tile_pages(monkeypatch):
    if TILE_PAGES:
        chosen = gluon_backend.gluon_decode_config

        def forced(key_axis="token", tile_pages=None):
            return chosen(key_axis, TILE_PAGES)

        monkeypatch.setattr(gluon_backend, "gluon_decode_config", forced)


def run(q, cache, batch, backend="gluon", plan=None, **kw):
    """Decode into NaN-poisoned outputs, so that any unwritten element fails the check
    (``plan``: a DecodePlan of ``batch`` to run instead of decode_attention's own)."""
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
    if plan is not None:
        o, lse = plan.run(q, return_lse=True, out=out, lse=lse)
    else:
        o, lse = decode_attention(
            q, cache, batch, backend=backend, return_lse=True, out=out, lse=lse, **kw
        )
    assert o.data_ptr() == out.data_ptr()
    return o, lse


def poisoned_plan(q, cache, batch, splits):
    """A Gluon plan of ``splits`` splits whose split workspace (allocated when the plan is made)
    is filled with NaN, so that a call that reads a partial it did not write fails the check."""
    plan = gluon_backend.GluonDecodePlan(cache, batch, q.shape[1], 128**-0.5, splits=splits)
    assert plan.workspace.tensors()
    for o_part, lse_part in plan.workspace.tensors():
        o_part.fill_(math.nan)
        lse_part.fill_(math.nan)
    return plan


def run_launcher(q, cache, batch, return_lse=True, plan=None, **kw):
    """A Gluon plan's run (explicit configs, splits, operands; ``plan``: one made already) into
    NaN-poisoned outputs, at sm_scale 128^-0.5: (out, lse); lse stays NaN unless
    ``return_lse``."""
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
    if plan is None:
        plan = gluon_backend.GluonDecodePlan(cache, batch, q.shape[1], 128**-0.5, **kw)
    plan.run(q, out=out, lse=lse, return_lse=return_lse)
    return out, lse


@sm90_only
@pytest.mark.parametrize("v_axis", V_AXES)
@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 5, 8])
def test_odd_lengths_every_gqa_ratio(ratio, k_bits, v_bits, v_axis):
    fmt = KVFormat(QuantFormat(k_bits, "token", 128), QuantFormat(v_bits, v_axis, 128))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda", seed=ratio)
    q = queries(batch, 2 * ratio, 128, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("v_axis", V_AXES)
@pytest.mark.parametrize(
    "ratio,k_bits,v_bits", [(r, 2, 2) for r in (1, 2, 3, 5, 8)] + [(4, *b) for b in BIT_PAIRS]
)
def test_channel_wise_keys(ratio, k_bits, v_bits, v_axis):
    """Channel-wise K (groups of 128 tokens): every GQA ratio at INT2, every bit pair at 4."""
    fmt = KVFormat(QuantFormat(k_bits, "channel", 128), QuantFormat(v_bits, v_axis, 128))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda", seed=ratio)
    q = queries(batch, 2 * ratio, 128, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("backend", ["gluon", "triton"])
@pytest.mark.parametrize("k_axis", ["token", "channel"])
def test_bound_launches_replay_what_the_jit_launches(backend, k_axis):
    """Note [bound launches]: a plan's second call replays the first call's launches with its
    own query and outputs, bit for bit what a fresh plan's JIT launches give; a query of other
    strides takes the JIT again, as right."""
    fmt = KVFormat(QuantFormat(2, k_axis, 128), INT2)
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda")
    plan = DecodePlan(cache, batch, num_q_heads=8, backend=backend)
    for _ in range(2):  # the first call marks the plan's key, the second records it
        run(queries(batch, 8, 128, "cuda", seed=1), cache, batch, plan=plan)
    assert [r for r in plan.backend_plan.bound.values() if r is not None]  # bound
    q = queries(batch, 8, 128, "cuda", seed=2)
    replayed = run(q, cache, batch, plan=plan)
    fresh = run(q, cache, cache.plan(batch.seq_ids), backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(replayed, fresh))
    check_against_reference(*replayed, q, cache, batch)
    wide = torch.zeros(q.shape[0], q.shape[1], 256, dtype=q.dtype, device=q.device)
    strided = wide[:, :, :128]  # other strides: the JIT specializes again
    strided.copy_(q)
    again = run(strided, cache, batch, plan=plan)
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))


@sm90_only
@pytest.mark.parametrize("v_axis", V_AXES)
def test_channel_wise_keys_repeat_bit_for_bit(v_axis):
    """Channel-wise K at its default, 2 CTAs per SM with two-page tiles: 33 splits of one 32K
    sequence over 8 KV heads (two CTAs share an SM), every call the same bits. One-page tiles,
    which release their ring stage before the tile's products, gave different partials in 19 of
    20 calls on an H100 (`bash benchmarks/run_device.sh repeat`)."""
    fmt = KVFormat(QuantFormat(2, "channel", 128), QuantFormat(2, v_axis, 128))
    cache, batch = build_cache(fmt, (32768,), num_kv_heads=8, device="cuda", decode_steps=0)
    q = queries(batch, 32, 128, "cuda")
    cfg = gluon_decode_config("channel")
    assert configs.gluon_num_splits(1, 8, 32768, cfg, 132) == 33
    first, _ = run_launcher(q, cache, batch, return_lse=False, splits=33)
    for _ in range(9):
        out, _ = run_launcher(q, cache, batch, return_lse=False, splits=33)
        assert torch.equal(out, first)
    check_against_reference(first, None, q, cache, batch)


@sm90_only
@pytest.mark.parametrize(
    "ratio,k_bits,v_bits", [(r, 2, 2) for r in (1, 2, 3, 5, 8)] + [(4, *b) for b in BIT_PAIRS]
)
def test_head_dim_64(ratio, k_bits, v_bits):
    """head_dim 64 (g = 64, token-wise K and V): every GQA ratio at INT2, every bit pair at 4;
    the INT2 value pieces are nibbles, two to a byte."""
    fmt = KVFormat(QuantFormat(k_bits, "token", 64), QuantFormat(v_bits, "token", 64))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, head_dim=64, device="cuda", seed=ratio)
    q = queries(batch, 2 * ratio, 64, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("bits", [2, 4])
def test_head_dim_64_model_shape_with_windows(bits):
    """SmolLM2-135M's attention (9 query heads over 3 KV heads, head_dim 64) at 8K tokens with
    64/256 BF16 windows, and a CUDA-graph replay of it."""
    q_fmt = QuantFormat(bits, "token", 64)
    fmt = KVFormat(q_fmt, q_fmt, sink_tokens=64, recent_tokens=256)
    cache, batch = build_cache(fmt, (8192, 1000, 3), num_kv_heads=3, head_dim=64, device="cuda")
    q = queries(batch, 9, 64, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    kw = dict(backend="gluon", out=out, lse=lse, return_lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, cache, batch, **kw)
    q.copy_(queries(batch, 9, 64, "cuda", seed=5))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(out, lse, q, cache, batch)


@sm90_only
@pytest.mark.parametrize("sink,recent", [(4, 0), (0, 37), (64, 256)])
@pytest.mark.parametrize("v_axis", V_AXES)
def test_bf16_windows(sink, recent, v_axis):
    v = QuantFormat(2, v_axis, 128, clip=0.92)
    fmt = KVFormat(INT2, v, sink_tokens=sink, recent_tokens=recent)
    cache, batch = build_cache(fmt, (2, 90, 800, 5000), device="cuda")
    q = queries(batch, 8, 128, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_split_counts_and_poisoned_workspace(splits):
    """More splits than pages leaves empty splits (lse -inf), which the merge must drop."""
    cache, batch = build_cache(FMT, (1, 700, 4097), device="cuda")
    q = queries(batch, 8, 128, "cuda")
    o, lse = poisoned_plan(q, cache, batch, splits).run(q, return_lse=True)
    check_against_reference(o, lse, q, cache, batch)


@sm90_only
@pytest.mark.parametrize("return_lse", [True, False])
def test_one_split_writes_the_output(return_lse):
    """A launch of one split without windows writes the output itself (no partial, no merge
    launch): it must not read the (NaN-poisoned) workspace, and it agrees with two splits
    merged by the Triton merge and with the reference."""
    cache, batch = build_cache(KVFormat(INT2, INT4), (1, 700, 4097), device="cuda")
    q = queries(batch, 8, 128, "cuda")
    res = {}
    for splits in (2, 1):
        plan = poisoned_plan(q, cache, batch, splits)
        out, lse = run_launcher(q, cache, batch, return_lse, plan=plan)
        check_against_reference(out, lse if return_lse else None, q, cache, batch)
        if not return_lse:
            assert bool(lse.isnan().all())  # not asked for, not written
        res[splits] = out
    assert rel_l2(res[1], res[2]) < 5e-3


@sm90_only
@pytest.mark.parametrize("k_axis,v_axis", AXIS_PAIRS)
def test_reconstruct_ablation(k_axis, v_axis):
    """backend="gluon-reconstruct": s' y + z' on every operand value instead of the folds."""
    k = QuantFormat(2, k_axis, 128)
    fmt = KVFormat(k, QuantFormat(4, v_axis, 128), sink_tokens=3)
    cache, batch = build_cache(fmt, LENGTHS, device="cuda")
    q = queries(batch, 8, 128, "cuda")
    check_against_reference(*run(q, cache, batch, backend="gluon-reconstruct"), q, cache, batch)


@sm90_only
def test_one_token_returns_its_value_row():
    from foscar.reference import dequantize_sequence

    cache, batch = build_cache(FMT, (1, 1), decode_steps=0, device="cuda")
    q = queries(batch, 8, 128, "cuda")
    o, _ = run(q, cache, batch)
    for i in range(2):
        _, v = dequantize_sequence(cache, batch, i, torch.float64)
        assert rel_l2(o[i], v[:, 0].repeat_interleave(4, dim=0)) < 2**-8


@sm90_only
def test_agrees_with_the_triton_backend():
    cache, batch = build_cache(FMT, (4096, 33, 9000), num_kv_heads=8, device="cuda")
    q = queries(batch, 32, 128, "cuda")
    o_gluon, lse_gluon = run(q, cache, batch)
    o_triton, lse_triton = decode_attention(q, cache, batch, backend="triton", return_lse=True)
    assert rel_l2(o_gluon, o_triton) < 5e-3
    assert float((lse_gluon - lse_triton).abs().max()) < 1e-2


@sm90_only
def test_auto_picks_gluon_on_hopper():
    from foscar.decode import default_backend

    cache, batch = build_cache(FMT, (100,), device="cuda")
    q = queries(batch, 8, 128, "cuda")
    assert default_backend(cache, q) == "gluon"
    assert (
        default_backend(build_cache(KVFormat(INT4, INT4), (100,), device="cuda")[0], q) == "gluon"
    )
    cache_c, _ = build_cache(KVFormat(QuantFormat(4, "channel", 64), INT2), (100,), device="cuda")
    assert default_backend(cache_c, q) == "triton"  # g = 64: not in the Gluon kernel
    # channel-wise K: covered, but Triton measured faster (configs.GLUON_OVER_TRITON_US)
    chan_k = KVFormat(QuantFormat(2, "channel", 128), INT2)
    assert default_backend(build_cache(chan_k, (100,), device="cuda")[0], q) == "triton"
    chan_v = KVFormat(INT2, QuantFormat(2, "channel", 128))
    small, small_batch = build_cache(chan_v, (100,), num_kv_heads=2, device="cuda")
    assert default_backend(small, queries(small_batch, 8, 128, "cuda")) == "gluon"


@sm90_only
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize(
    "k_axis,v_axis,k_bits,v_bits",
    [(*axes, 2, 2) for axes in AXIS_PAIRS]
    + [("token", "token", 2, 4), ("channel", "channel", 4, 2)],
)
def test_scaled_extraction(k_axis, v_axis, k_bits, v_bits, scaled):
    """GluonFlag.SCALED_INT2 (INT2 operands from 2 shifts per 8 K pairs and 1 per 4 V pairs,
    powers of 4 folded back into Q, the offsets and the output) on and off (the default has it
    on): the same bar over odd lengths and 32K."""
    fmt = KVFormat(QuantFormat(k_bits, k_axis, 128), QuantFormat(v_bits, v_axis, 128))
    cache, batch = build_cache(fmt, LENGTHS + (32768,), num_kv_heads=8, device="cuda", seed=k_bits)
    q = queries(batch, 32, 128, "cuda")
    cfg = gluon_backend.gluon_decode_config(k_axis)
    flags = cfg.flags | GluonFlag.SCALED_INT2 if scaled else cfg.flags & ~GluonFlag.SCALED_INT2
    cfg = dataclasses.replace(cfg, flags=flags)
    check_against_reference(*run_launcher(q, cache, batch, config=cfg), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
def test_e4m3_operands_odd_lengths(ratio, k_bits, v_bits):
    """backend "gluon-e4m3" (FP8 wgmma operands): odd lengths, GQA ratios, every bit pair,
    against fp64 at E4M3's bar (kernel_cases.check_e4m3_against_reference)."""
    fmt = KVFormat(QuantFormat(k_bits, "token", 128), QuantFormat(v_bits, "token", 128))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda", seed=ratio)
    q = queries(batch, 2 * ratio, 128, "cuda")
    check_e4m3_against_reference(*run(q, cache, batch, backend="gluon-e4m3"), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("ratio", [4, 8])
def test_e4m3_operands_three_ctas_per_sm(ratio):
    """The 3-CTA INT2 config (configs.gluon_e4m3_config), forced over odd lengths, then chosen
    by ``decode`` itself for a launch of 32K tiles (8 x 32K tokens, 8 KV heads) with 8 query
    heads per KV head (with 4, packed heads take that launch)."""
    cfg = configs.gluon_e4m3_config(2, 2, configs.E4M3_THREE_CTAS_MIN_TILES, heads_per_kv=8)
    cache, batch = build_cache(FMT, LENGTHS, num_kv_heads=2, device="cuda", seed=ratio)
    q = queries(batch, 2 * ratio, 128, "cuda")
    o, lse = run(q, cache, batch, backend="gluon-e4m3")  # 2 CTAs per SM here (few tiles)
    check_e4m3_against_reference(o, lse, q, cache, batch)
    out, lse3 = run_launcher(q, cache, batch, config=cfg, operands="e4m3")
    check_e4m3_against_reference(out, lse3, q, cache, batch)
    assert rel_l2(out, o) < 1e-2  # the same arithmetic over other splits
    if ratio == 8:  # (4 query heads per KV head take packed heads there)
        cache, batch = build_cache(FMT, (32768,) * 8, num_kv_heads=8, device="cuda", seed=5)
        assert gluon_backend.default_config(cache, batch, "e4m3", 8).ctas_per_sm == 3
        q = queries(batch, 64, 128, "cuda")
        check_e4m3_against_reference(*run(q, cache, batch, backend="gluon-e4m3"), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
@pytest.mark.parametrize("page_size", [16, 32])
def test_page_sizes(page_size, k_bits, v_bits):
    """A cache of 16 or 32-token pages (token-wise K and V): odd lengths (a last tile over part
    of a page, pages past the history), GQA 1, 3, 4 and 8, bf16 and E4M3 operands, one-page
    and packed-heads configs, 1 and 7 splits, against fp64 at each path's bar (all 8 passed on
    the H200, with 128 at INT2, a case since dropped with page 128)."""
    fmt = KVFormat(QuantFormat(k_bits, "token", 128), QuantFormat(v_bits, "token", 128))
    for ratio in (1, 3, 4, 8):
        cache, batch = build_cache(
            fmt, LENGTHS, num_kv_heads=2, page_size=page_size, device="cuda", seed=ratio
        )
        q = queries(batch, 2 * ratio, 128, "cuda")
        out, lse = run(q, cache, batch)
        check_against_reference(out, lse, q, cache, batch)
        check_e4m3_against_reference(*run(q, cache, batch, backend="gluon-e4m3"), q, cache, batch)
        for splits in (1, 7):
            o, _ = run_launcher(q, cache, batch, splits=splits)
            check_against_reference(o, None, q, cache, batch)
        if ratio <= 4:
            for operands in ("bf16", "e4m3"):
                cfg = configs.gluon_packed_config(k_bits, v_bits)
                o, lse_p = run_launcher(q, cache, batch, config=cfg, operands=operands)
                check = (
                    check_e4m3_against_reference if operands == "e4m3" else check_against_reference
                )
                check(o, lse_p, q, cache, batch)


@sm90_only
@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_e4m3_packed_heads(ratio, k_bits, v_bits):
    """Packed heads (two pages' scores in one tile) over odd lengths (a last tile whose page b
    lies past the history, or partly), every GQA ratio it covers, every bit pair: against fp64
    at E4M3's bar, and against the one-page E4M3 kernel (the same arithmetic per value, other
    summation order)."""
    fmt = KVFormat(QuantFormat(k_bits, "token", 128), QuantFormat(v_bits, "token", 128))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda", seed=ratio)
    q = queries(batch, 2 * ratio, 128, "cuda")
    cfg = configs.gluon_packed_config(k_bits, v_bits)
    out, lse = run_launcher(q, cache, batch, config=cfg, operands="e4m3")
    check_e4m3_against_reference(out, lse, q, cache, batch)
    one, lse1 = run_launcher(q, cache, batch, operands="e4m3")
    assert rel_l2(out, one) < 1e-2
    assert torch.allclose(lse, lse1, atol=1e-2, rtol=0)
    for splits in (1, 7):  # one split writes the output itself; 7 split the 4099 tokens oddly
        o, _ = run_launcher(q, cache, batch, config=cfg, operands="e4m3", splits=splits)
        check_e4m3_against_reference(o, None, q, cache, batch)


@sm90_only
def test_e4m3_packed_heads_paper_shape_repeats():
    """Packed heads at the paper shape with BF16 windows: within E4M3's bar, the same bits on a
    second call; more than 4 query heads per KV head is refused."""
    fmt = KVFormat(INT2, INT2, sink_tokens=64, recent_tokens=256)
    cache, batch = build_cache(fmt, (32768, 4099, 1), num_kv_heads=8, device="cuda", seed=3)
    q = queries(batch, 32, 128, "cuda")
    cfg = configs.gluon_packed_config(2, 2)
    outs = []
    for _ in range(2):
        o, lse = run_launcher(q, cache, batch, config=cfg, operands="e4m3")
        check_e4m3_against_reference(o, lse, q, cache, batch)
        outs.append(o.clone())
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="at most 4 query heads per KV head"):
        run_launcher(queries(batch, 64, 128, "cuda"), cache, batch, config=cfg, operands="e4m3")


@sm90_only
@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS)
@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_packed_heads_bf16(ratio, k_bits, v_bits):
    """Packed heads with bf16 operands over odd lengths, every GQA ratio they cover and every
    bit pair: at bf16's bar against fp64, at 1 split and 7 as well."""
    fmt = KVFormat(QuantFormat(k_bits, "token", 128), QuantFormat(v_bits, "token", 128))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda", seed=ratio)
    q = queries(batch, 2 * ratio, 128, "cuda")
    cfg = configs.gluon_packed_config(k_bits, v_bits)
    for splits in (None, 1, 7):
        out, lse = run_launcher(q, cache, batch, config=cfg, splits=splits)
        check_against_reference(out, lse, q, cache, batch)


@sm90_only
def test_packed_heads_bf16_chosen_by_decode():
    """backend "gluon" takes packed heads by itself for INT2 from configs.BF16_PACKED_MIN_TILES
    on (2 x 32K tokens x 8 KV heads = 8K tiles) and stays within bf16's bar."""
    cache, batch = build_cache(FMT, (32768, 32769), num_kv_heads=8, device="cuda", seed=8)
    assert gluon_backend.default_config(cache, batch, "bf16", 4).flags & GluonFlag.PACKED_HEADS
    q = queries(batch, 32, 128, "cuda")
    check_against_reference(*run(q, cache, batch, backend="gluon"), q, cache, batch)


@sm90_only
def test_e4m3_packed_heads_chosen_by_decode():
    """backend "gluon-e4m3" takes packed heads by itself from configs.E4M3_PACKED_MIN_TILES on
    (2 x 32K tokens x 8 KV heads = 8K INT2 tiles) and stays within E4M3's bar."""
    cache, batch = build_cache(FMT, (32768, 32769), num_kv_heads=8, device="cuda", seed=7)
    assert gluon_backend.default_config(cache, batch, "e4m3", 4).flags & GluonFlag.PACKED_HEADS
    q = queries(batch, 32, 128, "cuda")
    check_e4m3_against_reference(*run(q, cache, batch, backend="gluon-e4m3"), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("bits", [2, 4])
def test_e4m3_operands_value_rows_with_large_offsets(bits):
    """V rows whose offset is 20x their spread (z/s up to ~30 against codes <= 15): the offset
    term must not inherit P's E4M3 rounding (it takes the fp32 P s'_V; with the rounded one a
    heavily attended near-constant row lost its whole P z)."""
    fmt = KVFormat(QuantFormat(bits, "token", 128), QuantFormat(bits, "token", 128))
    cache, batch = build_cache(fmt, LENGTHS, num_kv_heads=2, device="cuda", v_offset=20.0)
    q = queries(batch, 8, 128, "cuda")
    err, bar = check_e4m3_against_reference(
        *run(q, cache, batch, backend="gluon-e4m3"), q, cache, batch
    )
    assert err <= 1e-2  # with the rounded P in the offset term such rows reached ~0.35


@sm90_only
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("bits", [2, 4])
def test_e4m3_operands_paper_shape_and_windows(bits, scaled):
    """E4M3 operands at the paper shape (32K tokens, 32/8 heads) with BF16 windows, the scaled
    INT2 extraction on and off, and a repeat call that must give the same bits."""
    fmt = KVFormat(
        QuantFormat(bits, "token", 128),
        QuantFormat(bits, "token", 128),
        sink_tokens=64,
        recent_tokens=256,
    )
    cache, batch = build_cache(fmt, (32768, 4099, 1), num_kv_heads=8, device="cuda", seed=bits)
    q = queries(batch, 32, 128, "cuda")
    cfg = gluon_backend.gluon_decode_config("token")
    flags = cfg.flags | GluonFlag.SCALED_INT2 if scaled else cfg.flags & ~GluonFlag.SCALED_INT2
    cfg = dataclasses.replace(cfg, flags=flags)
    outs = []
    for _ in range(2):
        o, lse = run_launcher(q, cache, batch, config=cfg, operands="e4m3")
        check_e4m3_against_reference(o, lse, q, cache, batch)
        outs.append(o.clone())
    assert torch.equal(outs[0], outs[1])


@sm90_only
@pytest.mark.parametrize("packed", [False, True])
def test_e4m3_operands_cuda_graph_replay(packed):
    """backend "gluon-e4m3" (its default config, one page per tile here) and packed heads
    (configs.gluon_packed_config) captured in a CUDA graph and replayed with new queries into a
    NaN-poisoned output (the split workspace and the descriptors are reused)."""
    cache, batch = build_cache(FMT, (3000, 17, 9000), num_kv_heads=8, device="cuda")
    q = queries(batch, 32, 128, "cuda")
    out = torch.empty_like(q)

    def call():
        if packed:
            cfg = configs.gluon_packed_config(2, 2)
            gluon_backend.decode(q, cache, batch, 128**-0.5, out=out, config=cfg, operands="e4m3")
        else:
            decode_attention(q, cache, batch, backend="gluon-e4m3", out=out)

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in range(2):
        q.copy_(queries(batch, 32, 128, "cuda", seed=20 + seed))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        check_e4m3_against_reference(out, None, q, cache, batch)


@sm90_only
@pytest.mark.parametrize("k_axis,v_axis", AXIS_PAIRS)
@pytest.mark.parametrize("bits", [2, 4])
def test_paper_shape(bits, k_axis, v_axis):
    """H_Q=32, H_KV=8, D=128, page 64, g=128, 32K tokens, zero-mean data (channel-wise K once
    missed the bar here by putting a +128 offset's cancellation on the tensor core)."""
    fmt = KVFormat(QuantFormat(bits, k_axis, 128), QuantFormat(bits, v_axis, 128))
    cache, batch = build_cache(fmt, (32768, 4099), num_kv_heads=8, device="cuda", seed=bits)
    q = queries(batch, 32, 128, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20000, (16,), generator=g).tolist()
    k_chan = QuantFormat(2, "channel", 128)
    k, v = [(INT2, INT2), (INT4, QuantFormat(2, "channel", 128)), (INT2, INT4), (k_chan, INT4)][
        seed
    ]
    fmt = KVFormat(k, v, sink_tokens=64 * (seed % 2), recent_tokens=256 * (seed % 2))
    cache, batch = build_cache(fmt, lengths, num_kv_heads=8, device="cuda", seed=seed)
    q = queries(batch, 32, 128, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@sm90_only
@pytest.mark.parametrize("v_axis", V_AXES)
@pytest.mark.parametrize("windows", [False, True])
def test_cuda_graph_replay(windows, v_axis):
    """Capture once, replay with new queries: no host sync, no allocation in the hot path."""
    v = QuantFormat(2, v_axis, 128)
    fmt = KVFormat(INT2, v, sink_tokens=16 * windows, recent_tokens=64 * windows)
    cache, batch = build_cache(fmt, (3000, 17, 9000), num_kv_heads=8, device="cuda")
    q = queries(batch, 32, 128, "cuda")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    kw = dict(backend="gluon", out=out, lse=lse, return_lse=True)
    decode_attention(q, cache, batch, **kw)  # compile, descriptors, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, cache, batch, **kw)
    for seed in range(3):
        q.copy_(queries(batch, 32, 128, "cuda", seed=10 + seed))
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(out, lse, q, cache, batch)


def test_auto_rule_is_read_off_the_measured_table(monkeypatch):
    """``auto`` takes Gluon where the H200 table says it won: from the smallest batch at which it
    won every point (x H_KV = 8; 0 if it won them all), never for a shape without rows."""
    from foscar import configs

    assert configs.gluon_min_ctas("token", "token") == 0
    assert configs.gluon_min_ctas("token", "channel") == 0
    assert configs.gluon_min_ctas("token", "token", 64) == 0
    assert configs.gluon_min_ctas("channel", "token") == 64  # Triton won at B = 1
    assert configs.gluon_min_ctas("channel", "channel") == 64
    assert configs.gluon_min_ctas("token", "token", 256) is None  # not measured
    table = {
        (2, "channel", "token", 128, 1, 32768): (30.0, 40.0),  # lost at B=1
        (2, "channel", "token", 128, 8, 32768): (150.0, 90.0),
        (2, "channel", "token", 128, 64, 32768): (900.0, 600.0),
        (2, "channel", "channel", 128, 1, 32768): (30.0, 20.0),
        (2, "channel", "channel", 128, 64, 32768): (900.0, 950.0),  # lost at the largest batch
        (4, "token", "token", 64, 1, 8192): (20.0, 10.0),
    }
    monkeypatch.setattr(configs, "GLUON_OVER_TRITON_US", table)
    assert configs.gluon_min_ctas("channel", "token") == 64
    assert configs.gluon_min_ctas("channel", "channel") is None
    assert configs.gluon_min_ctas("channel", "channel", bits=(2,)) is None  # the INT2 rows only
    assert configs.gluon_min_ctas("token", "token", 64) == 0
    # default_backend's comparison: sequences x KV heads against the threshold
    assert not configs.auto_takes_gluon("channel", "token", 128, (2,), 63)
    assert configs.auto_takes_gluon("channel", "token", 128, (2,), 64)
    assert not configs.auto_takes_gluon("channel", "channel", 128, (2, 4), 10**6)


def test_auto_takes_gluon_at_other_page_sizes_where_measured(monkeypatch):
    """At a page size other than 64, auto takes Gluon only where GLUON_OVER_TRITON_PAGE_US has
    rows of that page size (and the format's bit widths) and Gluon won every one."""
    table = {
        (2, 16, 1, 32768): (30.0, 20.0),
        (2, 16, 64, 16384): (500.0, 300.0),
        (4, 16, 1, 32768): (30.0, 35.0),  # lost
        (2, 128, 1, 32768): (30.0, 20.0),
    }
    monkeypatch.setattr(configs, "GLUON_OVER_TRITON_PAGE_US", table)
    assert configs.auto_takes_gluon("token", "token", 128, (2,), 8, page_size=16)
    assert not configs.auto_takes_gluon("token", "token", 128, (4,), 8, page_size=16)
    assert not configs.auto_takes_gluon("token", "token", 128, (2, 4), 8, page_size=16)
    assert configs.auto_takes_gluon("token", "token", 128, (2,), 8, page_size=128)
    assert not configs.auto_takes_gluon("token", "token", 128, (4,), 8, page_size=128)  # no rows
    assert not configs.auto_takes_gluon("token", "token", 128, (2,), 8, page_size=32)
    assert not configs.auto_takes_gluon("token", "token", 64, (2,), 8, page_size=16)
    assert not configs.auto_takes_gluon("token", "channel", 128, (2,), 8, page_size=16)
    assert configs.auto_takes_gluon("token", "token", 128, (2,), 8)  # page 64: the main table
