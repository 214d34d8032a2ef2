"""Attention-only benchmark of sdpa_varlen's fused engines on packed batches: cuDNN's ragged
layout on the frontend's graphs (the default on a measured cuDNN) against ATen's
FlashAttention-2 varlen, bf16, training.

Batches: lognormal lengths (mu = ln 512, sigma = 0.9, clipped to [16, 4096]) drawn until the
pack holds --tokens real tokens (4,096, 8,192 and 16,384); 16 query heads x 128 over 16 and
4 key/value heads; causal and not. Sections (--sections; all by default):

  paired   forward+backward device time in paired rounds (timing.paired_rounds, the order
           rotating and reversing), each contender under its OPENWAM_SDPA_VARLEN setting, plus FlashAttention-2
           again (the A/A control); ratio: flash's time over cuDNN's (the speed-up).
  memory   peak memory of one forward+backward above the inputs.
  run      --steps fresh lognormal batches of about 8,192 tokens, one forward+backward each,
           from an empty graph cache: ragged graphs built, wall ms of the first step, of the
           steps that built a graph and of the rest (steady state), each engine.

    python benchmarks/bench_varlen_attention.py --out $OUT/varlen_attention   # ~1 minute, H200
    python benchmarks/bench_varlen_attention.py --selftest --out /tmp/va      # CPU, checks outputs
Writes varlen_attention.json and varlen_attention.md under --out.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from pathlib import Path

import torch

import report
import timing
from report import num, spread
from stack import headline, import_openwam, openwam_settings, require_device, stack_info

DTYPE = torch.bfloat16
CUDNN, FLASH = "cudnn_ragged", "flash_varlen"
SETTING = {CUDNN: "cudnn", FLASH: "flash"}
SECTIONS = ("paired", "memory", "run")


def lognormal_lengths(tokens, rng, mu=math.log(512), sigma=0.9, lo=16, hi=4096):
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(max(lo, min(hi, round(math.exp(rng.gauss(mu, sigma))), tokens - sum(lengths))))
    return lengths


def packed(lengths, heads, kv_heads, head_dim, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(lengths)

    def t(h):
        return torch.randn(total, h, head_dim, generator=g).to(device, dtype).requires_grad_()

    q, k, v = t(heads), t(kv_heads), t(kv_heads)
    go = torch.randn(total, heads, head_dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return q, k, v, go, cu, max(lengths)


def step_fn(ow, batch, causal):
    q, k, v, go, cu, longest = batch

    def step(_=None):
        out = ow.varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=causal,
                             enable_gqa=q.shape[1] != k.shape[1])
        return torch.autograd.grad(out, (q, k, v), go)

    return step


def contender(name):
    return timing.Contender(name, lambda: openwam_settings(VARLEN=SETTING[name.split("-")[0]]))


def engine_of(ow, batch, causal):
    q, k, v, _, cu, longest = batch
    return ow.explain_varlen(q, k, v, cu, cu, longest, longest, is_causal=causal,
                             enable_gqa=q.shape[1] != k.shape[1])["backend"]


def run_paired(ow, args, device):
    rows = []
    for tokens, kv_heads, causal in itertools.product(args.tokens, (16, 4), (False, True)):
        lengths = lognormal_lengths(tokens, random.Random(tokens))
        batch = packed(lengths, 16, kv_heads, 128, device, DTYPE, seed=tokens)
        step = step_fn(ow, batch, causal)
        everyone = [contender(CUDNN), contender(FLASH), timing.again(contender(FLASH))]
        engines = {}
        for c in everyone[:2]:
            with c.context():
                engines[c.name] = engine_of(ow, batch, causal)
        def measure(c):
            # covered: the spin still held the GPU when the last repeat was enqueued, so
            # no host time leaked into either engine's figure
            d = timing.device_ms(step, args.warmup, args.repeats)
            return {"ms": d["median_ms"], "covered": d["covered"]}

        runs = timing.paired_rounds(everyone, measure, args.rounds)
        rows.append({"tokens": sum(lengths), "sequences": len(lengths), "longest": max(lengths),
                     "kv_heads": kv_heads, "causal": causal, "engines": engines, "runs": runs,
                     "speedup": timing.round_ratios(runs, FLASH, CUDNN, "ms"),
                     "aa": timing.round_ratios(runs, f"{FLASH}-again", FLASH, "ms")})
        print(f"paired {rows[-1]['tokens']} tokens kv {kv_heads} causal {causal}: "
              f"{spread(rows[-1]['speedup'])}", flush=True)
    return rows


def run_memory(ow, args, device):
    rows = []
    for tokens in args.tokens:
        batch = packed(lognormal_lengths(tokens, random.Random(tokens)), 16, 16, 128, device, DTYPE)
        step = step_fn(ow, batch, True)
        row = {"tokens": batch[0].shape[0]}
        for name in (CUDNN, FLASH):
            with contender(name).context():
                step()
                row[name] = timing.peak_mib(step)
        rows.append(row)
    return rows


def run_steps(ow, args, device):
    """A run of fresh batches per engine, from an empty graph cache."""
    result = {}
    for name in (CUDNN, FLASH):
        rng = random.Random(7)
        ow.clear_graph_cache()
        ow.frontend_stats(reset=True)
        built, first, building, steady = 0, None, [], []
        with contender(name).context():
            for i in range(args.steps):
                batch = packed(lognormal_lengths(args.run_tokens, rng), 16, 4, 128, device, DTYPE,
                               seed=i)
                ms = timing.once_ms(step_fn(ow, batch, True))
                now = ow.frontend_stats()["ragged_graphs_built"]
                if i == 0:
                    first = ms
                elif now > built:
                    building.append(ms)
                else:
                    steady.append(ms)
                built = now
        result[name] = {"steps": args.steps, "graphs_built": built, "first_step_ms": first,
                        "steps_that_built": len(building),
                        "building_step_ms": timing.percentile(building, 50) if building else None,
                        "steady_step_ms": timing.percentile(steady, 50) if steady else None}
        print(f"run {name}: {result[name]}", flush=True)
    return result


def run(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ow, ow_error = import_openwam()
    if ow is None:
        raise SystemExit(f"openwam_sdpa not importable: {ow_error}")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"stack": stack_info(ow, ow_error, settings), "settings": settings}
    print(headline(result["stack"]), flush=True)
    t0 = time.time()
    sections = {"paired": run_paired, "memory": run_memory, "run": run_steps}
    for name in args.sections:
        try:
            result[name] = sections[name](ow, args, device)
        except Exception as e:  # noqa: BLE001 - recorded, the other sections go on
            result[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
    result["stack"]["elapsed_s"] = round(time.time() - t0, 1)
    return result


def markdown(result):
    out = ["# sdpa_varlen: cuDNN's ragged layout against FlashAttention-2 varlen",
           "", report.stack_title(result["stack"]), ""]
    paired = result.get("paired")
    if isinstance(paired, list):
        out += ["## Forward+backward, paired rounds (device ms, median over rounds)", ""]
        rows = []
        for r in paired:
            med = {n: timing.percentile(v["ms"], 50) for n, v in r["runs"].items()}
            rows.append([f"{r['tokens']:,} ({r['sequences']} seqs, longest {r['longest']})",
                         f"16/{r['kv_heads']}", "yes" if r["causal"] else "no",
                         num(med[CUDNN]), num(med[FLASH]), spread(r["speedup"], "{:.2f}"),
                         spread(r["aa"], "{:.2f}"), r["engines"][CUDNN]])
        out += [report.md_table(["packed tokens", "heads q/kv", "causal", "cuDNN ragged ms",
                                 "FlashAttention-2 ms", "speed-up", "A/A", "engine ran"], rows), ""]
    elif paired:
        out += [f"paired: {paired['error']}", ""]
    memory = result.get("memory")
    if isinstance(memory, list):
        out += ["## Peak memory of one forward+backward (MiB above the inputs)", "",
                report.md_table(["packed tokens", "cuDNN ragged", "FlashAttention-2"],
                                [[f"{r['tokens']:,}", num(r[CUDNN], "{:.1f}"),
                                  num(r[FLASH], "{:.1f}")] for r in memory]), ""]
    steps = result.get("run")
    if isinstance(steps, dict) and "error" not in steps:
        out += ["## A run of fresh lognormal batches (about 8,192 tokens, causal, 16/4 heads)", "",
                report.md_table(
                    ["engine", "steps", "ragged graphs built", "first step ms",
                     "steps that built a graph", "their median ms", "other steps' median ms"],
                    [[n, r["steps"], r["graphs_built"], num(r["first_step_ms"], "{:.1f}"),
                      r["steps_that_built"], num(r["building_step_ms"], "{:.1f}"),
                      num(r["steady_step_ms"], "{:.2f}")] for n, r in steps.items()]), ""]
    elif steps:
        out += [f"run: {steps['error']}", ""]
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "varlen_attention"))
    p.add_argument("--tokens", default="4096,8192,16384",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--sections", default=",".join(SECTIONS), type=lambda s: s.split(","))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--run-tokens", type=int, default=8192, help="tokens per batch of the run")
    p.add_argument("--selftest", action="store_true",
                   help="CPU, tiny: the tables come out (the engines are the CPU reference)")
    args = p.parse_args(argv)
    if args.selftest:
        args.tokens, args.rounds, args.warmup, args.repeats, args.steps = [64], 2, 1, 2, 3
        args.run_tokens = 64
    return args


def main(argv=None):
    args = parse_args(argv)
    require_device(args.selftest)
    result = run(args)
    md = markdown(result)
    files = report.write_outputs(result, args.out, "varlen_attention", md)
    print(md)
    if args.selftest:
        for section in SECTIONS:
            assert "error" not in (result[section] if isinstance(result[section], dict) else {}), \
                result[section]
        assert len(report.table_rows(md, "## Forward+backward")) == 4 * len(args.tokens), md
        assert result["run"][CUDNN]["steps"] == args.steps, result["run"]
        print("selftest OK")
    print(f"wrote {', '.join(files)} under {args.out}; measured in {result['stack']['elapsed_s']}s")


if __name__ == "__main__":
    main()
