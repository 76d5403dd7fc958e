# ruff: noqa: E401, E402, E501, E701, E702, E741
"""CFG-aware "maybe-uninitialized general-register read" analysis for sm_90a SASS
(`cuobjdump -sass` text), with optional `nvdisasm --print-line-info -c` text of the same cubin
for BRX targets (its BRANCH_TARGETS annotations) and source lines.

    python sass_uninit.py K.sass [--lines K.lines] [--ctx 5] [--no-pred-facts] [--brx-conservative]

Dataflow: forward must-defined analysis over basic blocks; a register is defined at a point when
every path from the kernel entry writes it (unpredicated), or -- refinement, off with
--no-pred-facts -- when every path writes it under a guard @P / @!P and the read is under the
same guard with P not rewritten since (or both senses were written).
Reports each instruction that reads an R register (not RZ) that is not must-defined there.
"""

from __future__ import annotations

import argparse
import collections
import re

INS_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
GUARD_RE = re.compile(r"^@(!?)(U?P(?:T|\d+))\s+")
REG_RE = re.compile(r"(?<![A-Za-z_])R(\d+|Z)(\.64)?")
PRED_RE = re.compile(r"^!?U?P(?:T|\d+)$")


def split_operands(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class Ins:
    __slots__ = (
        "addr",
        "text",
        "guard",
        "op",
        "mods",
        "ops",
        "reads",
        "writes",
        "pwrites",
        "idx",
        "line",
    )

    def __init__(self, addr, text):
        self.addr, self.text = addr, text
        self.guard = None
        m = GUARD_RE.match(text)
        if m:
            neg, p = m.group(1) == "!", m.group(2)
            if p not in ("PT", "UPT"):
                self.guard = (p, not neg)  # executes when p == (not neg)
            elif neg:
                self.guard = ("PT", False)  # never executes
            text = text[m.end() :]
        parts = text.split(None, 1)
        full = parts[0]
        self.op = full.split(".")[0]
        self.mods = full.split(".")[1:]
        self.ops = split_operands(parts[1]) if len(parts) > 1 else []
        self.reads, self.writes, self.pwrites = semantics(self)
        if TRACK_PREDS:
            pr, pw = pred_semantics(self)
            self.reads = self.reads + pr
            self.writes = self.writes + pw
        self.line = None


TRACK_PREDS = False


def pred_id(name):
    name = name.lstrip("!")
    if name.startswith("UP") and name[2:].isdigit():
        return 2000 + int(name[2:])
    if name.startswith("P") and name[1:].isdigit():
        return 1000 + int(name[1:])
    return None


def pred_semantics(ins):
    """(reads, writes) of predicates P0-P6 / UP0-UP6 as ids 1000+n / 2000+n (--preds)."""
    ops = ins.ops
    reads = []
    if ins.guard and pred_id(ins.guard[0]) is not None:
        reads.append(pred_id(ins.guard[0]))
    dest_pos = set()
    k = 0
    while k < len(ops) and PRED_RE.match(ops[k]) and k < 2:
        dest_pos.add(k)
        k += 1
        if ins.op not in (
            "ISETP",
            "FSETP",
            "DSETP",
            "HSETP2",
            "PSETP",
            "PLOP3",
            "UISETP",
            "UPLOP3",
        ):
            break
    if (
        ins.op in ("IADD3", "IMAD", "LEA", "LOP3", "UIADD3", "ULEA", "ULOP3")
        and "X" not in ins.mods
    ):
        for j in (1, 2):
            if j < len(ops) and pred_id(ops[j]) is not None:
                dest_pos.add(j)
    if ins.op == "USETMAXREG":
        dest_pos.add(0)
    if ins.op == "R2P":
        dest_pos = set()
    writes = [pred_id(ops[j]) for j in sorted(dest_pos) if pred_id(ops[j]) is not None]
    for j, o in enumerate(ops):
        if j not in dest_pos:
            for t in re.findall(r"!?U?P\d+", o):
                if re.fullmatch(r"!?U?P\d+", o.strip()) or "[" not in o:
                    p = pred_id(t)
                    if p is not None and not re.search(r"[A-Za-z_]" + re.escape(t.lstrip("!")), o):
                        reads.append(p)
    if ins.op == "R2P":
        writes = [1000 + n for n in range(7)]
    if ins.op == "P2R":
        reads = [1000 + n for n in range(7)]
    return reads, writes


def regs_in(operand, width=1):
    """General registers an operand reads; `width` consecutive registers for a plain register
    operand (pairs/quads of wide data); memory addresses R.64 are pairs."""
    out = []
    for m in REG_RE.finditer(operand):
        if m.group(1) == "Z":
            continue
        r = int(m.group(1))
        in_mem = "[" in operand[: m.start()]
        w = 2 if m.group(2) else (1 if in_mem else width)
        out.extend(range(r, r + w))
    return out


def plain_reg(operand):
    m = re.fullmatch(r"[-!~|]*R(\d+|Z)(\.\w+)*\|?", operand)
    if not m:
        return None
    return "RZ" if m.group(1) == "Z" else int(m.group(1))


def width_from_mods(mods):
    if "128" in mods:
        return 4
    if "64" in mods:
        return 2
    return 1


NO_DEST = {
    "ST",
    "STG",
    "STS",
    "STL",
    "STSM",
    "RED",
    "REDG",
    "REDS",
    "BAR",
    "BRA",
    "BRX",
    "JMP",
    "JMX",
    "EXIT",
    "RET",
    "CALL",
    "BSSY",
    "BSYNC",
    "BREAK",
    "WARPSYNC",
    "UTMALDG",
    "UTMASTG",
    "UTMAPF",
    "UTMACCTL",
    "UBLKCP",
    "FENCE",
    "MEMBAR",
    "NOP",
    "WARPGROUP",
    "PREEXIT",
    "DEPBAR",
    "ERRBAR",
    "CCTL",
    "YIELD",
    "USETMAXREG",
    "NANOSLEEP",
    "KILL",
    "BPT",
    "LDGSTS",
    "LDGDEPBAR",
    "ARRIVES",
    "CGAERRBAR",
    "ELECT",
}
PRED_DEST_ONLY = {
    "ISETP",
    "FSETP",
    "DSETP",
    "HSETP2",
    "PSETP",
    "PLOP3",
    "UISETP",
    "UPLOP3",
    "VOTEU",
    "FCHK",
    "R2P",
}
COND_WRITES_P = re.compile(r"^U?P\d+$")


def semantics(ins: Ins):
    """(reads, writes, predicate writes) of general registers R0..R255 (ints) and predicates."""
    op, mods, ops = ins.op, ins.mods, list(ins.ops)
    reads, writes, pwrites = [], [], []
    if ins.op.startswith("U") and ins.op not in (
        "UTMALDG",
        "UTMASTG",
        "UTMAPF",
        "UTMACCTL",
        "UBLKCP",
        "USETMAXREG",
    ):
        # uniform datapath: reads/writes UR only; collect its uniform predicate writes
        for o in ops:
            if COND_WRITES_P.match(o):
                pwrites.append(o)
                break
        return reads, writes, pwrites
    if not ops:
        return reads, writes, pwrites
    # leading predicate destinations (ISETP P0, PT, ... / SHFL PT, R / LOP3 P0, R / SYNCS P2, ...)
    dest_idx = 0
    while dest_idx < len(ops) and PRED_RE.match(ops[dest_idx]):
        if op not in ("R2P",) and not ops[dest_idx].startswith("!"):
            pwrites.append(ops[dest_idx])
        dest_idx += 1
        if (
            op not in ("ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "PLOP3", "VOTE")
            or dest_idx >= 2
        ):
            break
    if op in ("IADD3", "IMAD", "LEA", "LOP3", "UIADD3") and "X" not in mods:
        # IADD3 Rd, P0, P1, Ra, Rb, Rc: carry-out predicates after the destination
        for o in ops[1:3]:
            if COND_WRITES_P.match(o):
                pwrites.append(o)
    if op == "R2P":
        pwrites.extend([f"P{i}" for i in range(7)])
    if op in PRED_DEST_ONLY or op in NO_DEST or op == "SYNCS" and "PHASECHK" in mods:
        dest = None
        srcs = ops[dest_idx:]
        if op == "R2P":
            srcs = ops
    else:
        dest = ops[dest_idx] if dest_idx < len(ops) else None
        srcs = ops[dest_idx + 1 :]
        if op == "SYNCS":  # SYNCS.ARRIVE.TRANS64 Rd, [mem], Rb
            pass
    dreg = plain_reg(dest) if dest is not None else None

    # destination width
    dw = 1
    if op in (
        "LD",
        "LDG",
        "LDS",
        "LDL",
        "LDC",
        "ATOM",
        "ATOMG",
        "ATOMS",
        "SHFL",
        "MOV",
        "LDSM",
        "S2R",
        "CS2R",
        "F2F",
        "I2F",
        "F2I",
        "DADD",
        "DMUL",
        "DFMA",
        "SYNCS",
        "MATCH",
    ):
        dw = width_from_mods(mods)
    if op == "LDSM":
        n = [m for m in mods if m in ("1", "2", "4")]
        dw = int(n[-1]) if n else 1
    if op == "CS2R" and "32" not in mods:
        dw = 2
    if op == "IMAD" and "WIDE" in mods:
        dw = 2
    if op in ("DADD", "DMUL", "DFMA", "DMNMX"):
        dw = 2
    if op in ("F2F", "I2F") and "F64" in mods[:1]:
        dw = 2
    gmma = None
    if op in ("HGMMA", "QGMMA", "IGMMA", "BGMMA"):
        shape = re.match(r"(\d+)x(\d+)x(\d+)", mods[0])
        m_, n_, _k = map(int, shape.groups())
        acc32 = "F32" in mods or "S32" in mods
        dw = n_ // 2 if acc32 else n_ // 4
        gmma = dw
    if op == "HMMA":  # sm80-style HMMA.16816.F32: 4 acc regs (F16 acc 2)
        dw = 4 if "F32" in mods else 2
    if isinstance(dreg, int):
        writes.extend(range(dreg, dreg + dw))
    elif dest is not None and dreg is None:
        reads.extend(regs_in(dest))  # e.g. a store-like first operand inside brackets

    # sources
    for i, o in enumerate(srcs):
        w = 1
        if (
            op in ("ST", "STG", "STS", "STL", "ATOM", "ATOMG", "ATOMS", "RED", "REDG", "REDS")
            and "[" not in o
        ):
            w = width_from_mods(mods)
        if op == "STSM":
            n = [m for m in mods if m in ("1", "2", "4")]
            w = int(n[-1]) if n else 1
        if op == "IMAD" and "WIDE" in mods and i == 2:
            w = 2
        if op in ("BRX", "JMX", "RET") and i == 0:
            w = 2
        if op in ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX") or (
            op in ("F2F", "F2I") and "F64" in mods[1:]
        ):
            w = 2
        if gmma is not None:
            if i == 0:
                w = 4  # A fragment: 64x16 bf16 or 64x32 e4m3 per warpgroup = 4 regs / thread
            elif i == 2:
                w = gmma  # accumulator input (RZ = zero-initialised)
        if op == "HMMA":
            w = [4, 2, 4][i] if i < 3 else 1
        if op == "PRMT" and i == 2 and re.fullmatch(r"0x[0-9a-f]+", srcs[1]):
            sel = int(srcs[1], 16)
            if "B" not in "".join(mods) and not any(((sel >> (4 * j)) & 7) >= 4 for j in range(4)):
                continue  # selector takes no byte of Rc
        if op == "PRMT" and i == 0 and re.fullmatch(r"0x[0-9a-f]+", srcs[1]):
            sel = int(srcs[1], 16)
            if not mods and not any(((sel >> (4 * j)) & 7) < 4 for j in range(4)):
                continue
        if op == "LOP3" and i < 3 and len(srcs) >= 4 and re.fullmatch(r"0x[0-9a-f]+", srcs[3]):
            lut = int(srcs[3], 16)
            bit = 2 - i  # a = 0xF0 (index bit 2), b = 0xCC (bit 1), c = 0xAA (bit 0)
            if all(((lut >> j) & 1) == ((lut >> (j ^ (1 << bit))) & 1) for j in range(8)):
                continue  # the LUT does not depend on this operand
        reads.extend(regs_in(o, w))
    return reads, writes, pwrites


def parse(sass_text):
    ins = []
    for line in sass_text.splitlines():
        m = INS_RE.match(line)
        if m:
            ins.append(Ins(int(m.group(1), 16), m.group(2)))
    for i, x in enumerate(ins):
        x.idx = i
    return ins


def parse_lines(text):
    """nvdisasm --print-line-info -c output: addr -> (file, line); label -> addr; addr of BRX ->
    its BRANCH_TARGETS labels."""
    cur, addr_line, labels, brx, pending = None, {}, {}, {}, []
    for line in text.splitlines():
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            cur = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"^(\.L_\w+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            a = int(m.group(1), 16)
            addr_line[a] = cur
            for lab in pending:
                labels[lab] = a
            pending = []
            t = re.search(r'BRANCH_TARGETS ([^"]+)"', m.group(2))
            if t:
                brx[a] = [s.strip() for s in t.group(1).split(",")]
    return addr_line, labels, {a: [labels[l] for l in ls] for a, ls in brx.items()}


def build_cfg(ins, brx_targets=None, brx_conservative=False):
    by_addr = {x.addr: x.idx for x in ins}
    leaders = {0}
    branch = {}
    for x in ins:
        if x.op in ("BRA", "JMP", "CALL") and x.ops:
            t = x.ops[-1].strip("`() ")
            mm = re.search(r"0x[0-9a-f]+", x.ops[-1])
            if mm and int(mm.group(0), 16) in by_addr:
                tgt = by_addr[int(mm.group(0), 16)]
                branch[x.idx] = [tgt]
                leaders.add(tgt)
            else:
                raise ValueError(f"unresolved branch target {x.text}")
        if x.op in ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "KILL", "BPT"):
            if x.idx + 1 < len(ins):
                leaders.add(x.idx + 1)
    brx_assumed = {}
    for x in ins:
        if x.op in ("BRX", "JMX"):
            if brx_targets and x.addr in brx_targets and not brx_conservative:
                tg = [by_addr[a] for a in brx_targets[x.addr]]
                brx_assumed[x.addr] = ("nvdisasm BRANCH_TARGETS", tg)
            else:
                tg = None  # filled below
                brx_assumed[x.addr] = ("conservative", None)
            branch[x.idx] = tg
            if tg:
                leaders.update(tg)
    starts = sorted(leaders)
    block_of = {}
    blocks = []
    for bi, s in enumerate(starts):
        e = starts[bi + 1] if bi + 1 < len(starts) else len(ins)
        blocks.append(list(range(s, e)))
        for i in range(s, e):
            block_of[i] = bi
    succ = collections.defaultdict(set)
    for bi, b in enumerate(blocks):
        last = ins[b[-1]]
        uncond = last.guard is None
        never = last.guard == ("PT", False)
        if last.op in ("BRA", "JMP", "BRX", "JMX") and not never:
            for t in branch.get(last.idx) or []:
                succ[bi].add(block_of[t])
            if not uncond and b[-1] + 1 < len(ins):
                succ[bi].add(block_of[b[-1] + 1])
        elif last.op in ("EXIT", "RET", "KILL", "BPT") and not never:
            if not uncond and b[-1] + 1 < len(ins):
                succ[bi].add(block_of[b[-1] + 1])
        elif last.op == "CALL":
            for t in branch.get(last.idx) or []:
                succ[bi].add(block_of[t])
            if b[-1] + 1 < len(ins):
                succ[bi].add(block_of[b[-1] + 1])
        elif b[-1] + 1 < len(ins):
            succ[bi].add(block_of[b[-1] + 1])
    # conservative BRX: every block with no other predecessor, and every block right after a BRX
    for x in ins:
        if x.op in ("BRX", "JMX") and branch.get(x.idx) is None:
            pred_count = collections.Counter(s for b in succ.values() for s in b)
            bi = block_of[x.idx]
            tg = {b for b in range(1, len(blocks)) if pred_count[b] == 0}
            if x.idx + 1 < len(ins):
                tg.add(block_of[x.idx + 1])
            succ[bi] |= tg
            brx_assumed[x.addr] = (
                "conservative: blocks without other predecessors + the next",
                [blocks[b][0] for b in sorted(tg)],
            )
    return blocks, block_of, succ, brx_assumed


