"""Benchmark openwam_sdpa against PyTorch's stock SDPA backends (bf16, training).

Three sections (--sections; all by default: about 3.5 minutes on an H200, estimated):

methods  Per shape x layout x method (sdpa_cases.SHAPES, LAYOUTS, METHOD_NAMES):
         forward, backward and forward+backward time, each as per-call events and
         as device time (timing.py says which is which); peak memory of one
         fwd+bwd; the bytes autograd keeps for backward; openwam_sdpa's decision
         (openwam_sdpa.explain) and whether its forward is bit-identical to stock
         cuDNN's. Every figure also as a ratio to stock cuDNN on the same shape and
         layout. Then the paired timing: openwam_sdpa as shipped (no OPENWAM_SDPA_*
         variable), stock cuDNN and stock cuDNN again in rotating rounds, with the
         host time of every forward and backward call.
shares   The dQ repair's cost as the defect fires more often: adversarial
         inputs with no row, one row per (b,h), 10% and every row affected, on the
         affected key lengths 64, 704 and 4032 at head_dim 128 and 64; paired fwd+bwd
         device time of stock cuDNN, openwam_sdpa at default settings and with
         OPENWAM_SDPA_PAD=always; the non-finite gradients of each.
memory   Peak memory with large materialised masks ([B,H,S,S] bool and additive, a
         broadcast view), openwam_sdpa against F.sdpa.

Per-method failures are recorded, not raised. Asserts nothing about timing.

Run (from the repository root, on a GPU):
    python benchmarks/bench_sdpa.py --out $OUT/bench
    python benchmarks/bench_sdpa.py --quick --out $OUT/bench      # about 1 minute (estimated)
    python benchmarks/bench_sdpa.py --sections shares --share-shapes 704 --head-dims 128
    python benchmarks/bench_sdpa.py --selftest --out /tmp/bench    # CPU, tiny shapes, checks the outputs
Writes bench.json (everything), bench.md (the tables), bench.png (methods:
fwd+bwd ratio to stock cuDNN) and bench_shares.png under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import report
import sdpa_cases as cases
import sdpa_measure as measure
import sdpa_report
from stack import headline, import_openwam, require_device, stack_info

SECTIONS = ("methods", "shares", "memory")


def pick(items, keys, name_of):
    """The items whose name contains one of the comma-separated keys (all when keys is None)."""
    if not keys:
        return list(items)
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    return [x for x in items if any(k in name_of(x) for k in wanted)]


def parse_share(text):
    return float(text) if text[:1].isdigit() else text


def select(args):
    """What this run measures: shapes, layouts, methods, share shapes and memory cases."""
    tiny = args.selftest
    shapes = pick(cases.SELFTEST_SHAPES if tiny else
                  [s for s in cases.SHAPES if not args.quick or s.name in cases.QUICK_SHAPES],
                  args.shapes, lambda s: s.name)
    layouts = [x.strip() for x in args.layouts.split(",")] if args.layouts else \
        (["bshd"] if args.quick else list(cases.LAYOUTS))
    picked = ({m.strip() for m in args.methods.split(",") if m.strip()} | {cases.BASE} if args.methods
              else set(cases.METHOD_NAMES))
    methods = [m for m in cases.METHOD_NAMES if m in picked]
    head_dims = ([int(d) for d in args.head_dims.split(",")] if args.head_dims else
                 list(cases.SELFTEST_SHARE_HEAD_DIMS if tiny else cases.SHARE_HEAD_DIMS[:1 if args.quick else None]))
    base_shapes = cases.SELFTEST_SHARE_SHAPES if tiny else cases.SHARE_SHAPES
    if args.quick and not args.share_shapes:
        base_shapes = [s for s in base_shapes if s.skv == 704]
    share_shapes = [cases.with_head_dim(s, d) for s in pick(base_shapes, args.share_shapes, lambda s: s.name)
                    for d in head_dims]
    memory = pick(cases.SELFTEST_MEMORY_CASES if tiny else
                  [c for c in cases.MEMORY_CASES if not args.quick or c.s == 8192],
                  args.memory_cases, lambda c: c.name)
    bad = [x for x in layouts if x not in cases.LAYOUTS] + sorted(picked - set(cases.METHOD_NAMES))
    bad += [s for s in args.sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"unknown layout, method or section: {bad}")
    empty = [name for name, chosen in (("methods", shapes and layouts), ("shares", share_shapes and args.shares),
                                       ("memory", memory)) if name in args.sections and not chosen]
    if empty:
        raise SystemExit(f"nothing selected for section(s) {empty}: check --shapes, --share-shapes, "
                         "--memory-cases")
    return shapes, layouts, methods, share_shapes, memory


def progress(i, n, case, t0):
    ms = case["methods"]
    base = sdpa_report.figure(ms.get(cases.BASE), "fwdbwd")
    parts = [f"{sdpa_report.short(m)} {sdpa_report.cell(r, 'fwdbwd')}" for m, r in ms.items() if m != cases.BASE]
    print(f"[{i}/{n}] {case['label']} {case['mask']} {case['layout']}: cuDNN fwd+bwd "
          f"{'err' if base is None else f'{base:.3f} ms'} | " + ", ".join(parts)
          + f" | {time.time() - t0:.0f}s", flush=True)
    for m, r in ms.items():
        if "error" in r:
            print(f"    {m}: {r['error'][:200]}", flush=True)


def summarize(result):
    """Add the methods section's summaries to result (in place) and return it."""
    if result.get("cases"):
        result["summary"] = {m: sdpa_report.summarize(result["cases"], m)
                             for m in result["settings"]["methods"] if m != cases.BASE}
        if any("paired" in c for c in result["cases"]):
            result["paired_summary"] = sdpa_report.summarize_paired(result["cases"])
    return result


