# ruff: noqa: E401, E402, E501, E701, E702, E741
"""Registers touched while a wgmma (HGMMA/QGMMA) may still be in flight: a write of an A-fragment
or accumulator register, or a read of an accumulator register, between the HGMMA and the
WARPGROUP.DEPBAR.LE gsb0, N that retires it (N = groups left outstanding), over the CFG.
    python wgmma_inflight.py K.sass K.lines"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_uninit import build_cfg, parse, parse_lines, partitions

ins = parse(open(sys.argv[1]).read())
al, labels, brx = parse_lines(open(sys.argv[2]).read()) if len(sys.argv) > 2 else ({}, {}, {})
blocks, block_of, succ, brx_assumed = build_cfg(ins, brx)
label, _ = partitions(ins, blocks, block_of, succ, brx_assumed)


def gm(x):
    return x.op in ("HGMMA", "QGMMA", "IGMMA", "BGMMA")


def transfer(stacks, b, report=None):
    out = set()
    for st in stacks:  # st: (committed groups tuple, open group or None)
        groups, open_ = st
        for i in blocks[b]:
            x = ins[i]
            if gm(x):
                acc = frozenset(x.writes)
                a = frozenset(r for r in x.reads if r not in acc)
                cur = open_ or (frozenset(), frozenset(), ())
                open_ = (cur[0] | a, cur[1] | acc, cur[2] + (x.addr,))
                if "gsb0" in x.ops:
                    groups = groups + (open_,)
                    open_ = None
                continue
            if x.op == "WARPGROUP" and "DEPBAR" in x.mods:
                n = int(x.ops[-1], 16) if x.ops[-1].startswith("0x") else int(x.ops[-1])
                groups = groups[len(groups) - n :] if n else ()
                continue
            if report is not None:
                live = list(groups) + ([open_] if open_ else [])
                for g in live:
                    bad_w = [r for r in x.writes if r in g[0] or r in g[1]]
                    bad_r = [r for r in x.reads if r in g[1]]
                    if bad_w or bad_r:
                        report.add((i, tuple(bad_w), tuple(bad_r), g[2]))
        out.add((groups, open_))
    return frozenset(out)


preds = collections.defaultdict(set)
for b, ss in succ.items():
    for s in ss:
        preds[s].add(b)
IN = [frozenset() for _ in blocks]
OUT = [frozenset() for _ in blocks]
IN[0] = frozenset({((), None)})
work = collections.deque(range(len(blocks)))
while work:
    b = work.popleft()
    new_in = IN[b] | frozenset().union(*[OUT[p] for p in preds[b]]) if preds[b] else IN[b]
    IN[b] = new_in
    o = transfer(IN[b], b)
    if o != OUT[b]:
        OUT[b] = o
        work.extend(succ.get(b, ()))
rep = set()
for b in range(len(blocks)):
    transfer(IN[b], b, rep)
print(f"# {sys.argv[1]}: {sum(gm(x) for x in ins)} wgmma; hazards: {len(rep)}")
for i, w, r, g in sorted(rep):
    x = ins[i]
    print(
        f"{x.addr:#06x} [{'+'.join(sorted(label.get(block_of[i], {'?'})))}; line {al.get(x.addr)}] {x.text}  "
        f"writes-in-flight {w} reads-acc-in-flight {r}; wgmma at {[hex(a) for a in g]}"
    )
