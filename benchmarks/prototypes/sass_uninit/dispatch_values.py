# ruff: noqa: E401, E402, E501, E701, E702, E741
"""Reads, inside the warp-specialize partitions, of registers whose value may (on some path)
still be the one written by the pre-dispatch code (blocks up to the BRX): a may-analysis.
    python dispatch_values.py K.sass K.lines"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_uninit import build_cfg, parse, parse_lines, partitions

ins = parse(open(sys.argv[1]).read())
al, labels, brx = parse_lines(open(sys.argv[2]).read())
blocks, block_of, succ, brx_assumed = build_cfg(ins, brx)
label, _ = partitions(ins, blocks, block_of, succ, brx_assumed)
bx = next(x for x in ins if x.op == "BRX")
disp = set(range(block_of[bx.idx] + 1))
preds = collections.defaultdict(set)
for b, ss in succ.items():
    for s in ss:
        preds[s].add(b)
IN = [frozenset()] * len(blocks)
OUT = [None] * len(blocks)


def transfer(t, b, rep=None):
    t = {r: set(v) for r, v in t}
    for i in blocks[b]:
        x = ins[i]
        if rep is not None and b not in disp:
            for r in x.reads:
                if r in t:
                    rep.add((i, r, tuple(sorted(t[r]))))
        for r in x.writes:
            if b in disp:
                if x.guard is None:
                    t[r] = {x.addr}
                else:
                    t.setdefault(r, set()).add(x.addr)
            elif x.guard is None:
                t.pop(r, None)
    return frozenset((r, frozenset(v)) for r, v in t.items())


def merge(states):
    d = collections.defaultdict(set)
    for s in states:
        if s is None:
            continue
        for r, v in s:
            d[r] |= v
    return frozenset((r, frozenset(v)) for r, v in d.items())


work = collections.deque(range(len(blocks)))
while work:
    b = work.popleft()
    IN[b] = merge([OUT[p] for p in preds[b]]) if b else frozenset()
    o = transfer(IN[b], b)
    if o != OUT[b]:
        OUT[b] = o
        work.extend(succ.get(b, ()))
rep = set()
for b in range(len(blocks)):
    transfer(IN[b], b, rep)
byreg = collections.defaultdict(list)
for i, r, defs in sorted(rep):
    byreg[(r, defs)].append(i)
print(f"# {sys.argv[1]}: reads in partitions of pre-dispatch values")
for (r, defs), idxs in sorted(byreg.items()):
    parts = sorted({p for i in idxs for p in label.get(block_of[i], {"?"})})
    print(
        f"R{r} (defined pre-dispatch at {[hex(a) for a in defs]}: "
        f"{'; '.join(ins[next(x.idx for x in ins if x.addr == a)].text for a in defs)}): "
        f"{len(idxs)} reads in {parts}, first {ins[idxs[0]].addr:#06x} {ins[idxs[0]].text}"
    )
