"""Host time per attention call, layer by layer: where openwam_sdpa's host time goes.

Call patterns, bf16, q/k/v views of [B,S,H,D] storage requiring grad:
  OpenWAM's three (B4 H24 D128): the joint 392x392 with a bool mask [B,1,392,392], and the
  text cross-attention 360x64 and 32x64 with key-padding masks [B,1,1,64]; and bench_sdpa's
  B32 H24 D128 392x392 without a mask.
Layers, each timed as host µs per call while a spin kernel holds the GPU (so no call waits
for it), in paired rounds with the order rotating:
  stock         F.scaled_dot_product_attention (PyTorch's selector, its mask conversion,
                the cuDNN op and its autograd node); forward, and backward (the node)
  openwam       openwam_sdpa.sdpa at default settings; forward, and backward (the node)
  entry         openwam_sdpa._C.sdpa: openwam without its Python wrapper
  aten op       torch.ops.aten._scaled_dot_product_cudnn_attention on a ready additive bias:
                stock without its selector and mask conversion
  openwam op    torch.ops.openwam._cudnn_sdpa on the same bias (plan 0): openwam's leaf op
  selector      torch._fused_sdp_choice alone (stock and openwam each ask it once)
  stock-again   stock measured again: the A/A control
The backward is each output's autograd node called directly (grad mode off, as the engine
calls it). Then torch.profiler over forward+backward steps of stock and of openwam: calls and self CPU
time per step of each ATen op and CUDA runtime call (where the difference goes).

Run (from the repository root, on a GPU; 20 seconds on an H200):
    python benchmarks/bench_host.py --out $OUT/host
    python benchmarks/bench_host.py --selftest --out /tmp/host   # CPU, tiny shapes, checks the outputs
Writes host.json and host.md under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import report
import timing
from stack import headline, import_openwam, require_device, stack_info

DTYPE = torch.bfloat16
BASE = "stock"


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    heads: int
    head_dim: int
    s_q: int
    s_kv: int
    mask: str  # none / full [B,1,Sq,Skv] / keys [B,1,1,Skv]


CASES = (
    Case("OpenWAM joint", 4, 24, 128, 392, 392, "full"),
    Case("OpenWAM text (video)", 4, 24, 128, 360, 64, "keys"),
    Case("OpenWAM text (action)", 4, 24, 128, 32, 64, "keys"),
    Case("bench_sdpa", 32, 24, 128, 392, 392, "none"),
)
SELFTEST_CASES = (Case("tiny", 1, 2, 16, 8, 12, "keys"),)


def case_inputs(case, device, seed=0):
    """q, k, v ([B,S,H,D] storage seen as [B,H,S,D], requiring grad), the bool mask
    (None without), the additive bias the cuDNN ops take, and an output gradient."""
    g = torch.Generator().manual_seed(seed)

    def leaf(s):
        x = torch.randn(case.batch, s, case.heads, case.head_dim, generator=g).to(device, DTYPE)
        return x.transpose(1, 2).requires_grad_()

    q, k, v = leaf(case.s_q), leaf(case.s_kv), leaf(case.s_kv)
    mask = None
    if case.mask != "none":
        rows = case.s_q if case.mask == "full" else 1
        mask = torch.rand(case.batch, 1, rows, case.s_kv, generator=g) < 0.8
        mask[..., 0] = True  # every query sees a key
        mask = mask.to(device)
    bias = None if mask is None else torch.zeros(mask.shape, dtype=DTYPE, device=device).masked_fill(
        ~mask, float("-inf"))
    return q, k, v, mask, bias, torch.randn(q.shape, generator=g).to(device, DTYPE)


@dataclass
class Layer:
    name: str
    call: Callable  # one call; its result is kept until the round's timing ends
    context: Callable = contextlib.nullcontext
    grad_mode: bool = True  # False for the backward nodes, as the engine runs them


def layers(ow, case, device):
    """(forward layers, backward layers, inputs): stock first, stock-again last in each."""
    q, k, v, mask, bias, grad = case_inputs(case, device)
    C = ow._C
    fwd = [
        Layer(BASE, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        Layer("openwam", lambda: ow.sdpa(q, k, v, attn_mask=mask)),
        Layer("entry", lambda: C.sdpa(q, k, v, mask, 0.0, False, None, False)),
        Layer("selector", lambda: torch._fused_sdp_choice(q, k, v, mask, 0.0, False)),
    ]
    if device == "cuda":  # the cuDNN ops have no CPU kernel
        fwd += [
            Layer("aten op", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, 0.0, False, False)[0]),
            Layer("openwam op", lambda: torch.ops.openwam._cudnn_sdpa(q, k, v, bias, 0.0, False, None, True, 0)[0]),
        ]
    fwd.append(timing.again(fwd[0]))
    # The backward: each output's autograd node called directly, as the engine calls it
    # (grad mode off), on this thread. Through out.backward() the engine hands CUDA work to
    # its device thread and waits for it: a wake-up of tens of microseconds, the same for
    # every op, and noisier than what is measured here.
    stock_node = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).grad_fn
    openwam_node = ow.sdpa(q, k, v, attn_mask=mask).grad_fn
    bwd = [Layer(BASE, lambda: stock_node(grad), grad_mode=False),
           Layer("openwam", lambda: openwam_node(grad), grad_mode=False)]
    bwd.append(timing.again(bwd[0]))
    return fwd, bwd, (q, k, v, mask, grad)


def host_us(layer, warmup, repeats):
    """timing.call_host_us of one layer, in its grad mode."""
    with torch.set_grad_enabled(layer.grad_mode):
        return timing.call_host_us(layer.call, warmup, repeats)


def op_profile(step, steps):
    """{op or runtime call: [calls, self CPU µs]} per step(), averaged over `steps` profiled
    steps (after one untimed step). The profiler's own cost is in every figure alike."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if timing.cuda() else [])
    step()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if timing.cuda():
            torch.cuda.synchronize()
    return {e.key: [e.count / steps, e.self_cpu_time_total / steps] for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CPU}


