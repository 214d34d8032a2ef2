# Device probe: where does a short training forward spend host time, stock
# cuDNN against openwam_sdpa? (Issue 3: the 360x64 forward, 0.1 ms on the
# GPU, measured 1.35x stock in bshd with per-call CUDA events.)
#   python3 notes/probe_forward_overhead.py [--trace DIR]
import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import openwam_sdpa as ow

p = argparse.ArgumentParser()
p.add_argument("--trace", help="folder for profiler tables")
args = p.parse_args()
os.environ["OPENWAM_SDPA_CUDNN"] = "1"

B, H, SQ, SKV, D = 32, 24, 360, 64, 128
dev, dt = "cuda", torch.bfloat16
SPIN = 100_000_000


def inputs(layout):
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (B, SQ, H, D) if layout == "bshd" else (B, H, SQ, D)
    kshape = (B, SKV, H, D) if layout == "bshd" else (B, H, SKV, D)
    q = torch.randn(shape, generator=g).to(dev, dt).requires_grad_()
    k = torch.randn(kshape, generator=g).to(dev, dt).requires_grad_()
    v = torch.randn(kshape, generator=g).to(dev, dt).requires_grad_()
    mask = (torch.rand(B, 1, SQ, SKV, generator=g) > 0.1).to(dev)
    return q, k, v, mask


def host_and_device(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    dev_us = s.elapsed_time(e) / n * 1e3
    # per-call events, the benchmark's method (host launches included)
    evs = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        evs.append((a, b))
    torch.cuda.synchronize()
    per = sorted(a.elapsed_time(b) * 1e3 for a, b in evs)
    return host, dev_us, per[len(per) // 2]


op = torch.ops.openwam.sdpa.default
for layout in ("bshd", "bhsd"):
    q, k, v, mask = inputs(layout)
    if layout == "bshd":
        view = lambda t: t.transpose(1, 2)  # noqa: E731
    else:
        view = lambda t: t  # noqa: E731

    def stock():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(view(q), view(k), view(v), mask)

    def stock_in_ctx():  # timed inside one sdpa_kernel block, below
        return F.scaled_dot_product_attention(view(q), view(k), view(v), mask)

    def ours():
        return ow.sdpa(view(q), view(k), view(v), mask)

    def ours_op():
        return op(view(q), view(k), view(v), mask)

    def stock_lowlevel():
        bias = torch.where(mask, 0.0, float("-inf")).to(dt)
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            view(q), view(k), view(v), bias, True, 0.0, False, False)[0]

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        rows = {"stock F.sdpa (in ctx)": host_and_device(stock_in_ctx)}
    rows["stock F.sdpa (ctx per call)"] = host_and_device(stock)
    rows["aten cudnn op + where"] = host_and_device(stock_lowlevel)
    rows["ow.sdpa"] = host_and_device(ours)
    rows["openwam op .default"] = host_and_device(ours_op)
    print(f"\n{layout}: B{B} H{H} {SQ}x{SKV} D{D} bool mask, grad mode")
    print(f"  {'method':30s} {'host us/call':>12s} {'device us (queued)':>18s} {'per-call events us':>19s}")
    for name, (h, d, e) in rows.items():
        print(f"  {name:30s} {h:12.1f} {d:18.1f} {e:19.1f}")

    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        from torch.profiler import ProfilerActivity, profile
        for name, fn in (("stock", stock), ("ours", ours)):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
            with open(os.path.join(args.trace, f"profile_{layout}_{name}.txt"), "w") as f:
                f.write(table)
            print(f"  [{name}] top CPU ops:")
            for line in table.splitlines()[:14]:
                print("   ", line[:160])
