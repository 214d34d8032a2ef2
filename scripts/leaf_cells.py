"""What the repair's probes share (probe_side_stream.py, probe_programmatic_launch.py):
a cell of adversarial inputs through the op's leaf ops, and the paired rounds that
time what each variant adds to cuDNN's backward alone.

A cell is (B, H, s_q, s_kv, mask, head_dim), mask "bool" (a key mask as the
additive bias the cuDNN path passes) or "none"; a share is one of
openwam_sdpa.adversarial's (none, one_per_head, a fraction, all). CUDA only.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import timing  # noqa: E402
from bench_repair_kernel import key_mask_bias  # noqa: E402
from stack import headline, import_openwam, stack_info  # noqa: E402

# The leaf ops' plan bits (csrc/plan.cpp).
PLAN_NONE, PLAN_REPAIR_DQ = 0, 1

# bench_sdpa's share-table cells, 360x64 and 704x704 first: with one affected row
# per head those four are over issue 12's 1.05x (ONE_ROW_OVER).
SHARE_CELLS = [(32, 24, 360, 64, "bool", 128), (32, 24, 360, 64, "bool", 64),
               (16, 24, 704, 704, "none", 128), (16, 24, 704, 704, "none", 64),
               (4, 24, 4096, 4032, "none", 128), (4, 24, 4096, 4032, "none", 64)]
ONE_ROW_OVER = SHARE_CELLS[:4]


def start(script, need_openwam=True):
    """A probe's first steps: a CUDA device or exit, the stack's headline printed, and
    openwam_sdpa imported (exit without it where `need_openwam`)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA device")
    ow, error = import_openwam()
    print(headline(stack_info(ow, error, {})), flush=True)
    if need_openwam and ow is None:
        raise SystemExit(f"{script}: cannot import openwam_sdpa: {error}")


@dataclass
class LeafCell:
    """Inputs, bf16 BSHD views, and the forward's outputs of one cell."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    go: torch.Tensor
    bias: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor
    scale: float

    def backward(self, plan=PLAN_NONE):
        """The leaf backward: cuDNN's (plan none), or cuDNN's and what the plan adds."""
        return torch.ops.openwam._cudnn_sdpa_backward(
            self.go, self.q, self.k, self.v, self.bias, self.out, self.lse, self.seed,
            self.offset, 0.0, False, None, plan)

    def repair(self, dq):
        """The standalone repair op on dq (a plain launch)."""
        torch.ops.openwam._repair_dq_(dq, self.go, self.q, self.k, self.v, self.out, self.lse,
                                      self.bias, False, self.scale)

    def then(self, fn):
        """A step of paired_added: cuDNN's backward, then fn(dq) on its dQ."""
        def step(_=None):
            dq, _, _ = self.backward()
            fn(dq)
            return dq
        return step

    @functools.cached_property
    def repaired(self):
        """The landed repair as a step of paired_added: cuDNN's backward, then the
        standalone repair op on its dQ."""
        return self.then(self.repair)


def probe_parser(doc, rounds=5, repeats=30):
    """A probe's command line (its docstring's first line as the description): paired
    rounds, and repeats per round; the probe adds its own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--repeats", type=int, default=repeats)
    return ap


def leaf_cell(cell, share, layout="bshd"):
    """Cell `cell`'s inputs at `share` (BSHD storage as the share table, or "bhsd":
    each head's rows contiguous) and its forward's outputs."""
    from openwam_sdpa.adversarial import adversarial_inputs

    B, H, s_q, s_kv, mask, D = cell
    a = adversarial_inputs(B, H, s_q, s_kv, D, rows=share, layout=layout, device="cuda", seed=1)
    bias = key_mask_bias(B, s_q, s_kv, a.query.dtype, "cuda") if mask == "bool" else None
    out, lse, seed, offset = torch.ops.openwam._cudnn_sdpa(a.query, a.key, a.value, bias, 0.0,
                                                           False, None, True, 0)
    return LeafCell(a.query, a.key, a.value, a.grad_out, bias, out, lse, seed, offset,
                    1.0 / math.sqrt(D))


def paired_added(cell, share, stock, variants, rounds, repeats):
    """cuDNN's backward (`stock`) and each of `variants` ({name: step}) in paired rounds of
    device time; returns the runs and a line: what each variant adds to the backward, µs,
    median [min..max] over the rounds."""
    steps = {"stock": stock, **variants}
    runs = timing.paired_rounds(
        [timing.Contender(n) for n in steps],
        lambda c: {"ms": timing.device_ms(steps[c.name], warmup=3, repeats=repeats)["median_ms"]},
        rounds)
    B, H, s_q, s_kv, mask, D = cell
    line = (f"B{B} H{H} D{D} {s_q}x{s_kv} {mask:4s} {share:12s} "
            f"stock bwd {timing.percentile(runs['stock']['ms'], 50):.4f} ms")
    for name in variants:
        added = timing.round_deltas(runs, name, "stock", "ms")
        line += (f" | {name} +{added['median'] * 1e3:5.1f} us "
                 f"[{added['min'] * 1e3:.1f}..{added['max'] * 1e3:.1f}]")
    return runs, line
