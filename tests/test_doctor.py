"""`python -m openwam_sdpa doctor` on a machine without a GPU, and its verdict
logic on made-up facts (the GPU run is tests/gpu/test_doctor_gpu.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from openwam_sdpa import doctor

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="checks the no-GPU report; tests/gpu/test_doctor_gpu.py covers GPUs")


def run_module(*args):
    return subprocess.run([sys.executable, "-m", "openwam_sdpa", *args], capture_output=True,
                          text=True, timeout=300)


@NO_GPU
def test_doctor_without_gpu_says_what_it_could_not_check():
    r = run_module("doctor")
    assert r.returncode == doctor.EXIT_OK, r.stdout + r.stderr
    assert f"torch            {torch.__version__}" in r.stdout
    assert "not checked: no CUDA GPU" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("verdict: not affected here: no CUDA GPU")


@NO_GPU
def test_doctor_json():
    r = run_module("doctor", "--json")
    assert r.returncode == doctor.EXIT_OK, r.stderr
    facts = json.loads(r.stdout)
    assert facts["torch"] == torch.__version__
    assert facts["gpu"] is None and facts["exit_code"] == doctor.EXIT_OK
    assert facts["not_checked"]


def test_module_without_a_command_prints_usage():
    r = run_module()
    assert r.returncode == 64
    assert "usage: python -m openwam_sdpa doctor" in r.stderr


def gpu_facts(stock=0, ours=0, listed=()):
    return {
        "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn_compiled": 91900, "cudnn_runtime": 91900,
        "built_for_torch": "2.11.0+cu130", "extension_has_cuda": True, "gpu": "H200 (sm90)",
        "not_checked": [], "affected_remainders_d128": list(listed),
        "openwam_plan": {"backend": "cudnn", "plan": "repair_dq"},
        "pytorch_default_backend": "cudnn_attention",
        "adversarial_nonfinite": {
            "stock F.sdpa, bool mask": {"q": stock, "k": 0, "v": 0},
            "openwam_sdpa, bool mask": {"q": ours, "k": 0, "v": 0},
        },
    }


@pytest.mark.parametrize("stock,ours,listed,code,start", [
    (1024, 0, [64], doctor.EXIT_AFFECTED, "AFFECTED: stock SDPA gave 1024"),
    (0, 0, [64], doctor.EXIT_AFFECTED, "AFFECTED: the guard table lists"),
    (0, 0, [], doctor.EXIT_OK, "not affected:"),
    (1024, 3, [64], doctor.EXIT_BROKEN, "BROKEN: openwam_sdpa gave 3"),
    (0, 1, [], doctor.EXIT_BROKEN, "BROKEN"),
])
def test_verdict(stock, ours, listed, code, start):
    line, got = doctor.verdict(gpu_facts(stock, ours, listed))
    assert got == code and line.startswith(start), line


def test_report_lists_the_gpu_facts():
    text = doctor.format_report(gpu_facts(1024, 0, [64]))
    assert "cuDNN            runtime 9.19.0, compiled 9.19.0" in text
    assert "s_kv % 128 in [64]" in text
    assert "stock F.sdpa, bool mask" in text and "1024" in text


def test_adversarial_row_is_below_the_float32_exp_limit():
    """The doctor's case is only a test if its row 0 has lse < -88.7 (where
    exp() underflows in float32); random data never gets there."""
    c = doctor.CASE
    q, k, v, _ = doctor.adversarial_inputs(device="cpu", dtype=torch.float64, **c)
    lse = torch.logsumexp(q @ k.transpose(-2, -1) / math.sqrt(c["head_dim"]), dim=-1)
    assert lse[..., 0].max().item() < -88.7
    assert lse[..., 1:].min().item() > -20.0