TOP = None  # unreached


def analyze(ins, blocks, succ, pred_facts=True):
    """Forward must-defined analysis. State: (defined regs frozenset, conditional facts
    frozenset of (reg, pred, sense))."""
    preds = collections.defaultdict(set)
    for b, ss in succ.items():
        for s in ss:
            preds[s].add(b)
    nb = len(blocks)
    state_in = [TOP] * nb
    state_out = [TOP] * nb
    state_in[0] = (frozenset(), frozenset())

    def edge(p, b):
        """state along the edge p -> b: a guarded branch at p's end makes facts written under
        the same guard definite on the taken edge, and the opposite sense on the fallthrough"""
        st = state_out[p]
        if st is TOP or not pred_facts:
            return st
        last = ins[blocks[p][-1]]
        if last.op != "BRA" or last.guard is None or last.guard[0] == "PT":
            return st
        p_, sense = last.guard
        taken_tgt = [t for t in succ.get(p, ()) if blocks[t][0] != blocks[p][-1] + 1]
        fall = blocks[b][0] == blocks[p][-1] + 1
        taken = b in taken_tgt or not fall
        want = sense if taken else not sense
        if b in taken_tgt and fall:  # branch to the next instruction: both edges coincide
            return st
        promote = {f[0] for f in st[1] if f[1] == p_ and f[2] == want}
        if not promote:
            return st
        return (st[0] | promote, frozenset(f for f in st[1] if f[0] not in promote))

    def meet(states):
        states = [s for s in states if s is not TOP]
        if not states:
            return TOP
        d = frozenset.intersection(*[s[0] for s in states])
        if not pred_facts:
            return (d, frozenset())
        cand = set().union(*[s[1] for s in states])
        facts = frozenset(
            f for f in cand if f[0] not in d and all(f in s[1] or f[0] in s[0] for s in states)
        )
        return (d, facts)

    def transfer(st, b, report=None):
        d, facts = set(st[0]), set(st[1])
        for i in blocks[b]:
            x = ins[i]
            if x.guard == ("PT", False):
                continue
            if report is not None:
                for r in dict.fromkeys(x.reads):
                    if r in d:
                        continue
                    if x.guard and (r, x.guard[0], x.guard[1]) in facts:
                        continue
                    report.append((i, r))
            for r in x.writes:
                if x.guard is None:
                    d.add(r)
                    facts = {f for f in facts if f[0] != r}
                elif r not in d:
                    facts.add((r, x.guard[0], x.guard[1]))
                    if (r, x.guard[0], not x.guard[1]) in facts:
                        d.add(r)
                        facts = {f for f in facts if f[0] != r}
            if x.op == "USETMAXREG" and "DEALLOC" in x.mods and x.guard is None:
                n = int(x.ops[-1], 0)  # registers >= n are given back: their values are lost
                d = {r for r in d if r < n or r >= 1000}
                facts = {f for f in facts if f[0] < n or f[0] >= 1000}
            for p in x.pwrites:
                if p in ("PT", "UPT"):
                    continue
                facts = {f for f in facts if f[1] != p}
        return (frozenset(d), frozenset(facts))

    work = collections.deque(range(nb))
    inq = set(work)
    while work:
        b = work.popleft()
        inq.discard(b)
        if b != 0:
            state_in[b] = meet([edge(p, b) for p in preds[b]])
        else:
            st0 = (frozenset(), frozenset())
            st = meet([st0] + [edge(p, b) for p in preds[b]])
            state_in[b] = st
        if state_in[b] is TOP:
            continue
        out = transfer(state_in[b], b)
        if out != state_out[b]:
            state_out[b] = out
            for s in succ.get(b, ()):
                if s not in inq:
                    work.append(s)
                    inq.add(s)
    report = []
    for b in range(nb):
        if state_in[b] is not TOP:
            transfer(state_in[b], b, report)
    unreached = [b for b in range(nb) if state_in[b] is TOP]
    return report, unreached, preds


