"""Model-level benchmark: full training steps of randomly initialised Hugging Face LMs.

A step is forward, backward and an AdamW step of a Qwen2 causal LM built from a
config (nothing downloaded), bf16 weights:
  30m    4 layers, width 512, 8 heads x 64, vocab 32000 (29M parameters)
  400m   24 layers, width 1024, 8 heads x 128, vocab 32000 (398M parameters)
on a batch of 8 x 704 or 2 x 4032 tokens, left-padded (sequence b loses its first
b * S / (4 B) tokens to padding, so the first sequence is full) or unpadded
(transformers then passes is_causal and no mask). Three attention implementations:
  sdpa             stock F.scaled_dot_product_attention (PyTorch's default backend,
                   cuDNN on an H100/H200 with torch 2.11+)
  openwam_sdpa     the op, at default settings
  sdpa-no-cudnn    stock with cuDNN excluded (sdpa_kernel inside the attention call)
each eager and with every decoder layer compiled (torch.compile, dynamic=False, as
torchtitan-style training compiles per block), plus sdpa again (the A/A control).

Each configuration starts every model from the same initial weights and a fresh
optimizer. The first step records the non-finite gradient elements (stock sdpa on
a left-padded batch gives NaN where the stack is affected: its timing still
counts, and the NaN spreads to every weight) and how long it took (compilation).
Then peak memory of one step and two sets of paired rounds (timing.paired_rounds, the
order of the four contenders rotating and reversing: ABCD, DCBA, BCDA, ADCB, ...):
  wall   --rounds rounds; in each, every contender runs one untimed step, then
         --wall-steps steps timed one by one, synchronised before and after each
         (timing.synced_steps_ms says why), the collector held off; its figure is
         their median. The steps of 30m models are host-bound (GPU 8 ms of 21), so
         3-step back-to-back windows read the A/A control from 0.82x to 1.18x.
  GPU    --gpu-rounds rounds, after the wall rounds so that no profiler runs among
         them: GPU busy time of one step (profiler) and host time of one step while
         a spin kernel holds the GPU.
A ratio is the median over rounds of the per-round ratio to stock sdpa. Targets: openwam_sdpa at most 1.02x stock's GPU time and 1.03x its wall time.

Run (from the repository root, on a GPU). Duration of the default run, estimated from
the step times of an H200 run (one step of each of the four contenders, summed over
the ten configurations: 2.1 s): wall rounds 8 x (1 + 7) x 2.1 s
= 136 s, GPU rounds about 3 x 12 s = 36 s, first steps with compilation 27 s, start,
model building and warm-up about 30 s: about 4 minutes (--wall-only: about 3.3).
    python benchmarks/bench_model.py --out $OUT/model
    python benchmarks/bench_model.py --wall-only --rounds 12 --sizes 30m   # wall time only, more rounds
    python benchmarks/bench_model.py --sizes 400m --lengths 4032 --modes eager
    python benchmarks/bench_model.py --compile-sizes 30m,400m --compile-paddings left,none   # every compile
    python benchmarks/bench_model.py --selftest --out /tmp/model     # CPU, tiny model, checks the outputs
Writes model.json and model.md under --out (plot.py draws model.png from model.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import report
import timing
from hf_training import NO_CUDNN, register_no_cudnn, trainer, wall_figure
from stack import headline, import_openwam, openwam_settings, require_device, stack_info

DTYPE = torch.bfloat16
BASE = "sdpa"

SIZES = {
    "30m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8),
    "400m": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),  # selftest
}
VOCAB = {"30m": 32000, "400m": 32000, "tiny": 256}
BATCH = {704: 8, 4032: 2, 40: 2}  # sequence length -> batch size (40: selftest)
PADDINGS = ("left", "none")
MODES = ("eager", "compile")


def model_config(size):
    from transformers import Qwen2Config

    cfg = SIZES[size]
    return Qwen2Config(vocab_size=VOCAB[size], num_key_value_heads=cfg["num_attention_heads"],
                       max_position_embeddings=8192, tie_word_embeddings=True, use_cache=False, **cfg)


def build_model(size, attn, device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(model_config(size), attn_implementation=attn, dtype=DTYPE)


def make_batch(size, seq, padding, device):
    """The model's keyword arguments input_ids, attention_mask (None without padding) and
    labels: sequence b of a left-padded batch starts with b * seq // (4 * batch) padding
    tokens (label -100)."""
    b = BATCH[seq]
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, VOCAB[size], (b, seq), generator=gen)
    if padding == "none":
        return dict(input_ids=ids.to(device), attention_mask=None, labels=ids.to(device))
    pad = [i * seq // (4 * b) for i in range(b)]
    mask = torch.ones(b, seq, dtype=torch.long)
    for i, p in enumerate(pad):
        mask[i, :p] = 0
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device),
                labels=ids.masked_fill(mask == 0, -100).to(device))


@dataclass
class Contender:
    """One attention implementation's model in a configuration: step() trains it one step."""

    name: str
    context: Callable
    model: object
    step: Callable = None