def timed(group, args):
    """Paired rounds over one group of layers; per-round differences from stock."""
    for layer in group:  # warm-up: cuDNN plans built, memory cached
        with torch.set_grad_enabled(layer.grad_mode):
            for _ in range(args.warmup):
                layer.call()
    runs = timing.paired_rounds(group, lambda c: host_us(c, args.warmup, args.repeats), args.rounds)
    return {"runs": runs, "deltas": {c.name: timing.round_deltas(runs, c.name, BASE, "us") for c in group[1:]}}


def run_case(ow, case, device, args):
    fwd, bwd, (q, k, v, mask, grad) = layers(ow, case, device)
    profiles = {}
    for name, fn in 2 * ((BASE, F.scaled_dot_product_attention), ("openwam", ow.sdpa)):  # the 2nd of each kept
        profiles[name] = op_profile(lambda: fn(q, k, v, attn_mask=mask).backward(grad), args.profile_steps)
    return {"case": vars(case), "decision": {k_: str(v_) for k_, v_ in ow.explain(q, k, v, attn_mask=mask).items()},
            "forward": timed(fwd, args), "backward": timed(bwd, args), "op_profiles": profiles}


def run(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ow, ow_error = import_openwam()
    if ow is None:
        raise SystemExit(f"openwam_sdpa is not importable: {ow_error}")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"stack": stack_info(ow, ow_error, settings), "settings": settings}
    print(headline(result["stack"]), flush=True)
    t0 = time.time()
    result["cases"] = [run_case(ow, case, device, args) for case in (SELFTEST_CASES if args.selftest else CASES)]
    result["stack"]["elapsed_s"] = round(time.time() - t0, 1)
    return result


# ---------------------------------------------------------------------- report


def describe(case):
    mask = {"none": "no mask", "full": "bool [B,1,Sq,Skv]", "keys": "bool [B,1,1,Skv]"}[case["mask"]]
    return (f"{case['name']}: B{case['batch']} H{case['heads']} D{case['head_dim']} "
            f"{case['s_q']}x{case['s_kv']}, {mask}")


def delta_cell(d):
    return "—" if d is None else f"{d['median']:+.1f} [{d['min']:+.1f}–{d['max']:+.1f}]"


def profile_rows(profiles, top):
    """The `top` ops and runtime calls whose self CPU time per step differs most between stock
    and openwam: [op, stock calls, stock µs, openwam calls, openwam µs]."""
    names = set(profiles[BASE]) | set(profiles["openwam"])
    rows = [[op, *profiles[BASE].get(op, [0, 0.0]), *profiles["openwam"].get(op, [0, 0.0])] for op in names]
    rows.sort(key=lambda r: (-abs(r[4] - r[2]), r[0]))
    return [[r[0], f"{r[1]:g}", f"{r[2]:.1f}", f"{r[3]:g}", f"{r[4]:.1f}"] for r in rows[:top]]


