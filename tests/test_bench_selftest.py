"""The benchmark's output path (ratios, summary, JSON, markdown, PNG) on made-up
numbers: `bench_sdpa.py --selftest` needs no GPU and asserts its own tables.
The timings themselves come from the GPU machine (BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_sdpa.py"


def test_bench_selftest_writes_every_output(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--selftest", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "selftest OK" in r.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    auto = result["summary"]["openwam-auto"]
    assert auto["measured"] == len(result["cases"]) == 18
    assert auto["geomean_fwdbwd_dev_ratio"] is not None and auto["max_fwd_dev_ratio"] is not None
    md = (tmp_path / "bench.md").read_text()
    for title in ("**Forward + backward**", "**Backward only:**", "**Forward only**",
                  "**Forward device time**", "**Forward + backward device time**",
                  "**Paired device time**"):
        assert title in md
    assert "cudnn-again" in md
    paired = result["paired_summary"]
    assert paired["openwam-default"]["measured"] == paired["cudnn-again"]["measured"] == 18
    assert paired["fwd_bit_identical"] == "18/18"
    # The paired cells are medians of per-round ratios: recompute one from the raw times.
    case = result["cases"][0]["paired"]
    ratios = sorted(a / b for a, b in zip(case["ms"]["openwam-default"]["fwd"], case["ms"]["cudnn"]["fwd"]))
    assert abs(case["ratios"]["openwam-default"]["fwd"]["median"] - ratios[len(ratios) // 2]) < 1e-12