def contenders_for(models):
    """sdpa, openwam_sdpa (at default settings) and sdpa without cuDNN, each with its model."""
    return [Contender(BASE, contextlib.nullcontext, models["sdpa"]),
            Contender("openwam_sdpa", openwam_settings, models["openwam_sdpa"]),
            Contender("sdpa-no-cudnn", contextlib.nullcontext, models[NO_CUDNN])]


def gpu_figures(step, spin_ms):
    """gpu_ms: GPU busy time of one step; host_ms: host time of one step while a spin of spin_ms
    holds the GPU (covered: the spin still ran when the step returned). One untimed step first,
    after the previous contender's."""
    step()
    host, covered = timing.host_ms(step, spin_ms)
    return {"host_ms": host, "covered": covered, "gpu_ms": timing.busy_ms(step)}


def run_config(models, init, size, mode, seq, padding, device, args):
    """One configuration: first steps, warm-up, peak memory, then the paired rounds."""
    entry = {"size": size, "mode": mode, "seq": seq, "batch": BATCH[seq], "padding": padding,
             "first_step": {}, "peak_mib": {}}
    try:
        batch = make_batch(size, seq, padding, device)
        contenders = contenders_for(models)
        last_losses = {}
        for c in contenders:
            c.model.load_state_dict(init)
            c.step, first_step, last_losses[c.name] = trainer(c.model, batch, lr=1e-4)
            with c.context():
                t0 = time.perf_counter()
                bad = first_step()
                first = {"nonfinite_grads": bad, "loss": float(last_losses[c.name][-1]),
                         "seconds": round(time.perf_counter() - t0, 2)}
                for _ in range(args.warmup - 1):
                    c.step()
                entry["peak_mib"][c.name] = timing.peak_mib(c.step)
            entry["first_step"][c.name] = first
        everyone = contenders + [timing.again(contenders[0])]
        with timing.frozen_heap():
            walls = timing.paired_rounds(everyone, lambda c: wall_figure(c.step, args.wall_steps), args.rounds)
        # The spin that holds the GPU for host_ms must outlast a step: 1.5 times its wall time.
        spin_ms = {n: max(timing.SPIN_MIN_MS, 1.5 * timing.percentile(w["wall_ms"], 50)) for n, w in walls.items()}
        gpus = timing.paired_rounds(everyone, lambda c: gpu_figures(c.step, spin_ms[c.name]), args.gpu_rounds)
        runs = {n: {**gpus[n], **walls[n]} for n in walls}
        entry["runs"] = runs
        entry["ratios"] = {c.name: {k: timing.round_ratios(runs, c.name, BASE, k)
                                    for k in ("gpu_ms", "host_ms", "wall_ms")} for c in everyone[1:]}
        entry["loss_finite_at_end"] = {n: bool(torch.isfinite(v[-1]).item()) for n, v in last_losses.items()}
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record and go on
        entry["error"] = f"{type(e).__name__}: {e}"[:600]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return entry


def grid(args):
    """(size, mode, seq, padding) in run order: per size, eager first, then compiled."""
    out = []
    for size in args.sizes:
        for mode in args.modes:
            for seq in args.lengths:
                for padding in args.paddings:
                    if mode == "compile" and (size not in args.compile_sizes or padding not in args.compile_paddings):
                        continue
                    out.append((size, mode, seq, padding))
    return out


