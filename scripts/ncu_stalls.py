#!/usr/bin/env python3
"""Where a kernel's warps stall, by source file and line: Nsight Compute's
per-instruction stall samples (device_run.sh's `profile` part writes them to
ncu_source.csv) joined with the line table of the same kernel's SASS.

    python3 scripts/ncu_stalls.py ncu_source.csv kernel.sass [--top 30]

ncu prints SASS without source lines, so the line table comes from a build
on this machine with the device's flags (setup.py's nvcc flags: -O3
-lineinfo; TORCH_CUDA_ARCH_LIST 9.0a is sm_90a). For the repair kernel:

    nvcc -cubin -o bf16.cubin csrc/cuda/repair_dq_tile_bf16.cu -Icsrc \\
         -I<torch>/include -I<torch>/include/torch/csrc/api/include \\
         -I<cuda headers> -I<python headers> -std=c++20 -O3 -lineinfo \\
         -arch=sm_90a -DOPENWAM_WITH_CUDA
    nvdisasm --print-line-info -c bf16.cubin > bf16.sass

The join is by instruction offset, and only holds if both builds made the
same SASS: the script compares every opcode and refuses a mismatch. (On
2026-12-01 nvcc 13.0 here, against torch 2.14 headers, made the device's
SASS of torch 2.11 to the instruction.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

Line = Optional[Tuple[str, int]]  # (file name, line); None before the first line record

_FUNCTION = re.compile(r"^\s*\.text\.(\S+):")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


class Sass(NamedTuple):
    lines: Dict[int, Line]   # instruction offset -> the source line it came from
    opcodes: Dict[int, str]  # instruction offset -> opcode (predicate stripped)


def opcode(text: str) -> str:
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def read_sass(lines: List[str], function: str) -> Sass:
    """The line table of the functions whose mangled name holds `function`
    (the first one if several). An inlined function's own lines count, not
    the line it was inlined at."""
    cur: Line = None
    inside = False
    table: Dict[int, Line] = {}
    ops: Dict[int, str] = {}
    for text in lines:
        m = _FUNCTION.match(text)
        if m:
            if inside:
                break
            inside = function in m.group(1)
            cur = None
            continue
        if not inside:
            continue
        m = _LINE.search(text)
        if m:
            if "inlined at" not in text:
                cur = (m.group(1).rsplit("/", 1)[-1], int(m.group(2)))
            continue
        m = _INSTR.match(text)
        if m:
            off = int(m.group(1), 16)
            table[off] = cur
            ops[off] = opcode(m.group(2))
    return Sass(table, ops)


class Samples(NamedTuple):
    kernel: str
    offsets: List[int]                   # from the kernel's first instruction
    opcodes: List[str]
    total: List[int]                     # all stall samples of the instruction
    stalls: List[Dict[str, int]]         # reason -> samples (issued or not)
    executed: List[int]                  # warp-level instructions executed


def read_samples(lines: List[str]) -> Samples:
    """ncu --page source --csv --print-source sass of one launch: a "Kernel
    Name" line, then one row per instruction (the tool's own messages around
    them are skipped). ValueError for no table or several (one per launch
    profiled: narrow PROFILE_MATCH to one case)."""
    names = [i for i, t in enumerate(lines) if t.startswith('"Kernel Name"')]
    tables = [i for i, t in enumerate(lines) if t.startswith('"Address"')]
    if not tables:
        raise ValueError("no per-instruction table (a line starting with \"Address\")")
    if len(tables) > 1 or len(names) > 1:
        raise ValueError(f"{max(len(tables), len(names))} profiled launches in one file: "
                         "profile one (PROFILE_MATCH)")
    kernel = next(csv.reader([lines[names[0]]]))[1] if names else ""
    start = tables[0]
    rows = list(csv.reader(lines[start:]))
    header, rows = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    if not rows:
        raise ValueError("the per-instruction table is empty")
    base = int(rows[0][col["Address"]], 16)

    def num(r, name):
        v = r[col[name]].replace(",", "") if name in col else ""
        return int(float(v)) if v else 0

    return Samples(
        kernel,
        [int(r[col["Address"]], 16) - base for r in rows],
        [opcode(r[col["Source"]]) for r in rows],
        [num(r, "Warp Stall Sampling (All Samples)") for r in rows],
        [{s[len("stall_"):]: num(r, s) for s in reasons if num(r, s)} for r in rows],
        [num(r, "Instructions Executed") for r in rows],
    )


def join(samples: Samples, sass: Sass) -> List[Line]:
    """The source line of each sampled instruction; ValueError where the two
    builds differ."""
    bad = [o for o, op in zip(samples.offsets, samples.opcodes) if sass.opcodes.get(o) != op]
    if bad or len(sass.opcodes) != len(samples.offsets):
        raise ValueError(
            f"the SASS differs from the profiled kernel's ({len(bad)} of {len(samples.offsets)} "
            f"opcodes, {len(sass.opcodes)} instructions against {len(samples.offsets)}): "
            "build it with the device's flags")
    return [sass.lines[o] for o in samples.offsets]


def aggregate(samples: Samples, where: List[Line], key) -> List[tuple]:
    """(key, samples, executed, top reasons) per key(line), most samples first."""
    total = collections.Counter()
    executed = collections.Counter()
    reasons = collections.defaultdict(collections.Counter)
    for line, n, ex, st in zip(where, samples.total, samples.executed, samples.stalls):
        k = key(line)
        total[k] += n
        executed[k] += ex
        reasons[k].update(st)
    return [(k, n, executed[k], reasons[k].most_common(3)) for k, n in total.most_common()]


def report(samples: Samples, where: List[Line], top: int) -> str:
    all_samples = sum(samples.total) or 1
    reasons = collections.Counter()
    for st in samples.stalls:
        reasons.update(st)
    out = [f"kernel: {samples.kernel}",
           f"{len(samples.offsets)} SASS instructions ({16 * len(samples.offsets) / 1024:.1f} KB); "
           f"{sum(samples.total)} stall samples, {sum(samples.executed)} warp instructions executed",
           "reasons: " + ", ".join(f"{r} {100 * n / all_samples:.1f}%"
                                   for r, n in reasons.most_common(8)),
           "", "by file:"]

    def fmt(rows):
        return [f"  {100 * n / all_samples:5.1f}%  {n:6}  executed {ex:9}  {k}  "
                + ", ".join(f"{r} {c}" for r, c in rs) for k, n, ex, rs in rows]

    out += fmt(aggregate(samples, where, lambda l: l[0] if l else "?"))
    out += ["", f"top {top} lines:"]
    out += fmt(aggregate(samples, where, lambda l: f"{l[0]}:{l[1]}" if l else "?")[:top])
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("sass", help="nvdisasm --print-line-info output of the same kernel's build")
    ap.add_argument("--function", default="",
                    help="part of the kernel's mangled name in the SASS file "
                         "(default: the profiled kernel's template arguments)")
    ap.add_argument("--top", type=int, default=30, help="lines to list (default 30)")
    args = ap.parse_args(argv)
    try:
        with open(args.samples, errors="replace") as f:
            samples = read_samples(f.read().splitlines())
    except (OSError, ValueError) as e:
        print(f"ncu_stalls: {args.samples}: {e}", file=sys.stderr)
        return 2
    function = args.function or mangled_hint(samples.kernel)
    with open(args.sass) as f:
        sass = read_sass(f.read().splitlines(), function)
    if not sass.opcodes:
        print(f"ncu_stalls: no function matching {function!r} in {args.sass}", file=sys.stderr)
        return 2
    try:
        where = join(samples, sass)
    except ValueError as e:
        print(f"ncu_stalls: {e}", file=sys.stderr)
        return 2
    print(report(samples, where, args.top))
    return 0


def mangled_hint(kernel: str) -> str:
    """A piece of the mangled name for a demangled repair kernel name:
    repair_kernel<openwam::repair::Bf16, (int)128>(...) -> 'Bf16ELi128E'."""
    m = re.search(r"::(\w+), \(int\)(\d+)>", kernel)
    return f"{m.group(1)}ELi{m.group(2)}E" if m else ""


if __name__ == "__main__":
    sys.exit(main())
