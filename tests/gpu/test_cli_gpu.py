"""`python -m openwam_sdpa explain --device cuda` and `guards` on the GPU: the
command decides on fake tensors (no memory), and must answer what the op
answers for real CUDA tensors of the same shapes."""

from __future__ import annotations

import json

import pytest
import torch

import openwam_sdpa
from openwam_sdpa import cli

from .conftest import GPU_MARKS

pytestmark = GPU_MARKS

CALLS = [
    # batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, mask, causal, dropout, inference
    (2, 4, 4, 128, 704, 128, "bf16", "bool", False, 0.0, False),     # the doctor's key length
    (2, 16, 4, 307, 320, 96, "bf16", "bool", False, 0.0, False),     # GQA, head_dim 96
    (2, 16, 4, 307, 320, 96, "bf16", "additive", False, 0.125, False),
    (1, 8, 8, 1, 640, 128, "fp16", "none", False, 0.0, False),       # one query row
    (2, 8, 8, 512, 512, 64, "bf16", "none", True, 0.0, False),
    (2, 8, 8, 512, 576, 64, "bf16", "bool", False, 0.0, True),       # inference
    (2, 8, 8, 256, 320, 64, "fp32", "none", False, 0.0, False),      # not a cuDNN dtype
]


def real_explain(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, mask, causal, dropout,
                 inference):
    dt = cli.DTYPES[dtype]
    q = torch.zeros(batch, heads, q_len, head_dim, device="cuda", dtype=dt,
                    requires_grad=not inference)
    k = torch.zeros(batch, kv_heads, kv_len, head_dim, device="cuda", dtype=dt)
    v = torch.zeros_like(k)
    m = None
    if mask != "none":
        m = torch.ones(batch, 1, q_len, kv_len, device="cuda",
                       dtype=torch.bool if mask == "bool" else dt)
    return openwam_sdpa.explain(q, k, v, m, dropout, causal, enable_gqa=kv_heads != heads)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: "-".join(map(str, c)))
def test_explain_on_fake_tensors_matches_real_ones(call, capsys):
    batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, mask, causal, dropout, inference = call
    args = ["explain", "--json", "--device", "cuda", "--batch", str(batch), "--heads", str(heads),
            "--kv-heads", str(kv_heads), "--q-len", str(q_len), "--kv-len", str(kv_len),
            "--head-dim", str(head_dim), "--dtype", dtype, "--mask", mask,
            "--dropout", str(dropout)]
    args += ["--causal"] if causal else []
    args += ["--inference"] if inference else []
    assert cli.main(args) == 0
    got = json.loads(capsys.readouterr().out)
    want = real_explain(*call)
    assert {key: got[key] for key in want} == want
    assert got["cuda_available"] and got["notes"] == []


def test_guards_read_the_runtime_cudnn(capsys):
    assert cli.main(["guards", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    runtime = openwam_sdpa.build_info()["cudnn_runtime"]
    assert table["cudnn_source"] == "runtime" and table["cudnn"] == runtime > 0