def partitions(ins, blocks, block_of, succ, brx_assumed):
    """Label blocks by the warp-specialize partition entries: the target of the first
    conditional BRA before the BRX (warps 0-3, the default partition) and each BRX target;
    a block's label is the set of entries that reach it without re-entering the dispatch."""
    brx = [x for x in ins if x.op == "BRX"]
    if not brx:
        return {}, {}
    bx = brx[0]
    entries = {}
    first_bra = next((x for x in ins[: bx.idx] if x.op == "BRA" and x.guard), None)
    if first_bra is not None:
        t = int(re.search(r"0x[0-9a-f]+", first_bra.ops[-1]).group(0), 16)
        entries[t] = "default(warps 0-3)"
    for k, t in enumerate(brx_assumed[bx.addr][1] or []):
        entries.setdefault(ins[t].addr, f"brx[{k}]")
    dispatch_blocks = set(range(block_of[bx.idx] + 1))  # code up to the BRX
    label = collections.defaultdict(set)
    for a, name in entries.items():
        start = block_of[next(x.idx for x in ins if x.addr == a)]
        seen, stack = set(), [start]
        while stack:
            b = stack.pop()
            if b in seen or b in dispatch_blocks:
                continue
            seen.add(b)
            label[b].add(name)
            stack.extend(succ.get(b, ()))
    return label, entries


