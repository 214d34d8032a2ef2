"""Host overhead in a real block: OpenWAM-shaped attention, stock F.sdpa vs openwam_sdpa.patch().

The block (written here after OpenWAM's call pattern, not copied): 2 layers, batch 4,
24 heads x 128 (width 3072), bf16. Each layer runs
  * a joint self-attention over 392 tokens (360 video + 32 action) with a bool
    mask [B,1,392,392]: video queries see the video keys, action queries see all;
  * text cross-attention of the 360 video and of the 32 action queries over 64
    text tokens, with key-padding masks broadcast over the queries, [B,1,1,64].
q, k and v are views of packed projections ([B,S,H,D] storage). Every attention
call runs under torch.utils.checkpoint (its forward runs again in the backward)
and goes through F.scaled_dot_product_attention: stock, or patched by
openwam_sdpa.patch(). A step is forward + backward.

Paired rounds (timing.paired_rounds) of stock, patched and stock again (the A/A
control): GPU busy time, host time and wall time per step. Then openwam_sdpa's
decision for each call pattern (what PyTorch's selector would pick), and one
profiled step of each contender: host time per op (self CPU time).

Run (from the repository root, on a GPU; about 40 seconds, estimated):
    python benchmarks/bench_block.py --out $OUT/block
    python benchmarks/bench_block.py --selftest --out /tmp/block   # CPU, tiny block, checks the outputs
Writes block.json and block.md under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import report
import timing
from stack import headline, import_openwam, require_device, stack_info

DTYPE = torch.bfloat16
BASE = "stock"


@dataclass(frozen=True)
class BlockShape:
    batch: int
    heads: int
    head_dim: int
    video: int   # video tokens: queries of the first text cross-attention
    action: int  # action tokens: queries of the second
    text: int    # text tokens: keys of both cross-attentions
    layers: int

    def label(self):
        return (f"{self.layers} layers, B{self.batch} H{self.heads} D{self.head_dim}: joint "
                f"{self.video + self.action}x{self.video + self.action}, text {self.video}x{self.text} and "
                f"{self.action}x{self.text}")


OPENWAM = BlockShape(batch=4, heads=24, head_dim=128, video=360, action=32, text=64, layers=2)
SELFTEST = BlockShape(batch=2, heads=2, head_dim=16, video=20, action=4, text=8, layers=2)

# ------------------------------------------------------------------------ block


def attention(q, k, v, mask):
    # Looked up at call time, so openwam_sdpa.patch() reaches it, in the recomputation too.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend(q, k, v, mask):
    return checkpoint(attention, q, k, v, mask, use_reentrant=False)


class Layer(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm_joint, self.norm_text = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.q_text, self.kv_text = nn.Linear(width, width), nn.Linear(width, 2 * width)
        self.out_text = nn.Linear(width, width)

    def heads_of(self, x, n):
        """n [B,H,S,D] views of a packed [B,S,n*H*D] projection."""
        b, s, _ = x.shape
        return x.view(b, s, n, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x, text, joint_mask, text_mask, video):
        q, k, v = self.heads_of(self.qkv(self.norm_joint(x)), 3)
        x = x + self.out(merge(attend(q, k, v, joint_mask)))
        (q,) = self.heads_of(self.q_text(self.norm_text(x)), 1)
        k, v = self.heads_of(self.kv_text(text), 2)
        o = torch.cat([attend(q[:, :, :video], k, v, text_mask), attend(q[:, :, video:], k, v, text_mask)], dim=2)
        return x + self.out_text(merge(o))


def merge(o):
    """[B,H,S,D] -> [B,S,H*D]."""
    b, h, s, d = o.shape
    return o.transpose(1, 2).reshape(b, s, h * d)


class Block(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.video = shape.video
        self.layers = nn.ModuleList(Layer(shape.heads * shape.head_dim, shape.heads) for _ in range(shape.layers))

    def forward(self, x, text, joint_mask, text_mask):
        for layer in self.layers:
            x = layer(x, text, joint_mask, text_mask, self.video)
        return x


def block_inputs(shape, device, seed):
    """(x, text, joint mask, text mask) and the output's gradient."""
    gen = torch.Generator().manual_seed(seed)
    b, n, width = shape.batch, shape.video + shape.action, shape.heads * shape.head_dim

    def rand(*size):
        return torch.randn(size, generator=gen).to(device=device, dtype=DTYPE)

    joint = torch.zeros(n, n, dtype=torch.bool)
    joint[:, : shape.video] = True  # everyone sees the video keys
    joint[shape.video:, :] = True  # action queries see every key
    joint_mask = joint.expand(b, 1, n, n).contiguous().to(device)
    lengths = torch.randint(max(1, shape.text // 4), shape.text + 1, (b,), generator=gen)
    text_mask = (torch.arange(shape.text)[None, :] < lengths[:, None])[:, None, None, :].to(device)
    return (rand(b, n, width), rand(b, shape.text, width), joint_mask, text_mask), rand(b, n, width)


# ------------------------------------------------------------------ contenders


def contenders(ow, ow_error):
    def patched():
        if ow is None:
            raise RuntimeError(f"openwam_sdpa not importable: {ow_error}")
        return ow.patched()

    stock = timing.Contender(BASE)
    return [stock, timing.Contender("openwam", patched), timing.again(stock)]


def decisions(ow, block, inputs):
    """openwam_sdpa.explain() of each distinct attention call of one forward (grad mode)."""
    seen = {}
    original = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kwargs):
        key = (tuple(q.shape), tuple(k.shape), None if attn_mask is None else tuple(attn_mask.shape))
        if key not in seen:
            try:
                seen[key] = {k_: str(v_) for k_, v_ in ow.explain(q, k, v, attn_mask=attn_mask).items()}
            except Exception as e:  # noqa: BLE001
                seen[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            seen[key].update(q=list(q.shape), k=list(k.shape), mask=None if attn_mask is None else list(key[2]),
                             q_stride=list(q.stride()))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    F.scaled_dot_product_attention = record
    try:
        block(*inputs)
    finally:
        F.scaled_dot_product_attention = original
    return list(seen.values())


def op_profile(step, top):
    """Host time per op of one step: {op: (calls, self CPU µs)} for the `top` ops by self CPU time,
    and the total self CPU µs of every op."""
    from torch.profiler import ProfilerActivity, profile

    step()  # untimed: nothing of the profiler's start-up in the step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"total_self_cpu_us": sum(e.self_cpu_time_total for e in rows),
            "ops": {e.key: [e.count, e.self_cpu_time_total] for e in rows[:top]}}


def run(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SELFTEST if args.selftest else OPENWAM
    ow, ow_error = import_openwam()
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["shape"] = vars(shape).copy()
    result = {"stack": stack_info(ow, ow_error, settings), "settings": settings, "label": shape.label()}
    print(headline(result["stack"]), flush=True)
    t0 = time.time()
    torch.manual_seed(0)
    block = Block(shape).to(device=device, dtype=DTYPE)
    inputs, grad = block_inputs(shape, device, seed=1)

    def step():
        block.zero_grad(set_to_none=True)
        block(*inputs).backward(grad)

    everyone = contenders(ow, ow_error)
    if ow is not None:
        with ow.patched():
            result["decisions"] = decisions(ow, block, inputs)
    for c in everyone:  # warm-up: kernels chosen, plans built, memory cached
        with c.context():
            for _ in range(args.warmup):
                step()
    figures = lambda c: timing.step_figures(step, args.wall_steps, args.host_steps)  # noqa: E731
    runs = timing.paired_rounds(everyone, figures, args.rounds)
    result["runs"] = runs
    result["ratios"] = {c.name: {k: timing.round_ratios(runs, c.name, BASE, k)
                                 for k in ("gpu_ms", "host_ms", "wall_ms")} for c in everyone[1:]}
    result["profiles"] = {}
    for c in everyone[:2]:
        with c.context():
            result["profiles"][c.name] = op_profile(step, args.top_ops)
    result["stack"]["elapsed_s"] = round(time.time() - t0, 1)
    return result


# ---------------------------------------------------------------------- report


def markdown(result):
    runs, ratios = result["runs"], result["ratios"]
    s = result["settings"]
    parts = [f"### Block benchmark: {report.stack_title(result['stack'])}", "",
             f"{result['label']}; bf16, every attention call under torch.utils.checkpoint, a step = forward + "
             f"backward. Paired rounds ({s['rounds']}, the order rotating and reversing) of stock F.sdpa, openwam_sdpa.patch() "
             "and stock again (A/A); per round: GPU busy time of one step (kernels, copies and fills, from the "
             "profiler), host time of a step while a spin kernel holds the GPU (median of "
             f"{s['host_steps']} steps), and wall time per step over "
             f"{s['wall_steps']} back-to-back steps. Ratios: median [min–max] over rounds of the per-round ratio.",
             ""]
    rows = []
    for key, title in (("gpu_ms", "GPU busy ms / step"), ("host_ms", "host ms / step"), ("wall_ms", "wall ms / step")):
        values = runs[BASE][key]
        base = None if None in values else timing.percentile(values, 50)
        rows.append([title, report.num(base), report.spread(ratios["openwam"][key]),
                     report.spread(ratios[f"{BASE}-again"][key])])
    parts += [report.md_table(["per step", "stock", "openwam / stock", "A/A"], rows), ""]
    covered = [c for run in runs.values() for c in run["covered"] if c is not None]
    if covered:
        parts += [f"Spin held the GPU through the host-timed step in {sum(covered)}/{len(covered)} "
                  "measurements (otherwise the host time may include waits for the GPU's queue).", ""]
    if result.get("decisions"):
        parts += ["**Decisions** (openwam_sdpa.explain() for each call pattern of the forward):", "",
                  report.md_table(["q", "k", "mask", "q strides", "PyTorch's choice", "openwam backend", "plan"],
                                  [[d.get("q"), d.get("k"), d.get("mask"), d.get("q_stride"),
                                    d.get("pytorch_choice", d.get("error", "")), d.get("backend", ""),
                                    d.get("plan", "")] for d in result["decisions"]]), ""]
    profiles = result["profiles"]
    names = list(profiles)
    ops = sorted({op for p in profiles.values() for op in p["ops"]},
                 key=lambda op: -max(p["ops"].get(op, [0, 0])[1] for p in profiles.values()))
    head = ["op"] + [f"{n} {what}" for n in names for what in ("calls", "self CPU µs")]
    rows = [[op] + [cell for n in names for cell in profile_cells(profiles[n], op)] for op in ops]
    rows.append(["every op"] + [cell for n in names for cell in ("", f"{profiles[n]['total_self_cpu_us']:.0f}")])
    parts += ["**Host time per op** (one profiled step each, torch.profiler CPU activity; the profiler's own "
              "overhead is in every figure alike):", "", report.md_table(head, rows), ""]
    return "\n".join(parts)


def profile_cells(profile, op):
    calls, us = profile["ops"].get(op, (None, None))
    return [report.num(calls, "{:d}"), report.num(us, "{:.0f}")]


def check_selftest(result, md, out):
    """The outputs of a --selftest run: every round measured, every ratio recomputable from
    the raw figures, the decision of each call pattern and the profiles complete."""
    back = json.loads((out / "block.json").read_text())
    assert back["runs"].keys() == {BASE, "openwam", f"{BASE}-again"}
    for name, run in result["runs"].items():
        assert len(run["wall_ms"]) == result["settings"]["rounds"], name
        assert all(x > 0 for x in run["wall_ms"] + run["host_ms"]), name
    for name in ("openwam", f"{BASE}-again"):
        report.check_round_ratio(result["runs"], result["ratios"][name]["wall_ms"], name, BASE, "wall_ms")
    assert len(report.table_rows(md, "### Block benchmark")) == 3  # GPU, host, wall
    # Three call patterns: the joint self-attention and the two text cross-attentions.
    assert len(result["decisions"]) == 3 and all("error" not in d for d in result["decisions"])
    assert result["profiles"].keys() == {BASE, "openwam"}
    for name, p in result["profiles"].items():
        assert p["ops"] and p["total_self_cpu_us"] > 0, name
    assert len(report.table_rows(md, "**Host time per op**")) == len(
        {op for p in result["profiles"].values() for op in p["ops"]}) + 1  # + the total
    print(f"selftest OK: block rounds, decisions and profiles; wrote {out}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "block"), help="output folder")
    p.add_argument("--rounds", type=int, default=8, help="paired rounds (default 8)")
    p.add_argument("--wall-steps", type=int, default=10, help="back-to-back steps per wall-time figure")
    p.add_argument("--host-steps", type=int, default=7, help="spin-held steps per host-time figure (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender before the rounds")
    p.add_argument("--top-ops", type=int, default=15, help="ops per profile in the host-time-per-op table")
    p.add_argument("--selftest", action="store_true", help="tiny block on the CPU, then check the outputs")
    args = p.parse_args(argv)
    if args.selftest:
        args.rounds, args.wall_steps, args.host_steps, args.warmup = 2, 2, 2, 1
    if min(args.rounds, args.wall_steps, args.host_steps, args.top_ops) < 1 or args.warmup < 0:
        p.error("--rounds, --wall-steps, --host-steps and --top-ops must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    require_device(args.selftest)
    result = run(args)
    md = markdown(result)
    out = Path(args.out)
    files = report.write_outputs(result, out, "block", md)
    print(md)
    if args.selftest:
        check_selftest(result, md, out)
    print(f"wrote {', '.join(files)} under {out}; measured in {result['stack']['elapsed_s']}s")


if __name__ == "__main__":
    main()