def markdown(result):
    s = result["settings"]
    parts = [f"### Host time per call, layer by layer: {report.stack_title(result['stack'])}", "",
             "bf16, q/k/v views of [B,S,H,D] storage requiring grad. Host µs per call while a spin kernel "
             "holds the GPU (no call waits for it), every result kept until the timing ends (no call pays "
             f"for freeing the last one's): median of {s['repeats']} calls per round, {s['rounds']} paired "
             "rounds with the order rotating. Differences from stock are per round, median [min–max] over "
             "rounds; stock-again is the A/A control. Forward layers: openwam = openwam_sdpa.sdpa; entry = "
             "openwam_sdpa._C.sdpa (no Python wrapper); aten op / openwam op = the cuDNN leaf ops alone on a "
             "ready bias (aten: with its autograd node; openwam: `_cudnn_sdpa`, plan 0); selector = "
             "torch._fused_sdp_choice alone. Backward: each output's autograd node called directly with grad "
             "mode off, as the engine calls it (the engine's hand-off to its device thread is left out: the "
             "same for every op, and noisier than the differences measured).", ""]
    head = ["call", "stock fwd µs", "openwam − stock", "entry − stock", "aten op − stock",
            "openwam op − stock", "selector − stock", "A/A fwd", "stock bwd µs", "openwam bwd − stock",
            "A/A bwd", "openwam plan"]
    rows = []
    for c in result["cases"]:
        f, b = c["forward"], c["backward"]
        rows.append([describe(c["case"]), report.num(timing.percentile(f["runs"][BASE]["us"], 50), "{:.1f}")]
                    + [delta_cell(f["deltas"].get(n)) for n in
                       ("openwam", "entry", "aten op", "openwam op", "selector", f"{BASE}-again")]
                    + [report.num(timing.percentile(b["runs"][BASE]["us"], 50), "{:.1f}"),
                       delta_cell(b["deltas"]["openwam"]), delta_cell(b["deltas"][f"{BASE}-again"]),
                       f"{c['decision'].get('plan')} ({c['decision'].get('route')})"])
    parts += [report.md_table(head, rows), ""]
    worst = {d: max(c[d]["deltas"]["openwam"]["median"] for c in result["cases"]) for d in ("forward", "backward")}
    aa = max(abs(c[d]["deltas"][f"{BASE}-again"]["median"]) for c in result["cases"] for d in ("forward", "backward"))
    covered = [x for c in result["cases"] for d in ("forward", "backward") for run in c[d]["runs"].values()
               for x in run["covered"] if x is not None]
    parts += [f"- openwam − stock per call (target at most +5 µs): forward worst {worst['forward']:+.1f} µs, "
              f"backward worst {worst['backward']:+.1f} µs; A/A worst |{aa:.1f}| µs."]
    if covered:
        parts.append(f"- The spin held the GPU through every timed call in {sum(covered)}/{len(covered)} timings.")
    parts += ["", f"**Host time per op** (torch.profiler over {s['profile_steps']} forward+backward steps through "
              "`out.backward()`, per step: calls and self CPU µs of each ATen op and CUDA runtime call; the rows "
              "where stock and openwam differ most; the profiler's own cost is in every figure alike):", ""]
    for c in result["cases"]:
        rows = profile_rows(c["op_profiles"], s["top_ops"])
        parts += [f"*{describe(c['case'])}*", "",
                  report.md_table(["op", "stock calls", "stock µs", "openwam calls", "openwam µs"], rows), ""]
    return "\n".join(parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "host"), help="output folder")
    p.add_argument("--rounds", type=int, default=8, help="paired rounds (default 8)")
    p.add_argument("--repeats", type=int, default=40, help="timed calls per layer and round (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each timing (default 5)")
    p.add_argument("--top-ops", type=int, default=15, help="rows per host-time-per-op table")
    p.add_argument("--profile-steps", type=int, default=10, help="profiled steps per op table (default 10)")
    p.add_argument("--selftest", action="store_true", help="tiny shapes on the CPU, then check the outputs")
    args = p.parse_args(argv)
    if args.selftest:
        args.rounds, args.repeats, args.warmup, args.profile_steps = 2, 3, 1, 2
    if min(args.rounds, args.repeats, args.top_ops, args.profile_steps) < 1 or args.warmup < 0:
        p.error("--rounds, --repeats, --top-ops and --profile-steps must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    require_device(args.selftest)
    result = run(args)
    md = markdown(result)
    out = Path(args.out)
    files = report.write_outputs(result, out, "host", md)
    print(md)
    if args.selftest:
        import selftest
        selftest.check_host(result, md, out)
    print(f"wrote {', '.join(files)} under {out}; measured in {result['stack']['elapsed_s']}s")


if __name__ == "__main__":
    main()
