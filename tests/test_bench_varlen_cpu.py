"""benchmarks/bench_varlen_model.py --selftest: the padding-free model
benchmark's real code on the CPU with a tiny Llama (every clock falls back to
the host clock, so no figure means anything), then its own checks: every
scenario measured, every contender trained the same sequences to the same
first loss, the varlen contender ran openwam::sdpa_varlen in every layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_varlen_model_benchmark_selftest(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(BENCHMARKS / "bench_varlen_model.py"), "--selftest",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "selftest OK: 2 scenarios" in r.stdout
    result = json.loads((tmp_path / "varlen_model.json").read_text())
    assert [e["scenario"] for e in result["scenarios"]] == ["random", "grouped"]
    assert result["distribution"]["name"] == "lognormal"
    assert (tmp_path / "varlen_model.md").read_text().startswith("### Padding-free training")
