"""Device time of the dQ-row repair alone (torch.ops.openwam._repair_dq_), by
share of affected rows, beside stock cuDNN's backward and forward+backward.

    python benchmarks/bench_repair_kernel.py [--out DIR] [--repeats N] [--quick]

Shapes (issue 12), bf16, head_dim 128 and 64: 16x24x704x704 (no mask),
32x24x360x64 (a bool key mask, passed as the additive -inf bias the cuDNN
path gives the repair), 4x24x4096x4032 (no mask); and 64x32x32x200, many
short heads (2048 heads of one tile: each block walks about eight heads one
after another). Shares: no row, one row
per (b, h), 10% of rows, every row, built with openwam_sdpa.adversarial.

Each timing is benchmarks/timing.py's device_ms: a spin kernel holds the GPU
while every repeat is enqueued, so the events bracket only the repair's kernel
(median of the repeats). The output and logsumexp the repair reads
come from stock cuDNN's forward. Printed per case: affected rows, repair ms,
the bytes it must move (logsumexp; Q, dO, O and dQ of each affected row; K
and V once per head with an affected row) over its time, the useful FLOPs
(3 GEMMs of 2 * rows * s_kv * head_dim) over its time, each kernel's own
device time (one profiled call), and
1 + repair / stock fwd+bwd: the ratio a paired fwd+bwd benchmark of the
default plan should show (issue 12's targets: <= 1.03 none, <= 1.05 one
row per head, <= 1.25 at 10%, <= 1.6 every row). Runs in about a minute
on one H200.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402  (benchmarks/timing.py)

SHAPES = [  # B, H, s_q, s_kv, mask
    (16, 24, 704, 704, "none"),
    (32, 24, 360, 64, "bool"),
    (4, 24, 4096, 4032, "none"),
    (64, 32, 32, 200, "none"),
]
SHARES = ("none", "one_per_head", 0.1, "all")


def key_mask_bias(B, s_q, s_kv, dtype, device, seed=7):
    """A bool mask [B, 1, s_q, s_kv] (80% visible, one visible key per row at
    least) as the additive bias the cuDNN path passes: 0 or -inf."""
    g = torch.Generator().manual_seed(seed)
    visible = torch.rand(B, 1, s_q, s_kv, generator=g) < 0.8
    visible.scatter_(-1, torch.randint(0, s_kv, (B, 1, s_q, 1), generator=g), True)
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    return bias.to(device=device, dtype=dtype)


def cudnn_forward(q, k, v, bias, scale):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, False, False, scale=scale)
    return out[0], out[1]


def stock_times(q, k, v, go, bias, repeats):
    """Stock cuDNN fwd+bwd and bwd device time (F.sdpa forced onto cuDNN)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd(_):
        return F.scaled_dot_product_attention(*leaves, attn_mask=bias)

    def bwd(out):
        return torch.autograd.grad(out, leaves, go)

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        both = timing.device_ms((fwd, bwd), warmup=3, repeats=repeats)
        back = timing.device_ms(bwd, warmup=3, repeats=repeats, setup=lambda: fwd(None))
    return both["median_ms"], back["median_ms"]


def kernel_label(name):
    """A profiled kernel's key in kernels_us: "repair" for the repair's kernels
    (repair_kernel, and any form of it named repair_<form>_kernel, such as a
    branch's repair_warp_kernel), else the name's first 40 characters."""
    return "repair" if re.search(r"repair_\w*kernel", name) else name[:40]


def kernel_us(fn):
    """{kernel name: device µs} of one fn() call, from the profiler: where the time of a
    repair goes (its one kernel; with no affected row, its fixed cost)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one cycle here
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = prof.events()
    out = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = kernel_label(e.name)
            out[name] = out.get(name, 0.0) + e.device_time_total
    return out


def measure_shape(B, H, s_q, s_kv, mask, D, repeats, shares):
    from openwam_sdpa import REPAIR_LSE_THRESHOLD
    from openwam_sdpa.adversarial import adversarial_inputs, affected_rows

    dtype, device = torch.bfloat16, "cuda"
    scale = 1.0 / math.sqrt(D)
    # The builder draws K, V, ordinary Q and dO first, then the adversarial
    # rows: "none" and "all" share everything else, and any share is a mix.
    q_none, k, v, go, _ = adversarial_inputs(B, H, s_q, s_kv, D, rows="none", dtype=dtype,
                                             device=device, seed=1)
    q_all = adversarial_inputs(B, H, s_q, s_kv, D, rows="all", dtype=dtype, device=device,
                               seed=1).query
    bias = key_mask_bias(B, s_q, s_kv, dtype, device) if mask == "bool" else None
    stock_fb, stock_b = stock_times(q_none, k, v, go, bias, repeats)
    rows = []
    for share in shares:
        g = torch.Generator().manual_seed(2)
        sel = affected_rows(share, B, H, s_q, generator=g).to(device)
        q = torch.where(sel.unsqueeze(-1), q_all, q_none)
        out, lse = cudnn_forward(q, k, v, bias, scale)
        lse3 = lse.reshape(B, H, s_q)
        low = (torch.isfinite(lse3) & (lse3 < REPAIR_LSE_THRESHOLD))
        n_rows = int(low.sum())
        heads_hit = int(low.any(-1).sum())
        dq = torch.zeros_like(q)

        def repair(_):
            torch.ops.openwam._repair_dq_(dq, go, q, k, v, out, lse, bias, False, scale)

        t = timing.device_ms(repair, warmup=3, repeats=repeats)["median_ms"]
        kernels = kernel_us(lambda: repair(None))
        elt = q.element_size()
        bytes_moved = (B * H * s_q * 4 + n_rows * 4 * D * elt + heads_hit * 2 * s_kv * D * elt
                       + (n_rows * s_kv * elt if bias is not None else 0))
        flops = 3 * 2 * n_rows * s_kv * D
        rows.append({
            "shape": f"{B}x{H}x{s_q}x{s_kv}", "mask": mask, "head_dim": D, "share": str(share),
            "rows": n_rows, "repair_ms": t, "GB_s": bytes_moved / t / 1e6,
            "TFLOP_s": flops / t / 1e9, "stock_bwd_ms": stock_b, "stock_fwd_bwd_ms": stock_fb,
            "est_ratio": 1.0 + t / stock_fb, "kernels_us": kernels,
        })
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for repair_kernel.json")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="head_dim 128 only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_repair_kernel: needs a CUDA GPU")
        return 0
    import openwam_sdpa  # noqa: F401  (registers torch.ops.openwam)

    head_dims = (128,) if args.quick else (128, 64)
    results = []
    for D in head_dims:
        for B, H, s_q, s_kv, mask in SHAPES:
            results += measure_shape(B, H, s_q, s_kv, mask, D, args.repeats, SHARES)
            torch.cuda.empty_cache()

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, bf16")
    head = (f"{'shape':>16} {'mask':>4} {'D':>3} {'share':>12} {'rows':>8} {'repair ms':>9} "
            f"{'GB/s':>7} {'TFLOP/s':>7} {'bwd ms':>7} {'fwd+bwd':>7} {'est':>6}  kernels (µs, profiler)")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['shape']:>16} {r['mask']:>4} {r['head_dim']:>3} {r['share']:>12} "
              f"{r['rows']:>8} {r['repair_ms']:>9.4f} {r['GB_s']:>7.0f} {r['TFLOP_s']:>7.1f} "
              f"{r['stock_bwd_ms']:>7.3f} {r['stock_fwd_bwd_ms']:>7.3f} {r['est_ratio']:>6.3f}  "
              + " ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "repair_kernel.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
