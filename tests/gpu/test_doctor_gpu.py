"""`python -m openwam_sdpa doctor --json` on the GPU, in a child process as a
user runs it: the adversarial case through stock SDPA and through
openwam_sdpa, the verdict and its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from openwam_sdpa import doctor

from .conftest import GPU_MARKS, stock_defect_measured

pytestmark = GPU_MARKS


def test_doctor_on_the_gpu():
    r = subprocess.run([sys.executable, "-m", "openwam_sdpa", "doctor", "--json"],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if not k.startswith("OPENWAM_")})
    assert r.returncode in (doctor.EXIT_OK, doctor.EXIT_AFFECTED), r.stdout + r.stderr[-3000:]
    facts = json.loads(r.stdout)
    assert facts["gpu"] and not facts["not_checked"], facts
    assert facts["pytorch_default_backend"], facts
    runs = facts["adversarial_nonfinite"]
    assert {name.split(",")[0] for name in runs} == {"stock F.sdpa", "openwam_sdpa"}, runs
    ours = {name: c for name, c in runs.items() if name.startswith("openwam")}
    assert all(sum(c.values()) == 0 for c in ours.values()), runs
    stock_dq = sum(c["q"] for name, c in runs.items() if name.startswith("stock"))
    if stock_defect_measured(doctor.CASE["s_kv"], doctor.CASE["head_dim"]) \
            and facts["pytorch_default_backend"] == "cudnn_attention":
        # torch 2.11 picks cuDNN by default, so stock F.sdpa meets the defect.
        assert stock_dq > 0, runs
    expected = doctor.EXIT_AFFECTED if stock_dq or facts["affected_remainders_d128"] else doctor.EXIT_OK
    assert r.returncode == facts["exit_code"] == expected, facts["verdict"]
