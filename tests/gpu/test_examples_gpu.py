"""examples/ on the GPU at the key length the defect hits (704 tokens, bf16
autocast), as a user runs them: with openwam_sdpa the verdict is finite and
names the route the op's explain() gives; with stock SDPA the verdict is
whatever the stack gives, in the same form."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import openwam_sdpa

from .conftest import GPU_MARKS
from test_examples import EXAMPLES, VERDICT

pytestmark = GPU_MARKS

SMALL = ["--device", "cuda", "--steps", "2", "--batch", "2", "--seq", "704", "--layers", "1"]


def run(name, *args):
    r = subprocess.run([sys.executable, str(EXAMPLES / name), *SMALL, *args], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    last = r.stdout.rstrip().splitlines()[-1]
    m = VERDICT.match(last)
    assert m and "note: no NaN to show here" not in r.stdout, r.stdout
    return m.group(1), m.group(3)


def test_patch_example_is_finite_on_the_route_explain_gives():
    finite, attention = run("train_patch.py", "--dim", "128", "--heads", "2")
    assert finite == "finite", attention
    q = torch.zeros(2, 2, 704, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(2, 1, 704, 704, device="cuda", dtype=torch.bool)
    p = openwam_sdpa.explain(q, q.detach(), q.detach(), mask)
    assert attention.startswith(f"openwam_sdpa, route {p['route']} ({p['reason']}), plan {p['plan']}"), \
        (attention, p)
    assert re.search(r"; calls on shifted scores: \d+, with cuDNN's padding mask: \d+, "
                     r"calls on the ATen fallback: \d+$", attention), attention


def test_patch_example_stock():
    finite, attention = run("train_patch.py", "--dim", "128", "--heads", "2", "--route", "stock")
    assert attention.startswith("stock F.scaled_dot_product_attention ("), attention
    assert finite in ("finite", "NOT finite")


def test_hf_example_is_finite():
    pytest.importorskip("transformers", reason="examples/train_hf.py needs transformers")
    finite, attention = run("train_hf.py", "--hidden", "128", "--heads", "2")
    assert finite == "finite" and attention.startswith("openwam_sdpa, route "), attention
