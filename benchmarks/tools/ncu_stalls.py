"""Where a kernel's warps stall, from an ncu source-page export (per SASS instruction).

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv   (on the GPU
        machine; ``ncu_launch.py`` says how to make REPORT with the SourceCounters section)
    python benchmarks/tools/ncu_stalls.py sass.csv[.gz] [--top 30]

Prints the stall reasons over all samples, the samples per loop (backward branches: a consumer's
tile loop, the producer's), the reasons inside the hottest loop, the samples by opcode and the
top instructions. Warps idle at the end of a warp-specialized kernel (the padded producer warps
waiting at the join) show up as NOPs with barrier stalls; they take no issue slots.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header, data = rows[start], rows[start + 1 :]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in data:
        out.append(
            dict(
                addr=int(r[0], 16),
                src=r[1].strip(),
                samples=_num(r[col["Warp Stall Sampling (All Samples)"]]),
                executed=_num(r[col["Instructions Executed"]]),
                reasons={k[6:]: _num(r[col[k]]) for k in reasons},
            )
        )
    return out


def loops(ins):
    """(first, last) instruction indices of backward branches spanning > 20 instructions; a
    branch back from an out-of-line block placed after an EXIT (mbarrier retries) is no loop."""
    index = {x["addr"]: i for i, x in enumerate(ins)}
    found = []
    for i, x in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", x["src"])
        if m and int(m.group(1), 16) in index:
            j = index[int(m.group(1), 16)]
            if j < i - 20 and not any("EXIT" in y["src"] for y in ins[j:i]):
                found.append((j, i))
    return found


def reasons_of(ins, lo=0, hi=None):
    tot = collections.Counter()
    for x in ins[lo : (hi if hi is not None else len(ins) - 1) + 1]:
        tot.update(x["reasons"])
    return tot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    ins = load(args.csv)
    total = sum(x["samples"] for x in ins)
    print(f"{len(ins)} SASS instructions, {total:.0f} stall samples")
    print("\nstall reasons, all samples:")
    for k, v in reasons_of(ins).most_common(10):
        print(f"  {k:20s} {100 * v / total:5.1f}%")
    print("\nloops (instruction range: samples, executions of the back edge):")
    inner = [(lo, hi) for lo, hi in loops(ins) if not any(a > lo and b < hi for a, b in loops(ins))]
    for lo, hi in inner:
        s = sum(x["samples"] for x in ins[lo : hi + 1])
        print(
            f"  {lo}-{hi}: {100 * s / total:5.1f}% of samples, {ins[hi]['executed']:.0f} iterations"
        )
    if inner:
        lo, hi = max(inner, key=lambda r: sum(x["samples"] for x in ins[r[0] : r[1] + 1]))
        s = sum(x["samples"] for x in ins[lo : hi + 1])
        print(f"\nreasons inside the hottest loop {lo}-{hi} ({hi - lo + 1} instructions):")
        for k, v in reasons_of(ins, lo, hi).most_common(10):
            print(f"  {k:20s} {100 * v / s:5.1f}%")
    by_op = collections.Counter()
    for x in ins:
        by_op[re.sub(r"^@!?U?P\w+\s+", "", x["src"]).split(" ")[0]] += x["samples"]
    print("\nsamples by opcode:")
    for op, v in by_op.most_common(15):
        print(f"  {op:28s} {100 * v / total:5.1f}%")
    print(f"\ntop {args.top} instructions (index, % of samples, top reason):")
    for i, x in sorted(enumerate(ins), key=lambda t: -t[1]["samples"])[: args.top]:
        k, v = max(x["reasons"].items(), key=lambda kv: kv[1])
        print(f"  {i:5d} {100 * x['samples'] / total:5.2f}%  {k:12s} {x['src'][:70]}")


if __name__ == "__main__":
    main()
