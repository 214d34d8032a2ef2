#!/usr/bin/env python3
"""Does the patched F.sdpa honour sdpa_kernel(order, set_priority=True) as plain F.sdpa does,
eager and under torch.compile, and at what cost?

PyTorch's test_fused_sdp_priority_order (test/test_transformers.py of newer PyTorch) times one
call per priority order and asserts that the flash-first order beats the math-first one. It
failed once in one patched run (issue 45). This script answers whether that was the patch or
noise: for each order it names the kernels that ran (torch.profiler) and the median of repeated
timed calls. Run it once plain and once patched, in separate processes (compile caches):

    python3 tools/priority_order_check.py plain
    python3 tools/priority_order_check.py patched        # openwam_sdpa installed

Needs a CUDA GPU with flash, efficient and cuDNN attention (sm80+; cuDNN's on sm90).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ORDERS = {
    "flash_first": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
    "math_first": [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.CUDNN_ATTENTION],
    "efficient_first": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
    "cudnn_first": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def attention_under(order):
    def attend(x):
        with sdpa_kernel(order, set_priority=True):
            return F.scaled_dot_product_attention(x, x, x)
    return attend


def kernels_of(fn, x):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    names = {e.name[:60] for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memset")}
    return sorted(names)[:3]


def median_ms(fn, x, repeats):
    for _ in range(2):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3, max(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("plain", "patched"))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if args.mode == "patched":
        import openwam_sdpa
        openwam_sdpa.patch()
    x = torch.randn(64, 8, 1024, 64, device="cuda", dtype=torch.half)  # the test's shape
    for compiled in (False, True):
        for name, order in ORDERS.items():
            fn = attention_under(order)
            fn = torch.compile(fn) if compiled else fn
            med, lo, hi = median_ms(fn, x, args.repeats)
            print(f"{args.mode:8s} compile={compiled!s:5s} {name:15s} {med:7.3f} ms "
                  f"[{lo:.3f}-{hi:.3f}]  {kernels_of(fn, x)}", flush=True)


if __name__ == "__main__":
    main()