def describe_entry(ins, blocks, label, name):
    ops, regs = collections.Counter(), None
    for b in sorted(b for b, names in label.items() if name in names):
        for i in blocks[b]:
            ops[ins[i].op] += 1
            if regs is None and ins[i].op == "USETMAXREG":
                regs = ins[i].ops[-1]
    return regs, sum(ops.values()), ops.get("UTMALDG", 0), ops.get("HGMMA", 0) + ops.get("QGMMA", 0)


def why(ins, blocks, block_of, preds, i, r, limit=20000):
    """Walk backwards from instruction i over the CFG: the writes of r that end each path
    (unpredicated), predicated writes passed on the way, and whether some path reaches the
    kernel entry without an unpredicated write ('entry')."""
    seen, stack, ends, pwr, entry = set(), [(block_of[i], i - 1)], set(), set(), False
    steps = 0
    while stack and steps < limit:
        b, j = stack.pop()
        steps += 1
        stopped = False
        while j >= blocks[b][0]:
            x = ins[j]
            if r in x.writes and x.guard != ("PT", False):
                if x.guard is None:
                    ends.add(x.addr)
                    stopped = True
                    break
                pwr.add(x.addr)
            j -= 1
        if stopped:
            continue
        if b == 0:
            entry = True
        for p in preds.get(b, ()):
            if p not in seen:
                seen.add(p)
                stack.append((p, blocks[p][-1]))
    return sorted(ends), sorted(pwr), entry


