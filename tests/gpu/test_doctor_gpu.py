"""`python -m openwam_sdpa doctor --json` on the GPU, in a child process as a
user runs it: its two cases (adversarial rows, a left-padded causal batch)
through stock SDPA and through openwam_sdpa, the guard-table coverage, the
verdict and its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from openwam_sdpa import doctor

from .conftest import GPU_MARKS, MEASURED_CUDNN, stock_defect_measured

pytestmark = GPU_MARKS


def test_doctor_on_the_gpu(suite_results):
    r = subprocess.run([sys.executable, "-m", "openwam_sdpa", "doctor", "--json"],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if not k.startswith("OPENWAM_")})
    assert r.returncode in (doctor.EXIT_OK, doctor.EXIT_AFFECTED), r.stdout + r.stderr[-3000:]
    facts = json.loads(r.stdout)
    assert facts["gpu"] and not facts["not_checked"], facts
    assert facts["pytorch_default_backend"] and facts["left_padding_default_backend"], facts
    assert facts["adversarial_lse"] < -88.7, facts["adversarial_lse"]

    adversarial, padded = facts["adversarial_nonfinite"], facts["left_padding_nonfinite"]
    assert {name.split(",")[0] for name in adversarial} == {"stock F.sdpa", "openwam_sdpa"}, adversarial
    assert set(padded) == {"stock F.sdpa", "openwam_sdpa"}, padded
    ours = [c for name, c in adversarial.items() if name.startswith("openwam")] + [padded["openwam_sdpa"]]
    assert all(sum(c.values()) == 0 for c in ours), (adversarial, padded)

    stock_adversarial = sum(c["q"] for name, c in adversarial.items() if name.startswith("stock"))
    stock_padded = padded["stock F.sdpa"]["q"]
    suite_results.put("doctor", "doctor --json", exit_code=r.returncode,
                      coverage=facts["coverage"]["status"],
                      default_backend=facts["pytorch_default_backend"],
                      left_padding_default_backend=facts["left_padding_default_backend"],
                      stock_adversarial_dq=stock_adversarial, stock_left_padding_dq=stock_padded)
    # torch 2.11 picks cuDNN by default, so stock F.sdpa meets the defect:
    # the adversarial row, and the padding rows (bool mask -> -65504).
    if stock_defect_measured(doctor.ADVERSARIAL["s_kv"], doctor.ADVERSARIAL["head_dim"]) \
            and facts["pytorch_default_backend"] == "cudnn_attention":
        assert stock_adversarial > 0, adversarial
    if stock_defect_measured(doctor.LEFT_PADDED["s"], doctor.LEFT_PADDED["head_dim"]) \
            and facts["left_padding_default_backend"] == "cudnn_attention":
        assert stock_padded > 0, padded

    if facts["cudnn_runtime"] == MEASURED_CUDNN:
        assert facts["coverage"]["status"] == "measured", facts["coverage"]
        assert facts["coverage"]["remainders"] == [64], facts["coverage"]
    stock = sum(sum(c.values()) for name, c in list(adversarial.items()) + list(padded.items())
                if name.startswith("stock"))
    expected = doctor.EXIT_AFFECTED if stock or facts["coverage"]["remainders"] else doctor.EXIT_OK
    assert r.returncode == facts["exit_code"] == expected, facts["verdict"]
