# Device probe (issue 3): where does openwam_sdpa spend host time per call
# that stock cuDNN does not? Per-call CUDA events of a short step (360x64:
# 0.1 ms forward, 0.46 ms fwd+bwd) measure the host, not the GPU, once the
# host is slower than the kernels.
#   python3 notes/probe_host_overhead.py [--trace DIR]
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

B, H, SQ, SKV, D = 32, 24, 360, 64, 128
dt = torch.bfloat16
SPIN = 200_000_000  # ~100 ms: the host never waits for the GPU below


def inputs(layout):
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (B, SQ, H, D) if layout == "bshd" else (B, H, SQ, D)
    kshape = (B, SKV, H, D) if layout == "bshd" else (B, H, SKV, D)
    q, k, v = (torch.randn(s, generator=g).to("cuda", dt).requires_grad_() for s in (shape, kshape, kshape))
    mask = (torch.rand(B, 1, SQ, SKV, generator=g) > 0.1).cuda()
    return q, k, v, mask


def host_us(fn, n=200):
    """Mean host time per call with the GPU held busy (no back-pressure)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        torch.cuda._sleep(SPIN)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


for layout in ("bshd", "bhsd"):
    q, k, v, mask = inputs(layout)
    view = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    go = torch.randn_like(view(q))
    qv, kv, vv = view(q), view(k), view(v)
    bias = torch.where(mask, 0.0, float("-inf")).to(dt)
    op = torch.ops.openwam.sdpa.default

    def stock():
        return F.scaled_dot_product_attention(qv, kv, vv, mask)

    def ours():
        return ow.sdpa(qv, kv, vv, mask)

    rows = {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        rows["stock F.sdpa fwd"] = host_us(stock)
        rows["aten cudnn op fwd (bias given)"] = host_us(
            lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(qv, kv, vv, bias, True, 0.0, False, False))
        rows["torch.where bool->bias"] = host_us(lambda: torch.where(mask, 0.0, float("-inf")))
        rows["stock fwd+bwd"] = host_us(lambda: torch.autograd.grad(stock(), (q, k, v), go), n=100)
    rows["ow.sdpa fwd"] = host_us(ours)
    rows["op.default fwd"] = host_us(lambda: op(qv, kv, vv, mask, 0.0, False, None, False))
    with torch.no_grad():
        rows["ow.sdpa fwd, no_grad (no autograd.Function)"] = host_us(ours)
    rows["ow.explain (validate+settings+decide)"] = host_us(lambda: ow.explain(qv, kv, vv, mask))
    os.environ["OPENWAM_SDPA_CUDNN"] = "1"
    rows["ow.sdpa fwd, CUDNN=1 (no _fused_sdp_choice)"] = host_us(ours)
    del os.environ["OPENWAM_SDPA_CUDNN"]
    rows["ow fwd+bwd"] = host_us(lambda: torch.autograd.grad(ours(), (q, k, v), go), n=100)
    os.environ["OPENWAM_SDPA_PAD"] = "never"
    rows["ow fwd+bwd, PAD=never (no repair launch)"] = host_us(
        lambda: torch.autograd.grad(ours(), (q, k, v), go), n=100)
    del os.environ["OPENWAM_SDPA_PAD"]
    print(f"\n{layout}: B{B} H{H} {SQ}x{SKV} D{D} bool mask [B,1,Sq,Skv]; host us per call, GPU kept busy")
    for name, us in rows.items():
        print(f"  {name:48s} {us:8.1f}")

    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        os.makedirs(args.trace, exist_ok=True)
        for name, fn in (("stock", lambda: torch.autograd.grad(stock(), (q, k, v), go)),
                         ("ours", lambda: torch.autograd.grad(ours(), (q, k, v), go))):
            ctx = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if name == "stock" else torch.enable_grad()
            with ctx:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(50):
                        fn()
                    torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            with open(os.path.join(args.trace, f"profile_{layout}_{name}.txt"), "w") as f:
                f.write(table)