def rname(r):
    return f"UP{r - 2000}" if r >= 2000 else f"P{r - 1000}" if r >= 1000 else f"R{r}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sass")
    ap.add_argument("--lines")
    ap.add_argument("--ctx", type=int, default=5)
    ap.add_argument("--no-pred-facts", action="store_true")
    ap.add_argument("--brx-conservative", action="store_true")
    ap.add_argument("--preds", action="store_true", help="also track predicates P0-6/UP0-6")
    a = ap.parse_args()
    global TRACK_PREDS
    TRACK_PREDS = a.preds
    ins = parse(open(a.sass).read())
    addr_line, labels, brx_t = ({}, {}, {})
    if a.lines:
        addr_line, labels, brx_t = parse_lines(open(a.lines).read())
    for x in ins:
        x.line = addr_line.get(x.addr)
    blocks, block_of, succ, brx_assumed = build_cfg(ins, brx_t, a.brx_conservative)
    report, unreached, preds = analyze(ins, blocks, succ, not a.no_pred_facts)
    label, entries = partitions(ins, blocks, block_of, succ, brx_assumed)
    print(f"# {a.sass}: {len(ins)} instructions, {len(blocks)} blocks")
    for addr, (how, tg) in brx_assumed.items():
        print(
            f"# BRX at {addr:#06x}: targets ({how}): "
            + ", ".join(f"{ins[t].addr:#06x}" for t in (tg or []))
        )
    for a_, name in entries.items():
        regs, n, tma, gm = describe_entry(ins, blocks, label, name)
        print(
            f"# partition entry {a_:#06x} {name}: setmaxreg {regs}, reachable instructions "
            f"{n}, UTMALDG {tma}, GMMA {gm}"
        )
    if unreached:
        print(f"# unreached blocks: {[hex(ins[blocks[b][0]].addr) for b in unreached]}")
    by_ins = collections.defaultdict(list)
    for i, r in report:
        by_ins[i].append(r)
    print(f"# flagged instructions: {len(by_ins)}")
    for i, rs in sorted(by_ins.items()):
        x = ins[i]
        b = block_of[i]
        part = "+".join(sorted(label.get(b, {"pre-dispatch"})))
        src = f"{x.line[0].split('/')[-1]}:{x.line[1]}" if x.line else "?"
        print(
            f"\n== {x.addr:#06x} reads {', '.join(rname(r) for r in rs)} "
            f"[partition {part}; line {src}]"
        )
        print(f"   {x.text}")
        for r in rs:
            ends, pwr, entry = why(ins, blocks, block_of, preds, i, r)
            print(
                f"   {rname(r)}: path from kernel entry without a write: {entry}; predicated writes "
                f"on the way: {[hex(a) for a in pwr]}; nearest unpredicated writes: "
                f"{[hex(a) for a in ends][:12]}{' ...' if len(ends) > 12 else ''}"
            )
        if a.ctx:
            for j in range(max(0, i - a.ctx), min(len(ins), i + a.ctx + 1)):
                y = ins[j]
                ln = f"{y.line[1]}" if y.line else ""
                print(f"   {'>>' if j == i else '  '} {y.addr:#06x} {y.text:<70} {ln}")


if __name__ == "__main__":
    main()
