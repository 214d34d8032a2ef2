"""torch.compile(fullgraph=True, dynamic=False) of a small block that calls
openwam_sdpa.sdpa matches eager, forward and backward, on the GPU: bf16, a
bool mask, s_kv = 704 (the auto plan repairs dQ there), adversarial rows.

fullgraph=True makes any graph break an error, so the op must trace whole
(fake/meta kernels for the op and everything its backward calls).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import (
    GPU_MARKS,
    Attn,
    adversarial_qkv,
    assert_within_stock,
    make_mask,
    nonfinite,
    reference,
    low_row_problem,
    upstream_grad,
)

pytestmark = GPU_MARKS

B, H, S_Q, S_KV, D = 2, 4, 128, 704, 128
LOW_ROWS = (5,)


class Block(torch.nn.Module):
    """Attention followed by an output projection (a parameter that gets a
    gradient, and a layout change after the op)."""

    def __init__(self, sdpa):
        super().__init__()
        self.sdpa = sdpa
        self.proj = torch.nn.Linear(H * D, H * D, bias=False)

    def forward(self, q, k, v, mask):
        out = self.sdpa(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B, S_Q, H * D))


def _eager_and_compiled(ow, backend):
    torch.manual_seed(0)
    eager = Block(ow.sdpa).cuda().to(torch.bfloat16)
    compiled_module = Block(ow.sdpa).cuda().to(torch.bfloat16)
    compiled_module.load_state_dict(eager.state_dict())
    return eager, torch.compile(compiled_module, fullgraph=True, dynamic=False, backend=backend)


def _step(module, q, k, v, mask, go):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    y = module(q, k, v, mask)
    y.backward(go)
    # A compiled module wraps the original one (parameters named "_orig_mod.*").
    grads = {name: p.grad for name, p in getattr(module, "_orig_mod", module).named_parameters()}
    return y.detach(), q.grad, k.grad, v.grad, grads


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_block_matches_eager(backend, ow, settings):
    """aot_eager isolates tracing (fake kernels, autograd through the op);
    inductor is what users run."""
    settings(cudnn="1", pad="auto")
    torch._dynamo.reset()
    q, k, v = adversarial_qkv(B, H, S_Q, S_KV, D, LOW_ROWS, seed=1)
    mask = make_mask("bool", B, S_Q, S_KV, seed=2)
    go = upstream_grad((B, S_Q, H * D), seed=3)
    eager, compiled = _eager_and_compiled(ow, backend)

    e_y, e_dq, e_dk, e_dv, e_grads = _step(eager, q, k, v, mask, go)
    c_y, c_dq, c_dk, c_dv, c_grads = _step(compiled, q, k, v, mask, go)

    for name, t in [("y", c_y), ("dq", c_dq), ("dk", c_dk), ("dv", c_dv), *c_grads.items()]:
        assert nonfinite(t) == 0, f"compiled {name} has non-finite values"
    for name, t in [("y", e_y), ("dq", e_dq), ("dk", e_dk), ("dv", e_dv), *e_grads.items()]:
        assert nonfinite(t) == 0, f"eager {name} has non-finite values"

    # The attention inputs' gradients against the float64 reference of the
    # attention itself: compiled within twice eager's error. dQ accumulates
    # with atomics, so no bitwise comparison.
    g_out = (go.float() @ eager.proj.weight.float()).reshape(B, S_Q, H, D).transpose(1, 2)
    ref, _ = reference(q, k, v, g_out.to(torch.bfloat16), attn_mask=mask)
    e_attn = Attn(ref.out, e_dq, e_dk, e_dv)
    c_attn = Attn(ref.out, c_dq, c_dk, c_dv)
    assert_within_stock(c_attn, e_attn, ref, torch.bfloat16, names="dq dk dv")
    problem = low_row_problem(c_dq, ref.dq, LOW_ROWS, e_dq)
    assert problem is None, problem

    # Block output and the projection's gradient depend only on the forward
    # (no atomics) and go: the same bf16 computation up to fusion order;
    # allow 2 bf16 ulps of the largest entry.
    for name, a, b in [("y", c_y, e_y), *((n, c_grads[n], e_grads[n]) for n in e_grads)]:
        bound = 2 * torch.finfo(torch.bfloat16).eps * float(b.abs().max())
        diff = float((a.float() - b.float()).abs().max())
        assert diff <= bound, f"{name}: compiled vs eager {diff:.3e} > {bound:.3e}"
