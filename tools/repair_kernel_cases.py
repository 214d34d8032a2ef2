#!/usr/bin/env python3
"""The dQ-row repair kernel, launched once per case, for the tools that watch
a kernel from outside: compute-sanitizer (memcheck, racecheck, synccheck)
and Nsight Compute (ncu). Timing is benchmarks/bench_sdpa.py's job (the share
table).

    python3 tools/repair_kernel_cases.py --cases small   # sanitizers
    python3 tools/repair_kernel_cases.py --cases bench   # ncu
    python3 tools/repair_kernel_cases.py --list --cases small

small: tiny shapes (two heads, 130 query rows) over what changes the
kernel's code path: head_dim widths 64, 128 and 256 (and 72, zero-filled to
128), bf16 and fp16, a bool key mask (the additive bias the cuDNN path
passes), is_causal, BSHD storage, one affected row per head (the narrow
tile), 10% and every row, -inf rows. A sanitizer instruments every access,
so these must stay small.
bench: the share table's shapes at head_dim 128 with no affected
row (the count walks alone), one row per head, 10% and every row (what a
profile of the tile should explain). --match keeps the cases whose label
holds a substring (one case for a per-instruction profile).

Each case builds openwam_sdpa.adversarial inputs, runs stock cuDNN's forward
for out and logsumexp, fills dQ with NaN and runs the repair once; it
then checks every affected row finite and every -inf row zero (the same
rule as the GPU tests, without their error bounds). Exit status 1 if a case
fails that check, 0 otherwise; the sanitizers add their own
(tools/device_run.sh's `sanitize` and `profile` parts run them).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NamedTuple

import torch


class Case(NamedTuple):
    B: int
    H: int
    s_q: int
    s_kv: int
    D: int
    share: object  # openwam_sdpa.adversarial's rows
    dtype: torch.dtype = torch.bfloat16
    mask: bool = False    # a bool key mask with masked-out query rows
    causal: bool = False
    layout: str = "bhsd"

    def label(self) -> str:
        dt = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        extra = "".join([" mask" if self.mask else "", " causal" if self.causal else "",
                         f" {self.layout}" if self.layout != "bhsd" else ""])
        return f"{dt} d{self.D} {self.B}x{self.H}x{self.s_q}x{self.s_kv} {self.share}{extra}"


SMALL = [
    Case(1, 2, 130, 192, 128, "one_per_head"),
    Case(1, 2, 130, 192, 128, 0.1, mask=True),
    Case(1, 2, 130, 704, 128, "all", layout="bshd"),
    Case(1, 2, 130, 192, 64, "all", causal=True),
    Case(1, 2, 130, 192, 256, 0.1),
    Case(1, 2, 130, 77, 72, "all", mask=True),
    Case(1, 2, 130, 192, 128, "one_per_head", dtype=torch.float16, mask=True),
    Case(1, 2, 130, 704, 64, 0.1, dtype=torch.float16, causal=True, layout="bshd"),
    # Keys long enough to split a narrow tile across a cluster (distributed
    # shared memory: kSplitMinKeyBlocks in csrc/cuda/repair/layout.cuh).
    Case(1, 4, 130, 1600, 128, "one_per_head"),
    Case(1, 2, 130, 1600, 64, "one_per_head", mask=True, layout="bshd"),
]
BENCH = [Case(B, H, s_q, s_kv, 128, share, mask=(s_kv == 64), layout="bshd")
         for (B, H, s_q, s_kv) in [(16, 24, 704, 704), (32, 24, 360, 64), (4, 24, 4096, 4032)]
         for share in ("none", "one_per_head", 0.1, "all")]
CASES = {"small": SMALL, "bench": BENCH}


def key_mask_bias(c: Case, device) -> torch.Tensor:
    """A bool mask [B, 1, s_q, s_kv] as the additive bias the cuDNN path gives
    the repair (0 or -inf): 80% of keys visible, query row 3 seeing none
    (logsumexp -inf: the repair must zero its dQ row)."""
    g = torch.Generator().manual_seed(7)
    visible = torch.rand(c.B, 1, c.s_q, c.s_kv, generator=g) < 0.8
    visible[..., 0] = True
    visible[:, :, 3, :] = False
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    return bias.to(device=device, dtype=c.dtype)


def run_case(c: Case) -> str:
    """One repair on case `c`; returns '' or what is wrong."""
    from openwam_sdpa import REPAIR_LSE_THRESHOLD
    from openwam_sdpa.adversarial import adversarial_inputs

    q, k, v, go, _ = adversarial_inputs(c.B, c.H, c.s_q, c.s_kv, c.D, rows=c.share,
                                        layout=c.layout, dtype=c.dtype, device="cuda", seed=3)
    scale = 1.0 / math.sqrt(c.D)
    bias = key_mask_bias(c, q.device) if c.mask else None
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, c.causal, False, scale=scale)[:2]
    dq = torch.full_like(q, float("nan"))
    torch.ops.openwam._repair_dq_(dq, go, q, k, v, out, lse, bias, c.causal, scale)
    torch.cuda.synchronize()
    lse3 = lse.reshape(c.B, c.H, c.s_q)
    affected = torch.isfinite(lse3) & (lse3 < REPAIR_LSE_THRESHOLD)
    empty = lse3 == float("-inf")
    bad = int((~dq[affected].isfinite()).sum()) + int((dq[empty] != 0).sum())
    rows = int(affected.sum())
    if rows == 0 and c.share != "none":
        return "no affected row: the case does not exercise the repair"
    return f"{bad} wrong elements in {rows} affected and {int(empty.sum())} empty rows" if bad else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", choices=sorted(CASES), default="small")
    ap.add_argument("--match", default="", help="only the cases whose label holds this text")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    args = ap.parse_args(argv)
    cases = [c for c in CASES[args.cases] if args.match in c.label()]
    if not cases:
        ap.error(f"no {args.cases} case matches {args.match!r}")
    if args.list:
        for c in cases:
            print(c.label())
        return 0
    if not torch.cuda.is_available():
        print("repair_kernel_cases: needs a CUDA GPU")
        return 0
    import openwam_sdpa  # noqa: F401  (registers torch.ops.openwam)

    failed = 0
    for c in cases:
        problem = run_case(c)
        failed += bool(problem)
        print(f"{'FAIL' if problem else 'ok  '} {c.label()}" + (f": {problem}" if problem else ""),
              flush=True)
    print(f"{len(cases) - failed} of {len(cases)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
