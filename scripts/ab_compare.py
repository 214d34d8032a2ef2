#!/usr/bin/env python3
"""The repair kernel's time, base against new, from bench_repair_kernel.py
runs made on one machine (device_run.sh's `ab` part alternates them):

    python3 scripts/ab_compare.py --base b1.json b2.json --new n1.json n2.json

Per case: the kernel's time in every run (profiler µs), new / base of the
means, and the base's own spread (largest / smallest run), against which a
ratio is read: a change inside it is not one these runs can show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Dict, List, Tuple

Key = Tuple[str, str, int, str]  # shape, mask, head_dim, share


def kernel_us(path: str) -> Dict[Key, float]:
    with open(path) as f:
        results = json.load(f)["results"]
    return {(r["shape"], r["mask"], r["head_dim"], str(r["share"])): r["kernels_us"]["repair"]
            for r in results}


def compare(base: List[Dict[Key, float]], new: List[Dict[Key, float]]) -> List[dict]:
    """One row per case that every run measured, in the first base run's order."""
    rows = []
    for key in base[0]:
        if not all(key in run for run in base + new):
            continue
        b = [run[key] for run in base]
        n = [run[key] for run in new]
        rows.append({"case": key, "base": b, "new": n,
                     "ratio": statistics.mean(n) / statistics.mean(b),
                     "base_spread": max(b) / min(b)})
    return rows


def table(rows: List[dict]) -> str:
    nb, nn = len(rows[0]["base"]), len(rows[0]["new"])
    head = (["case"] + [f"base {i + 1}" for i in range(nb)] + [f"new {i + 1}" for i in range(nn)]
            + ["new / base", "base spread"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        shape, mask, d, share = r["case"]
        cells = ([f"{shape} {mask} D{d} {share}"] + [f"{x:.1f}" for x in r["base"] + r["new"]]
                 + [f"{r['ratio']:.3f}", f"{r['base_spread']:.3f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", nargs="+", required=True, help="repair_kernel.json of the base runs")
    ap.add_argument("--new", nargs="+", required=True, help="repair_kernel.json of the new runs")
    args = ap.parse_args(argv)
    try:
        rows = compare([kernel_us(p) for p in args.base], [kernel_us(p) for p in args.new])
    except (OSError, KeyError, ValueError) as e:
        print(f"ab_compare: a run's results are missing or unreadable: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("ab_compare: no case measured in every run", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
