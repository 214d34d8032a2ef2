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


def test_a_contender_out_of_memory_sits_out_its_scenario(tmp_path, monkeypatch):
    """On an H100 (79.2 GiB) the random batch's padded contenders need more memory than
    there is (84,017 MiB at their peak on an H200). The scenario still measures the rest,
    and its table says which did not fit, where the whole scenario had stopped at the
    error."""
    pytest.importorskip("transformers")
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_varlen_model as bench

    real_trainer = bench.trainer

    def trainer(model, batch, lr):
        step, first_step, losses = real_trainer(model, batch, lr)
        if batch["input_ids"].shape[0] > 1:  # a padded batch: [B, longest]
            def first_step():
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return step, first_step, losses

    monkeypatch.setattr(bench, "trainer", trainer)
    args = bench.parse_args(["--selftest", "--out", str(tmp_path), "--scenarios", "random"])
    result = bench.run(args)
    [e] = result["scenarios"]
    assert "error" not in e, e
    padded = [bench.BASE, "padded-no-cudnn"]
    assert e["out_of_memory"] == padded
    assert e["aa_of"] == bench.VARLEN
    assert set(e["speedup"]) == {bench.FLASH, "packed-sdpa", f"{bench.VARLEN}-again"}
    md = bench.markdown(result)
    row = next(line for line in md.splitlines() if line.startswith("| random"))
    assert row.count("out of memory") >= 8, row  # tokens/s, ratio, peak, loss, grads: 2 each
    targets = {t["target"]: t for t in bench.targets(result["scenarios"])}
    # The selftest's packs hold 96 tokens: under the packed-sdpa target's 4,096.
    assert targets["varlen / packed-sdpa >= 1.6 at packs >= 4096 tokens"]["met"] is None
    assert all(t["met"] is None for name, t in targets.items() if "padded-openwam" in name)