def run(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ow, ow_error = import_openwam()  # registers "openwam_sdpa" with transformers
    if ow is None:
        raise SystemExit(f"openwam_sdpa not importable: {ow_error}")
    register_no_cudnn()
    dynamo = torch._dynamo.config  # one graph per configuration and model: more than the default 8
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), 64))
            break
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"stack": stack_info(ow, ow_error, settings), "settings": settings, "configs": []}
    print(headline(result["stack"]), flush=True)
    t0 = time.time()
    jobs = grid(args)
    for size in args.sizes:
        models = {attn: build_model(size, attn, device) for attn in ("sdpa", "openwam_sdpa", NO_CUDNN)}
        result.setdefault("parameters", {})[size] = sum(p.numel() for p in models["sdpa"].parameters())
        init = {k: v.clone() for k, v in models["sdpa"].state_dict().items()}
        compiled = False
        for job in [j for j in jobs if j[0] == size]:
            if job[1] == "compile" and not compiled:
                for model in models.values():
                    for layer in model.model.layers:
                        layer.compile(backend=args.compile_backend, dynamic=False)
                compiled = True
            entry = run_config(models, init, *job, device, args)
            result["configs"].append(entry)
            print(f"[{len(result['configs'])}/{len(jobs)}] {size} {job[1]} {BATCH[job[2]]}x{job[2]} {job[3]}: "
                  + summary_of(entry) + f" | {time.time() - t0:.0f}s", flush=True)
            report.write_json({**result, "partial": True}, Path(args.out), "model")
        del models, init
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["stack"]["elapsed_s"] = round(time.time() - t0, 1)
    return result


# ---------------------------------------------------------------------- report

NAMES = ("openwam_sdpa", "sdpa-no-cudnn", f"{BASE}-again")
SHORT = {"openwam_sdpa": "openwam", "sdpa-no-cudnn": "no cuDNN", f"{BASE}-again": "A/A"}


def summary_of(entry):
    if "error" in entry:
        return "ERROR " + entry["error"][:200]
    r, aa = entry["ratios"]["openwam_sdpa"], entry["ratios"][f"{BASE}-again"]
    return (f"openwam / sdpa: GPU {report.spread(r['gpu_ms'])}, wall {report.spread(r['wall_ms'])} "
            f"(A/A {report.spread(aa['wall_ms'])}); non-finite "
            + ", ".join(f"{n} {f['nonfinite_grads']}" for n, f in entry["first_step"].items()))


def median_of(runs, name, key):
    values = runs[name].get(key)
    return None if not values or None in values else timing.percentile(values, 50)


def config_table(configs):
    head = ["model", "mode", "batch", "padding", "sdpa GPU ms"] + [f"{SHORT[n]} GPU" for n in NAMES]
    head += ["sdpa wall ms"] + [f"{SHORT[n]} wall" for n in NAMES]
    head += ["host ms sdpa / openwam", "peak MiB sdpa / openwam / no cuDNN",
             "non-finite grads, 1st step: sdpa / openwam / no cuDNN", "loss finite at end",
             "1st step s sdpa / openwam / no cuDNN"]
    rows = []
    for e in configs:
        row = [e["size"], e["mode"], f"{e['batch']}x{e['seq']}", e["padding"]]
        if "error" in e:
            rows.append(row + [e["error"][:80]] + [report.DASH] * (len(head) - 5))
            continue
        runs, r = e["runs"], e["ratios"]
        names3 = (BASE, "openwam_sdpa", "sdpa-no-cudnn")
        row += [report.num(median_of(runs, BASE, "gpu_ms"))] + [report.spread(r[n]["gpu_ms"]) for n in NAMES]
        row += [report.num(median_of(runs, BASE, "wall_ms"))] + [report.spread(r[n]["wall_ms"]) for n in NAMES]
        row += [" / ".join(report.num(median_of(runs, n, "host_ms"), "{:.1f}") for n in names3[:2]),
                " / ".join(report.num(e["peak_mib"].get(n), "{:.0f}") for n in names3),
                " / ".join(str(e["first_step"][n]["nonfinite_grads"]) for n in names3),
                " / ".join("yes" if e["loss_finite_at_end"][n] else "NO" for n in names3),
                " / ".join(f"{e['first_step'][n]['seconds']:.1f}" for n in names3)]
        rows.append(row)
    return report.md_table(head, rows)


def targets(configs):
    """Over the configurations, GPU and wall: the worst (largest) openwam_sdpa / sdpa median ratio,
    and the A/A median ratio farthest from 1 either way (0.9 is as much noise as 1.1)."""
    out = {}
    for name in ("openwam_sdpa", f"{BASE}-again"):
        worst = max if name == "openwam_sdpa" else (lambda vals: max(vals, key=lambda v: abs(math.log(v[0]))))
        for key in ("gpu_ms", "wall_ms"):
            vals = [((e["ratios"][name][key] or {}).get("median"), f"{e['size']} {e['mode']} {e['seq']} {e['padding']}")
                    for e in configs if "ratios" in e]
            vals = [v for v in vals if v[0] is not None]
            out[f"{name} {key}"] = worst(vals) if vals else (None, None)
    return out


