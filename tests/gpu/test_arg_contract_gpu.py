"""tests/test_arg_contract.py's vmap and length checks on CUDA, where the op's
decision can pick the guarded cuDNN path: under torch.func.vmap it must hand
the batched call to F.sdpa (cuDNN off, since a gradient may come through the
vmap), and under vmap(grad(f)) PyTorch's selector must still answer (it has
no batching rule of its own)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from support import randn

from .conftest import GPU_MARKS

pytestmark = GPU_MARKS

N, B, H, L, S, E = 3, 2, 4, 64, 200, 64
BF16 = torch.bfloat16
TOL = dict(atol=3e-2, rtol=3e-2)


def inputs(requires_grad=False):
    return [randn(N, B, H, n, E, seed=i, device="cuda", dtype=BF16, requires_grad=requires_grad)
            for i, n in ((1, L), (2, S), (3, S))]


def no_openwam_warning(caught):
    text = " ".join(str(w.message) for w in caught)
    assert "openwam" not in text, text


@pytest.mark.parametrize("is_causal", [False, True])
def test_vmap_cuda_as_f_sdpa(ow, is_causal):
    q, k, v = inputs(requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = torch.func.vmap(lambda *a: ow.sdpa(*a, is_causal=is_causal))(q, k, v)
        dq, dk, dv = torch.autograd.grad(ours.float().square().sum(), (q, k, v))
    no_openwam_warning(caught)
    stock = torch.func.vmap(lambda *a: F.scaled_dot_product_attention(*a, is_causal=is_causal))(
        q, k, v)
    torch.testing.assert_close(ours, stock, **TOL)
    for g, ref in zip((dq, dk, dv), torch.autograd.grad(stock.float().square().sum(), (q, k, v))):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, ref, **TOL)


def test_vmap_of_grad_cuda(ow):
    q, k, v = inputs()

    def per_sample(f):
        return torch.func.vmap(torch.func.grad(
            lambda q, k, v: f(q, k, v, is_causal=True).float().sum(), argnums=(0, 1, 2)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = per_sample(ow.sdpa)(q, k, v)
    for g, ref in zip(ours, per_sample(F.scaled_dot_product_attention)(q, k, v)):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, ref, **TOL)
    # The cuDNN path's ops may run per sample here (their batching is
    # functorch's fallback); the op's own dispatch does not warn.
    assert not any("openwam::sdpa" in str(w.message) for w in caught)


def test_key_value_length_mismatch_raises_cuda(ow):
    q, k, _ = (t[0] for t in inputs())
    v = randn(B, H, S - 1, E, seed=3, device="cuda", dtype=BF16)
    for fn in (ow.sdpa, torch.ops.openwam.sdpa, ow.explain):
        with pytest.raises(RuntimeError, match=f"as key \\({S}\\), got {S - 1}"):
            fn(q, k, v)
