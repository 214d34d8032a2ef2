"""What the repair's programmatic launch saves (BENCHMARKS.md, runs M1-M2).

Inside the op's backward the repair kernel is launched as a programmatic
dependent of cuDNN's backward (repair_dq.h, behind_backward): on sm_90 it
may start as the backward's last kernel retires its blocks, and waits for
it only before writing dQ. The standalone op `_repair_dq_` launches the
same kernel plainly. This probe times, in paired rounds (device time with
the host kept ahead, benchmarks/timing.py), cuDNN's backward alone (the
leaf op with plan none), `plain` (that backward, then `_repair_dq_`) and
`programmatic` (the leaf op with plan repair_dq: the backward and the
repair as the op runs them), and prints what each adds to the backward,
median [min..max] over the rounds, and their difference. Then one profiled
call of each at three cells: the start and end of the last three kernels.

    python scripts/probe_programmatic_launch.py [--rounds 7] [--repeats 30] [--quick]

About a minute on one H200; CUDA only.
"""

from __future__ import annotations

import torch

# leaf_cells puts benchmarks/ on the path, for timing
from leaf_cells import (ONE_ROW_OVER, PLAN_REPAIR_DQ, SHARE_CELLS, leaf_cell, paired_added,
                        probe_parser, start)
import timing  # noqa: E402 (from benchmarks/)

CELLS = SHARE_CELLS


def setup(cell, share):
    c = leaf_cell(cell, share)

    def programmatic(_):
        return c.backward(PLAN_REPAIR_DQ)

    return c, {"plain": c.repaired, "programmatic": programmatic}


def probe_cell(cell, share, rounds, repeats):
    c, steps = setup(cell, share)
    runs, line = paired_added(cell, share, lambda _: c.backward(), steps, rounds, repeats)
    d = timing.round_deltas(runs, "programmatic", "plain", "ms")
    line += (f" | programmatic - plain {d['median'] * 1e3:+.1f} us "
             f"[{d['min'] * 1e3:+.1f}..{d['max'] * 1e3:+.1f}]")
    return line


def trace(cell, share):
    from torch.profiler import ProfilerActivity, profile

    _, steps = setup(cell, share)
    for name in ("plain", "programmatic"):
        step = steps[name]
        for _ in range(3):
            step(None)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e7))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(None)
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        ev = sorted(ev, key=lambda e: e.time_range.start)
        t0 = ev[0].time_range.start
        print(f"  trace {cell} {share} {name}:")
        for e in ev[-3:]:
            print(f"    {e.name[:60]:60s} start {e.time_range.start - t0:8.1f} "
                  f"end {e.time_range.end - t0:8.1f} us")


def main():
    ap = probe_parser(__doc__, rounds=7)
    ap.add_argument("--quick", action="store_true",
                    help="the 360x64 and 704x704 cells only, no traces")
    args = ap.parse_args()
    start("probe_programmatic_launch.py")
    cells = ONE_ROW_OVER if args.quick else CELLS
    for cell in cells:
        for share in ("none", "one_per_head"):
            print(probe_cell(cell, share, args.rounds, args.repeats), flush=True)
    if not args.quick:
        for cell in CELLS[:3]:
            trace(cell, "one_per_head")


if __name__ == "__main__":
    main()