def method_text(s):
    """How the figures were measured, from the run's settings (an older json: back-to-back wall windows)."""
    if "gpu_rounds" not in s:
        return (f"Paired rounds ({s['rounds']}, the order rotating and reversing) of sdpa, openwam_sdpa, sdpa without cuDNN and "
                "sdpa again (A/A), from the same initial weights; per round: GPU busy time of one step (kernels, "
                "copies and fills, from the profiler), host time of one step while a spin kernel holds the GPU, "
                f"wall time per step over {s['wall_steps']} back-to-back steps.")
    n = s["gpu_rounds"]
    gpu = (f"Then {n} further paired round{'s' * (n != 1)}, the same order: GPU busy time of one step "
           "(kernels, copies and fills, from the profiler) and host time of one step while a spin kernel holds "
           "the GPU." if n else "GPU and host time not measured (--wall-only).")
    return ("Contenders: sdpa, openwam_sdpa, sdpa without cuDNN and sdpa again (A/A: stock measured twice, its "
            "distance from 1 is the noise floor), from the same initial weights. Wall time: "
            f"{s['rounds']} paired rounds, the order rotating and reversing (ABCD, DCBA, BCDA, ADCB, ...); in each round every contender "
            f"runs one untimed step, then {s['wall_steps']} steps timed one by one on the host clock, "
            "torch.cuda.synchronize() before and after each, Python's garbage collector held off; its wall figure "
            f"for the round is the median of those {s['wall_steps']} steps. " + gpu)


def markdown(result):
    s = result["settings"]
    params = ", ".join(f"{k} {v / 1e6:.1f}M parameters" for k, v in result.get("parameters", {}).items())
    t = targets(result["configs"])
    f = lambda x: report.num(x[0]) + (f" ({x[1]})" if x[1] else "")  # noqa: E731
    parts = [f"### Model benchmark: {report.stack_title(result['stack'])}, transformers "
             f"{result['stack'].get('transformers')}", "",
             f"Randomly initialised Qwen2 causal LMs ({params}), bf16 weights, a step = forward + backward + "
             f"AdamW (fused on CUDA). Compile: every decoder layer torch.compile'd (backend "
             f"{s['compile_backend']}, dynamic=False). Left padding: sequence b starts with b·S/(4B) padding "
             f"tokens. {method_text(s)} Ratios to sdpa: median [min–max] over rounds of the per-round ratio; "
             "sdpa's ms: the median over rounds of its figure. Peak memory: MiB requested (timing.peak_mib) "
             "above the model, its gradients and optimizer state during one step. Non-finite grads: "
             "elements of every parameter's gradient after the first backward (stock's NaN on left-padded "
             "batches is the defect; the NaN then reaches every weight, and the timing still counts). "
             "1st step s: its wall time, compilation included.", "",
             config_table(result["configs"]), "",
             f"- targets: openwam_sdpa / sdpa GPU time at most 1.02: worst {f(t['openwam_sdpa gpu_ms'])}; "
             f"wall time at most 1.03: worst {f(t['openwam_sdpa wall_ms'])}. A/A control, farthest from 1: GPU "
             f"{f(t[f'{BASE}-again gpu_ms'])}, wall {f(t[f'{BASE}-again wall_ms'])}", ""]
    return "\n".join(parts)


