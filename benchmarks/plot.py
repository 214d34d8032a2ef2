"""The tables and plots of docs/performance.md, made from the benchmarks' result files.

    python benchmarks/plot.py --file sdpa=benchmarks/out/sdpa/sdpa.json --out docs/assets
    python benchmarks/plot.py --ref 1a239f8 --out /tmp/plots     # the older runs kept in git history

Each input is one JSON file a benchmark or tool wrote under its --out:

  sdpa     bench_sdpa.py                     the op against stock: its tables, and adversarial.png
  model    bench_model.py                    training steps of Hugging Face models, and model.png
  block    bench_block.py                    the OpenWAM-shaped block
  suite    tests/gpu (gpu_suite_results.json)
  pytorch  tools/pytorch_sdpa_tests.py       one JSON per sample (repeat the role)
  sweep    tools/sweep_single_query_row.py
  dist     tools/train_distributed.py

--ref REF reads the raw result files kept in git history (DEFAULTS: the newest of each
at commit 1a239f8, whose benchmarks/results/ holds every run before; bench_sdpa.py's
format is newer than those); --file ROLE=PATH reads a file on disk instead, for one role.
Roles without a file are left out.

Prints the markdown tables to stdout and writes the PNGs under --out (small: 100 dpi).
Needs matplotlib for the plots only: without it, the tables still print.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sdpa  # noqa: E402  (benchmarks/bench_sdpa.py: its tables)
import report  # noqa: E402  (benchmarks/report.py)
from timing import percentile  # noqa: E402

R = "benchmarks/results/"
DEFAULTS = {
    "sdpa": [],
    "model": [R + "model_2026-11-30_h200_evening.json"],
    "block": [R + "block_2026-11-30_h200_evening.json"],
    "suite": [R + "gpu_suite_2026-12-02_h200_u4_main_full.json"],
    "pytorch": [R + "pytorch_sdpa_tests_2026-12-01_h200_p3.json",
                R + "pytorch_sdpa_tests_2026-12-02_h200_q5_seed1.json",
                R + "pytorch_sdpa_tests_2026-12-02_h200_r7_seed2.json",
                R + "pytorch_sdpa_tests_2026-12-01_cpu.json"],
    "sweep": [R + "sweep_sq1_2026-11-30_h200.json"],
    "dist": [R + "dist_2026-11-30_h200x2.json"],
}


def r2(x):
    return report.num(x, "{:.3f}")


def med(ratios, name, key=None):
    """The median of a paired ratio, None where the run has none (a CPU selftest)."""
    r = ratios.get(name) or {}
    r = (r.get(key) or {}) if key else r
    return r.get("median")


def median(xs):
    xs = [x for x in xs or [] if x is not None]
    return percentile(xs, 50) if xs else None


def nan_if_none(x):
    return float("nan") if x is None else x


def signed(x):
    return report.DASH if x is None else f"{x:+.1f}"


# ------------------------------------------------------------------ tables


def model_table(res):
    rows = []
    for c in res["configs"]:
        ratios, first = c["ratios"], c["first_step"]
        stock_gpu = median(c["runs"]["sdpa"]["gpu_ms"])
        rows.append([c["size"], c["mode"], f"{c['batch']}x{c['seq']}", c["padding"], report.num(stock_gpu, "{:.1f}"),
                     r2(med(ratios, "openwam_sdpa", "gpu_ms")), r2(med(ratios, "openwam_sdpa", "wall_ms")),
                     r2(med(ratios, "sdpa-no-cudnn", "gpu_ms")),
                     f"{first['sdpa']['nonfinite_grads']:,} / {first['openwam_sdpa']['nonfinite_grads']}"])
    return report.md_table(["model", "mode", "batch", "padding", "stock GPU ms", "openwam GPU",
                            "openwam wall", "no cuDNN GPU", "non-finite grads stock / openwam"], rows)


def block_table(res):
    rows = [[what, r2(med(res["ratios"], "openwam", key)), r2(med(res["ratios"], "stock-again", key))]
            for what, key in (("GPU busy", "gpu_ms"), ("host", "host_ms"), ("wall", "wall_ms"))]
    return report.md_table(["per step", "openwam / stock", "A/A"], rows)


def suite_table(res):
    o = res["outcomes"]
    return report.md_table(["passed", "failed", "skipped"],
                           [[o.get("passed", 0), len(res["failed"]), o.get("skipped", 0)]])


def pytorch_table(results):
    rows = []
    for res in results:
        env, sel, runs = res["environment"], res["selection"], res["runs"]
        what = f"{sel['chosen']} of the CUDA classes, seed {sel['seed']}" if env["device"] == "cuda" \
            else f"all {sel['chosen']} of the CPU classes"
        plain, patched = runs["plain"]["counts"], runs["patched"]["counts"]
        rows.append([f"{env.get('gpu') or 'CPU'}, torch {env['torch']}", what,
                     f"{plain['passed']} / {patched['passed']}",
                     sum(f["count"] for f in res["fail_in_both"]), plain["skipped"], len(res["patched_only"])])
    return report.md_table(["device", "tests", "passed plain / patched", "failed in both", "skipped",
                            "fail only when patched"], rows)


def sweep_table(res):
    return report.md_table(["cells", "stock: non-finite dK/dV", "openwam_sdpa: non-finite"],
                           [[res["cells_total"], res["failing"], res["openwam_nonfinite_cells"]]])


def dist_table(res):
    rows = []
    for mode, r in res["results"].items():
        rows.append([mode, sum(r["nonfinite_grad_elements"]),
                     report.num(r.get("max_rel_diff_losses"), "{:.1e}"), r["verdict"]])
    return report.md_table(["mode (2 GPUs)", "non-finite grad elements", "max rel. diff of losses", "verdict"],
                           rows)


TABLES = {"sdpa": bench_sdpa.markdown, "model": model_table, "block": block_table, "suite": suite_table,
          "sweep": sweep_table, "dist": dist_table}


# ------------------------------------------------------------------ plots


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (the PNGs are then skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plots skipped: {e}")
        return None
    return plt


def save(fig, path):
    """A small PNG (100 dpi) for docs/assets."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_adversarial(res, path):
    """fwd+bwd time / stock by share of affected rows, a line per shape and mask."""
    plt = pyplot()
    cells = [e for e in res.get("adversarial", []) if "ratios" in e]
    if plt is None or not cells:
        return
    shares = list(dict.fromkeys(e["share"] for e in cells))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for label in dict.fromkeys(f"{e['label']} {e['case']['mask']}" for e in cells):
        line = {e["share"]: e for e in cells if f"{e['label']} {e['case']['mask']}" == label}
        ax.plot(range(len(shares)), [nan_if_none(med(line[k]["ratios"], "openwam", "fwdbwd_ms")) if k in line
                                     else float("nan") for k in shares], marker="o", label=label)
    ax.set_xticks(range(len(shares)), [bench_sdpa.SHARE_LABELS.get(k, k) for k in shares])
    ax.set_xlabel("affected query rows (logsumexp far below -88.7)")
    ax.set_ylabel("fwd+bwd time / stock")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title("openwam_sdpa at default settings against stock F.sdpa, adversarial inputs", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="B H D s_q x s_kv, mask",
              title_fontsize=7)
    save(fig, path)


