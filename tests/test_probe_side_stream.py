"""scripts/probe_side_stream.py (BENCHMARKS.md's runs J1, J3, L5, L7) and
scripts/probe_programmatic_launch.py (runs M1-M2, M6): each probes the share
table's own cells, and without a GPU each says it needs one."""

import os
import subprocess
import sys

import pytest

from support import ROOT, load_script, script_path

PROBES = ("probe_side_stream.py", "probe_programmatic_launch.py")


@pytest.mark.parametrize("name", PROBES)
def test_cells_are_share_table_cells(name):
    """Each probed cell is a shape and head_dim of bench_sdpa's share table
    (benchmarks/sdpa_cases.py), with a mask exactly where the table has one."""
    probe = load_script(name)  # puts benchmarks/ on sys.path
    import sdpa_cases

    table = {(s.b, s.h, s.sq, s.skv, s.mask is not None) for s in sdpa_cases.SHARE_SHAPES}
    assert probe.CELLS
    for B, H, s_q, s_kv, mask, D in probe.CELLS:
        assert (B, H, s_q, s_kv, mask != "none") in table, (B, H, s_q, s_kv, mask)
        assert D in sdpa_cases.SHARE_HEAD_DIMS


@pytest.mark.parametrize("name", PROBES)
def test_needs_a_gpu(name):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, script_path(name)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "needs a CUDA device" in run.stderr

