"""tests/test_arg_contract.py's vmap and length checks on CUDA, where the op's
decision can pick the guarded cuDNN path: under torch.func.vmap it takes
PyTorch's math backend (stock's fused backwards are wrong there, and a
gradient may come through the vmap), and under vmap(grad(f)) PyTorch's
selector must still answer (it has no batching rule of its own)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


def per_sample_reference(q, k, v, is_causal):
    """Output and gradients of sum(out^2), F.sdpa per sample in float64."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.stack([F.scaled_dot_product_attention(qd[i], kd[i], vd[i], is_causal=is_causal)
                           for i in range(N)])
    return (out,) + torch.autograd.grad(out.square().sum(), (qd, kd, vd))


def normalized_err(x, ref):
    return float((x.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("is_causal", [False, True])
def test_vmap_cuda_gradients_right(ow, is_causal, suite_results):
    """Under vmap on CUDA the op's output is F.sdpa's and its gradients match a
    per-sample float64 reference. Stock's are not right there (torch 2.11:
    cuDNN's gradients wrong, efficient's causal backward raises), so the op
    takes PyTorch's math backend for batched calls; stock's error is recorded."""
    q, k, v = inputs(requires_grad=True)
    ref = per_sample_reference(q, k, v, is_causal)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = torch.func.vmap(lambda *a: ow.sdpa(*a, is_causal=is_causal))(q, k, v)
        grads = torch.autograd.grad(ours.float().square().sum(), (q, k, v))
    no_openwam_warning(caught)
    stock = torch.func.vmap(lambda *a: F.scaled_dot_product_attention(*a, is_causal=is_causal))(
        q, k, v)
    torch.testing.assert_close(ours, stock, **TOL)
    try:
        stock_grads = torch.autograd.grad(stock.float().square().sum(), (q, k, v))
        stock_errs = {n: f"{normalized_err(g, r):.3g}"
                      for n, g, r in zip(("dq", "dk", "dv"), stock_grads, ref[1:])}
    except RuntimeError as e:
        stock_errs = {"raised": str(e).splitlines()[0][:80]}
    errs = {n: normalized_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref[1:])}
    suite_results.put("vmap on CUDA", f"is_causal={is_causal}",
                      **{f"op {n}": f"{e:.3g}" for n, e in errs.items()},
                      **{f"stock {n}": e for n, e in stock_errs.items()})
    for n, e in errs.items():
        assert e < 2e-2, f"{n}: normalized error {e:.3g} against the float64 reference"


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
