"""Each benchmark's --selftest: its real code on the CPU with tiny shapes (every
clock falls back to the host clock), then the benchmark's own checks of its
tables, summaries and files; and benchmarks/plot.py's tables and plots made
from those files. The timings themselves come from the GPU machine
(docs/performance.md)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import load_benchmark

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def selftest(script, out):
    r = subprocess.run([sys.executable, str(BENCHMARKS / script), "--selftest", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "selftest OK" in r.stdout
    return r.stdout


def plot(tmp_path, *files):
    """benchmarks/plot.py on ROLE=PATH files: its markdown, and the PNGs it wrote
    (none without matplotlib)."""
    args = [a for f in files for a in ("--file", f)]
    r = subprocess.run([sys.executable, str(BENCHMARKS / "plot.py"), *args, "--out", str(tmp_path / "plots")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, sorted(p.name for p in (tmp_path / "plots").glob("*.png"))


def has_matplotlib():
    return subprocess.run([sys.executable, "-c", "import matplotlib"], capture_output=True).returncode == 0


def test_op_benchmark_selftest(tmp_path):
    selftest("bench_sdpa.py", tmp_path)
    result = json.loads((tmp_path / "sdpa.json").read_text())
    # 4 tiny shapes; 2 adversarial cases x 4 shares; 1 first-call case; 4 shapes + 3 large masks
    assert {s: len(result[s]) for s in ("paired", "adversarial", "host", "first_call", "memory")} == {
        "paired": 4, "adversarial": 8, "host": 4, "first_call": 1, "memory": 7}
    assert [e["share"] for e in result["adversarial"]] == ["none", "one_per_head", "0.1", "all"] * 2
    md, pngs = plot(tmp_path, f"sdpa={tmp_path / 'sdpa.json'}")
    assert md.count("| B") == 4 + 8 + 4 + 1 + 7  # every entry a row in the tables plot.py prints
    assert pngs == (["adversarial.png"] if has_matplotlib() else [])


def test_varlen_attention_benchmark_selftest(tmp_path):
    selftest("bench_varlen_attention.py", tmp_path)
    result = json.loads((tmp_path / "varlen_attention.json").read_text())
    # one token count x (16/16, 16/4 heads) x (causal, not); both engines in every section
    assert len(result["paired"]) == 4
    assert all({"cudnn_ragged", "flash_varlen"} <= set(r["runs"]) for r in result["paired"])
    assert {r["tokens"] for r in result["memory"]} == {r["tokens"] for r in result["paired"]}
    assert set(result["run"]) == {"cudnn_ragged", "flash_varlen"}


def test_a_failed_case_keeps_its_row_and_says_why(tmp_path):
    selftest("bench_sdpa.py", tmp_path)
    bench = load_benchmark("bench_sdpa.py")
    report = load_benchmark("report.py")
    result = json.loads((tmp_path / "sdpa.json").read_text())
    broken = copy.deepcopy(result)
    for section in ("paired", "adversarial", "memory"):
        e = broken[section][0]
        broken[section][0] = {"case": e["case"], "label": e["label"], "error": "RuntimeError: made up here"}
    md = bench.markdown(broken)
    for title, section in (("**Paired device time**", "paired"), ("**Adversarial inputs**", "adversarial"),
                           ("**Peak memory**", "memory")):
        rows = report.table_rows(md, title)
        assert len(rows) == len(result[section])
        assert "RuntimeError: made up here" in rows[0]
    assert "over 3 shapes" in md  # the paired summary leaves the failed shape out


def test_quick_runs_the_named_cases_and_shapes_filters(tmp_path):
    bench = load_benchmark("bench_sdpa.py")
    quick = bench.parse_args(["--quick", "--out", str(tmp_path)])
    for section, names in bench.QUICK.items():
        assert [c.name for c in bench.cases_for(section, quick)] == [
            c.name for c in {"paired": bench.PAIRED, "adversarial": bench.ADVERSARIAL,
                             "first_call": bench.FIRST_CALL}[section] if c.name in names]
        assert len(bench.cases_for(section, quick)) == len(names), section  # no name misspelt
    only = bench.parse_args(["--shapes", "openwam", "--sections", "paired,host", "--out", str(tmp_path)])
    assert all("openwam" in c.name for s in only.sections for c in bench.cases_for(s, only))
    r = subprocess.run([sys.executable, str(BENCHMARKS / "bench_sdpa.py"), "--shapes", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "leaves nothing to run" in r.stderr


def test_plot_refuses_an_unknown_role(tmp_path):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "plot.py"), "--file", "nope=x.json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ROLE=PATH" in r.stderr and "Traceback" not in r.stderr


def test_block_benchmark_selftest(tmp_path):
    selftest("bench_block.py", tmp_path)
    result = json.loads((tmp_path / "block.json").read_text())
    assert set(result["ratios"]) == {"openwam", "stock-again"}
    assert len(result["decisions"]) == 3
    md, _ = plot(tmp_path, f"block={tmp_path / 'block.json'}")
    rows = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ")]
    assert rows == ["per step", "GPU busy", "host", "wall"]


def test_model_benchmark_selftest(tmp_path):
    pytest.importorskip("transformers")
    selftest("bench_model.py", tmp_path)
    result = json.loads((tmp_path / "model.json").read_text())
    assert [(e["mode"], e["padding"]) for e in result["configs"]] == [
        ("eager", "left"), ("eager", "none"), ("compile", "left")]
    md, pngs = plot(tmp_path, f"model={tmp_path / 'model.json'}")
    assert len([line for line in md.splitlines() if line.startswith("| ")]) == 1 + len(result["configs"])
    assert pngs == (["model.png"] if has_matplotlib() else [])


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_paired_order_balances_every_pair(n):
    """Over every two rounds each pair of contenders runs in both orders at the
    same distance, and over 2n rounds each contender takes every position
    equally often: drift within a round cancels in the median of per-round
    ratios. Rotation alone put the contender after the baseline after it in
    two rounds of three (found in review)."""
    timing = load_benchmark("timing.py")
    names = [chr(ord("A") + i) for i in range(n)]
    orders = [timing.paired_order(names, r) for r in range(2 * n)]
    assert all(sorted(o) == names for o in orders)
    for r in range(0, 2 * n, 2):
        for a in names:
            for b in names:
                gap = [o.index(b) - o.index(a) for o in orders[r:r + 2]]
                assert gap[0] == -gap[1], (r, a, b, orders[r:r + 2])
    for name in names:
        assert sorted(o.index(name) for o in orders) == sorted(list(range(n)) * 2)
