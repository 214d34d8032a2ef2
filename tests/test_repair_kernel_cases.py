"""tools/repair_kernel_cases.py, the repair kernel's cases for
compute-sanitizer and Nsight Compute (device_run.sh's sanitize and profile
parts): its case lists cover every code path of the kernel and the share
table's shapes, and the script runs without a GPU (it lists, or says it
needs one)."""

import subprocess
import sys

import pytest
import torch

from support import load_tool, tool_path

SCRIPT = tool_path("repair_kernel_cases.py")


def load_cases():
    return load_tool("repair_kernel_cases.py")


def test_small_cases_cover_every_kernel_path():
    """The sanitizer cases: each compiled head_dim width (64, 128, 256) and
    one zero-filled (72), both element types, a key mask, is_causal, BSHD
    storage, and the narrow (one row per head), partial and full tiles; all
    small enough for an instrumented run."""
    cases_module = load_cases()
    cases = cases_module.CASES["small"]
    widths = {64 if c.D <= 64 else 128 if c.D <= 128 else 256 for c in cases}
    assert widths == {64, 128, 256}
    assert any(c.D % 64 != 0 for c in cases)
    assert {c.dtype for c in cases} == {torch.bfloat16, torch.float16}
    assert any(c.mask for c in cases) and any(c.causal for c in cases)
    assert any(c.layout == "bshd" for c in cases)
    assert {str(c.share) for c in cases} == {"one_per_head", "0.1", "all"}
    for c in cases:
        assert c.D % 8 == 0 and c.D <= 256
        assert c.B * c.H * c.s_q * c.s_kv <= 1 << 20, c.label()


def test_bench_cases_are_the_share_tables_shapes():
    cases_module = load_cases()
    shapes = {(c.B, c.H, c.s_q, c.s_kv) for c in cases_module.CASES["bench"]}
    assert shapes == {(16, 24, 704, 704), (32, 24, 360, 64), (4, 24, 4096, 4032)}
    assert all(c.mask == (c.s_kv == 64) for c in cases_module.CASES["bench"])


@pytest.mark.parametrize("cases", ["small", "bench"])
def test_list_prints_one_line_per_case(cases):
    cases_module = load_cases()
    run = subprocess.run([sys.executable, SCRIPT, "--list", "--cases", cases],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [c.label() for c in cases_module.CASES[cases]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so_and_exits_0():
    run = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "needs a CUDA GPU" in run.stdout


def test_match_keeps_one_case_and_refuses_none():
    """--match picks the case that device_run.sh's per-instruction profile
    runs (PROFILE_MATCH's default), and a text that matches nothing is an
    error, not an empty run."""
    run = subprocess.run([sys.executable, SCRIPT, "--list", "--cases", "bench", "--match",
                          "32x24x360x64 one_per_head"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["bf16 d128 32x24x360x64 one_per_head mask bshd"]
    none = subprocess.run([sys.executable, SCRIPT, "--list", "--match", "no such case"],
                          capture_output=True, text=True, timeout=120)
    assert none.returncode == 2 and "no small case matches" in none.stderr