def plot_model(res, path):
    plt = pyplot()
    if plt is None:
        return
    configs = res["configs"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.27
    series = [("openwam_sdpa", "gpu_ms", "openwam_sdpa, GPU time"),
              ("openwam_sdpa", "wall_ms", "openwam_sdpa, wall time"),
              ("sdpa-no-cudnn", "gpu_ms", "stock without cuDNN, GPU time")]
    for i, (name, key, label) in enumerate(series):
        ax.bar([x + (i - 1) * width for x in range(len(configs))],
               [nan_if_none(med(c["ratios"], name, key)) for c in configs], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(configs)),
                  [f"{c['size']} {c['mode']}\n{c['batch']}x{c['seq']}\n{c['padding']}" for c in configs],
                  fontsize=6)
    ax.set_ylim(0.8, max(1.8, ax.get_ylim()[1]))
    ax.set_ylabel("time per step / stock sdpa")
    ax.set_title("Qwen2 training steps (stock: NaN gradients on every left-padded batch)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    save(fig, path)


# ------------------------------------------------------------------ inputs


def load(path: str, ref: str | None):
    if ref is None:
        return json.loads(Path(path).read_text())
    text = subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True, text=True).stdout
    return json.loads(text)


def inputs(args):
    """role -> list of parsed JSON files."""
    files = {role: (list(paths) if args.ref else []) for role, paths in DEFAULTS.items()}
    given = {}
    for item in args.file:
        role, sep, path = item.partition("=")
        if not sep or role not in DEFAULTS:
            raise SystemExit(f"plot.py: --file takes ROLE=PATH with ROLE one of {', '.join(DEFAULTS)}; "
                             f"got {item!r}")
        given.setdefault(role, []).append(path)
    out = {}
    for role in DEFAULTS:
        if role in given:
            out[role] = [load(p, None) for p in given[role]]
        elif files[role]:
            out[role] = [load(p, args.ref) for p in files[role]]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", help="read the DEFAULTS result files from this git ref (e.g. 1a239f8)")
    p.add_argument("--file", action="append", default=[], metavar="ROLE=PATH",
                   help="a result file on disk for one role (repeat for several)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "plots",
                   help="folder for the PNGs")
    args = p.parse_args(argv)
    data = inputs(args)
    if not data:
        p.error("nothing to read: give --ref or --file")
    for role, fn in TABLES.items():
        if role in data:
            print(f"### {role}\n\n{fn(data[role][0])}\n")
    if "pytorch" in data:
        print(f"### pytorch\n\n{pytorch_table(data['pytorch'])}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    if "sdpa" in data:
        plot_adversarial(data["sdpa"][0], args.out / "adversarial.png")
    if "model" in data:
        plot_model(data["model"][0], args.out / "model.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