def check_selftest(result, md, out, args):
    """The outputs of a --selftest run: every configuration of the grid measured, the same first
    loss and finite gradients for every contender (the CPU has no cuDNN defect), every round's
    wall figure the median of its steps, every ratio recomputable from the raw figures."""
    back = json.loads((out / "model.json").read_text())
    assert markdown(back) == md, "--render of model.json must give the same table"
    configs = result["configs"]
    assert [(e["size"], e["mode"], e["seq"], e["padding"]) for e in configs] == grid(args)
    assert {e["mode"] for e in configs} == {"eager", "compile"}
    assert len(report.table_rows(md, "### Model benchmark")) == len(configs)
    for e in configs:
        name = f"{e['size']} {e['mode']} {e['seq']} {e['padding']}"
        assert "error" not in e, (name, e["error"])
        first = e["first_step"]
        assert all(f["nonfinite_grads"] == 0 for f in first.values()), (name, first)
        assert all(e["loss_finite_at_end"].values()), name
        for other in ("openwam_sdpa", "sdpa-no-cudnn"):
            assert abs(first[other]["loss"] - first[BASE]["loss"]) <= 1e-2 * abs(first[BASE]["loss"]), (name, first)
        for who, run in e["runs"].items():
            assert len(run["wall_ms"]) == len(run["wall_steps_ms"]) == args.rounds, (name, who)
            for figure, steps in zip(run["wall_ms"], run["wall_steps_ms"]):
                assert len(steps) == args.wall_steps and figure == timing.percentile(steps, 50), (name, who)
            assert len(run.get("gpu_ms", [])) == len(run.get("host_ms", [])) == args.gpu_rounds, (name, who)
        for other in ("openwam_sdpa", f"{BASE}-again"):
            report.check_round_ratio(e["runs"], e["ratios"][other]["wall_ms"], other, BASE, "wall_ms")
    assert f"the median of those {args.wall_steps} steps" in md, "model.md must say how wall time is measured"
    print(f"selftest OK: {len(configs)} model configurations; wrote {out}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "model"), help="output folder")
    p.add_argument("--sizes", default="30m,400m", help="comma-separated subset of 30m,400m")
    p.add_argument("--lengths", default="704,4032", help="sequence lengths (batch 8 at 704, 2 at 4032)")
    p.add_argument("--paddings", default="left,none", help="comma-separated subset of left,none")
    p.add_argument("--modes", default="eager,compile", help="comma-separated subset of eager,compile")
    p.add_argument("--compile-sizes", default="30m", help="sizes also run compiled (compilation takes the time)")
    p.add_argument("--compile-paddings", default="left", help="paddings also run compiled")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--rounds", type=int, default=8, help="paired wall-time rounds per configuration (4 contenders: "
                   "a multiple of 8 puts each in every position, and every pair in both orders, "
                   "equally often)")
    p.add_argument("--wall-steps", type=int, default=7, help="steps timed one by one per wall-time figure (its median)")
    p.add_argument("--gpu-rounds", type=int, default=3, help="paired rounds of GPU busy time and host time per "
                   "configuration (profiler; 0 skips them)")
    p.add_argument("--wall-only", action="store_true", help="wall time only: --gpu-rounds 0")
    p.add_argument("--warmup", type=int, default=2, help="steps per model before the rounds (the first is checked)")
    p.add_argument("--selftest", action="store_true", help="tiny model on the CPU, then check the outputs")
    p.add_argument("--render", metavar="MODEL_JSON",
                   help="only write model.md from a model.json (a run cut short leaves a partial one)")
    args = p.parse_args(argv)
    if args.selftest:
        args.sizes, args.lengths, args.compile_sizes = "tiny", "40", "tiny"
        args.compile_backend, args.rounds, args.wall_steps, args.gpu_rounds = "aot_eager", 2, 3, 1
    if args.wall_only:
        args.gpu_rounds = 0
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    args.sizes, args.paddings, args.modes = split(args.sizes), split(args.paddings), split(args.modes)
    args.compile_sizes, args.compile_paddings = split(args.compile_sizes), split(args.compile_paddings)
    args.lengths = [int(x) for x in split(args.lengths)]
    bad = ([s for s in args.sizes + args.compile_sizes if s not in SIZES] + [x for x in args.lengths if x not in BATCH]
           + [x for x in args.paddings + args.compile_paddings if x not in PADDINGS]
           + [m for m in args.modes if m not in MODES])
    if bad:
        p.error(f"unknown size, length, padding or mode: {bad}")
    if min(args.rounds, args.wall_steps, args.warmup) < 1:
        p.error("--rounds, --wall-steps and --warmup must be >= 1")
    if args.gpu_rounds < 0:
        p.error("--gpu-rounds must be >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:  # the table of an earlier (maybe partial) run, on any machine
        result = json.loads(Path(args.render).read_text())
        md = markdown(result)
        files = report.write_outputs(result, Path(args.out), "model", md)
        print(md)
        print(f"wrote {', '.join(files)} under {args.out}")
        return
    require_device(args.selftest)
    result = run(args)
    md = markdown(result)
    out = Path(args.out)
    files = report.write_outputs(result, out, "model", md)
    print(md)
    if args.selftest:
        check_selftest(result, md, out, args)
    print(f"wrote {', '.join(files)} under {out}; measured in {result['stack']['elapsed_s']}s")


if __name__ == "__main__":
    main()
