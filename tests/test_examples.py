"""examples/ run on the CPU with tiny sizes, as a user runs them (as
__main__, with command-line flags), printing a finite loss every step."""

from __future__ import annotations

import math
import pathlib
import re
import runpy
import sys

import pytest

import openwam_sdpa

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
TINY = ["--device", "cpu", "--steps", "3", "--batch", "3", "--seq", "40", "--layers", "1"]
STEP = re.compile(r"^step (\d+): loss (\S+)  grad norm (\S+)$", re.M)


def run_example(name, args, monkeypatch, capsys):
    """(stdout, whether F.sdpa was left patched)."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args])
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
        left_patched = openwam_sdpa.is_patched()
    finally:
        openwam_sdpa.unpatch()
    return capsys.readouterr().out, left_patched


def assert_trains(out, steps=3):
    rows = STEP.findall(out)
    assert [int(s) for s, _, _ in rows] == list(range(steps)), out
    losses = [float(loss) for _, loss, _ in rows]
    assert all(math.isfinite(x) for x in losses), out
    assert all(math.isfinite(float(g)) for _, _, g in rows), out
    assert losses[-1] < losses[0], out  # AdamW on a fixed batch: the loss falls


def test_hf_example(monkeypatch, capsys):
    pytest.importorskip("transformers", reason="examples/train_hf.py needs transformers")
    out, _ = run_example("train_hf.py", [*TINY, "--hidden", "64", "--heads", "2"], monkeypatch, capsys)
    assert out.startswith("openwam_sdpa on cpu:"), out
    assert_trains(out)


@pytest.mark.parametrize("route", ["with", "global"])
def test_patch_example(route, monkeypatch, capsys):
    out, left_patched = run_example(
        "train_patch.py", [*TINY, "--dim", "64", "--heads", "2", "--route", route], monkeypatch, capsys)
    assert out.startswith(f"patch() ({route}) on cpu:"), out
    assert_trains(out)
    # patch() stays on; `with openwam_sdpa.patch():` restores on exit.
    assert left_patched == (route == "global")
