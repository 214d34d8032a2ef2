"""Each benchmark's --selftest: its real code on the CPU with tiny shapes (every
clock falls back to the host clock), then benchmarks/selftest.py's checks of
its tables, summaries and files; and benchmarks/plot.py's tables and plots
made from those files. The timings themselves come from the GPU machine
(docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def selftest(script, out):
    r = subprocess.run([sys.executable, str(BENCHMARKS / script), "--selftest", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "selftest OK" in r.stdout
    return r.stdout


def test_op_benchmark_selftest(tmp_path):
    selftest("bench_sdpa.py", tmp_path)
    result = json.loads((tmp_path / "bench.json").read_text())
    n = len(result["cases"])
    assert n == 6  # 3 tiny shapes x 2 layouts
    assert result["summary"]["openwam-auto"]["measured"] == n
    assert result["paired_summary"]["openwam-default"]["measured"] == n
    assert len(result["shares"]) == 4 and all(len(e["cells"]) == 4 for e in result["shares"])
    assert len(result["memory"]) == 6
    md = (tmp_path / "bench.md").read_text()
    for title in ("**Paired device time**", "**Host time per call**", "**Affected share**",
                  "**Peak memory with large masks**"):
        assert title in md
    check_plot_of_op_benchmark(tmp_path, result)


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


def check_plot_of_op_benchmark(tmp_path, result):
    """plot.py on bench.json: one row per share shape and per methods case, every
    ratio cell a number, and the share plot where matplotlib is installed."""
    bench = tmp_path / "bench.json"
    md, pngs = plot(tmp_path, f"shares={bench}", f"quick={bench}", f"memory={bench}")
    sections = {s.split("\n", 1)[0]: s for s in md.split("### ")[1:]}
    assert set(sections) == {"shares", "quick", "memory"}
    share_rows = [line for line in sections["shares"].splitlines() if line.startswith("| B")]
    assert len(share_rows) == len(result["shares"])
    for row in share_rows:
        ratios = [c.strip() for c in row.strip("|").split("|")][2:]
        assert all(float(c) > 0 for c in ratios), row
    assert f"openwam_sdpa in 0 of {4 * len(result['shares'])}." in sections["shares"]
    assert len([line for line in sections["quick"].splitlines() if line.startswith("| B")]) == len(result["cases"])
    assert pngs == (["shares.png"] if has_matplotlib() else [])


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


def test_host_benchmark_selftest(tmp_path):
    selftest("bench_host.py", tmp_path)
    result = json.loads((tmp_path / "host.json").read_text())
    assert [c["case"]["name"] for c in result["cases"]] == ["tiny"]
    assert set(result["cases"][0]["forward"]["deltas"]) == {"openwam", "entry", "selector", "stock-again"}
    md, _ = plot(tmp_path, f"host={tmp_path / 'host.json'}")
    assert len([line for line in md.splitlines() if line.startswith("| tiny")]) == 1


def test_model_benchmark_selftest(tmp_path):
    pytest.importorskip("transformers")
    selftest("bench_model.py", tmp_path)
    result = json.loads((tmp_path / "model.json").read_text())
    assert [(e["mode"], e["padding"]) for e in result["configs"]] == [
        ("eager", "left"), ("eager", "none"), ("compile", "left")]
    md, pngs = plot(tmp_path, f"model={tmp_path / 'model.json'}")
    assert len([line for line in md.splitlines() if line.startswith("| ")]) == 1 + len(result["configs"])
    assert pngs == (["model.png"] if has_matplotlib() else [])
