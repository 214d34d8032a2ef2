"""Each benchmark's --selftest: its real code on the CPU with tiny shapes (every
clock falls back to the host clock), then benchmarks/selftest.py's checks of
its tables, summaries and files. The timings themselves come from the GPU
machine (BENCHMARKS.md)."""

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


def test_block_benchmark_selftest(tmp_path):
    selftest("bench_block.py", tmp_path)
    result = json.loads((tmp_path / "block.json").read_text())
    assert set(result["ratios"]) == {"openwam", "stock-again"}
    assert len(result["decisions"]) == 3


def test_host_benchmark_selftest(tmp_path):
    selftest("bench_host.py", tmp_path)
    result = json.loads((tmp_path / "host.json").read_text())
    assert [c["case"]["name"] for c in result["cases"]] == ["tiny"]
    assert set(result["cases"][0]["forward"]["deltas"]) == {"openwam", "entry", "selector", "stock-again"}


def test_model_benchmark_selftest(tmp_path):
    pytest.importorskip("transformers")
    selftest("bench_model.py", tmp_path)
    result = json.loads((tmp_path / "model.json").read_text())
    assert [(e["mode"], e["padding"]) for e in result["configs"]] == [
        ("eager", "left"), ("eager", "none"), ("compile", "left")]