def run(args):
    """Measure the selected sections; returns the result (also written under args.out as it grows)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes, layouts, names, share_shapes, memory = select(args)
    ow, ow_error = import_openwam()
    every = cases.build_methods(ow, ow_error, device)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(methods=names, dtype="bfloat16", shapes=[s.name for s in shapes], layouts=layouts,
                    share_shapes=[s.name for s in share_shapes], memory_cases=[c.name for c in memory],
                    shares=[str(s) for s in args.shares])
    result = {"stack": stack_info(ow, ow_error, settings), "settings": settings, "cases": [], "shares": [],
              "memory": []}
    print(headline(result["stack"]), flush=True)
    out, t0 = Path(args.out), time.time()

    def save_partial():
        report.write_json({**summarize(result), "partial": True}, out, "bench")

    if "methods" in args.sections:
        methods = [every[n] for n in names]
        contenders = [every[cases.BASE], every["openwam-default"], every["cudnn-again"]]
        jobs = [(s, lay) for s in shapes for lay in layouts]
        for i, (shape, layout) in enumerate(jobs, 1):
            seed = 1000 + (cases.SHAPES + cases.SELFTEST_SHAPES).index(shape)
            result["cases"].append(measure.run_case(ow, methods, contenders, shape, layout, device, seed, args))
            sdpa_report.add_ratios(result["cases"][-1])
            progress(i, len(jobs), result["cases"][-1], t0)
            save_partial()
    if "shares" in args.sections:
        contenders = [every[n] for n in (cases.BASE, *cases.SHARE_NAMES)]
        for i, shape in enumerate(share_shapes, 1):
            entry = measure.run_share_shape(ow, contenders, shape, device, 2000 + i, args)
            result["shares"].append(entry)
            print(f"[shares {i}/{len(share_shapes)}] {shape.label()} {shape.mask_label()}: "
                  + ", ".join(f"{sdpa_report.share_label(k)} "
                              f"{report.spread((c.get('ratios') or {}).get('openwam-default'))}"
                              for k, c in entry["cells"].items())
                  + (f" ERROR {entry['error'][:200]}" if "error" in entry else "")
                  + f" | {time.time() - t0:.0f}s", flush=True)
            save_partial()
    if "memory" in args.sections:
        methods = [every[n] for n in cases.MEMORY_NAMES]
        for i, case in enumerate(memory, 1):
            entry = measure.run_memory_case(ow, methods, case, device, 3000 + i, args.memory_repeats)
            result["memory"].append(entry)
            print(f"[memory {i}/{len(memory)}] {case.label()} {case.mask_label()}: peak MiB "
                  + ", ".join(f"{n} {m.get('peak_mib', m.get('error', '?'))}" for n, m in entry["methods"].items())
                  + f" | {time.time() - t0:.0f}s", flush=True)
            save_partial()
    result["stack"]["elapsed_s"] = round(time.time() - t0, 1)
    return summarize(result)


def write(result, out):
    """bench.json, bench.md, bench.png and bench_shares.png under out; returns the markdown
    and the names of the files written."""
    md = sdpa_report.markdown(result)
    files = report.write_outputs(result, out, "bench", md,
                                 plots=(("", sdpa_report.plot_methods), ("_shares", sdpa_report.plot_shares)))
    return md, files


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="shapes: " + ", ".join(s.name for s in cases.SHAPES))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"),
                   help="output folder (default: benchmarks/out)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--quick", action="store_true",
                   help=f"methods: only {', '.join(cases.QUICK_SHAPES)}, bshd; shares: 704, head_dim 128; "
                        "memory: S=8192")
    p.add_argument("--repeats", type=int, default=30,
                   help="timed repeats per figure of the methods section (default 30; runs A-E2 used 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each timing (default 5)")
    p.add_argument("--shapes", help="comma-separated substrings of shape names, e.g. 392,4096")
    p.add_argument("--layouts", help="comma-separated subset of bshd,bhsd")
    p.add_argument("--methods", help="comma-separated subset of " + ",".join(cases.METHOD_NAMES)
                   + " (cudnn always runs)")
    p.add_argument("--paired-rounds", type=int, default=6,
                   help="rounds of the paired stock / openwam-default / stock-again timing (0: skip)")
    p.add_argument("--paired-repeats", type=int, default=30, help="timed repeats per contender and round")
    p.add_argument("--share-shapes", help="comma-separated substrings of share shape names: "
                   + ", ".join(s.name for s in cases.SHARE_SHAPES))
    p.add_argument("--head-dims", help="head dims of the shares section (default 128,64)")
    p.add_argument("--shares", default=",".join(str(s) for s in cases.SHARES),
                   help="comma-separated subset of none,one_per_head,0.1,all (any share in (0,1) works)")
    p.add_argument("--share-rounds", type=int, default=5, help="paired rounds per shape and share")
    p.add_argument("--share-repeats", type=int, default=20,
                   help="most timed repeats per contender and round (fewer where a call is slow)")
    p.add_argument("--memory-cases", help="comma-separated substrings of memory case names, e.g. 8192,additive")
    p.add_argument("--memory-repeats", type=int, default=3, help="device-time repeats per memory case and method")
    p.add_argument("--selftest", action="store_true",
                   help="run every section on the CPU with tiny shapes and check the outputs (no GPU needed)")
    p.add_argument("--render", metavar="BENCH_JSON",
                   help="only write bench.md and the plots from a bench.json (a run cut short leaves a partial one)")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.shares = [parse_share(s.strip()) for s in args.shares.split(",") if s.strip()]
    if args.selftest:
        args.repeats, args.warmup, args.paired_rounds, args.paired_repeats = 3, 1, 3, 3
        args.share_rounds, args.share_repeats, args.memory_repeats = 2, 3, 2
    if min(args.repeats, args.paired_repeats, args.share_rounds, args.share_repeats, args.memory_repeats) < 1 \
            or args.warmup < 0 or args.paired_rounds < 0:
        p.error("repeats and rounds must be >= 1 (--paired-rounds >= 0), --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:  # tables and plots of an earlier (maybe partial) run, on any machine
        md, files = write(summarize(json.loads(Path(args.render).read_text())), Path(args.out))
        print(md)
        print(f"wrote {', '.join(files)} under {args.out}")
        return
    require_device(args.selftest)
    result = run(args)
    md, files = write(result, Path(args.out))
    print()
    print(md)
    if result.get("summary", {}).get("openwam-auto"):
        print(sdpa_report.summary_line("openwam auto", result["summary"]["openwam-auto"]))
    if result.get("paired_summary"):
        print(sdpa_report.paired_summary_line(result["paired_summary"]))
        print(sdpa_report.host_summary_line(result["paired_summary"]))
    if args.selftest:
        import selftest
        selftest.check_sdpa(result, md, Path(args.out), args)
    print(f"wrote {', '.join(files)} under {args.out}; measured in {result['stack']['elapsed_s']}s")


if __name__ == "__main__":
    main()
