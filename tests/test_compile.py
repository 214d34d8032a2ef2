"""torch.compile of a block that calls openwam_sdpa.sdpa on CPU: one graph
(fullgraph=True, no graph break), the op traced as one node, and compiled
forward/backward equal to eager. backend="aot_eager" isolates dynamo +
AOTAutograd from inductor's codegen; one inductor compile (it needs a C++
compiler on CPU) checks the real thing."""

from __future__ import annotations

import shutil

import pytest
import torch

from support import make_mask

B, L, D, HEADS = 2, 10, 32, 4


class Block(torch.nn.Module):
    """Fused QKV projection, attention through the op, output projection."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x, mask=None):
        import openwam_sdpa

        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, D // HEADS).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # BSHD viewed as BHSD
        y = openwam_sdpa.sdpa(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, D))


def run(module, x, mask):
    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x, mask)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)))
    return y.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def check_against_eager(block, backend, mask):
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(1))
    eager = run(block, x, mask)
    torch._dynamo.reset()
    compiled_block = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)
    compiled = run(compiled_block, x, mask)
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(compiled[2], eager[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture
def block():
    torch.manual_seed(0)
    yield Block()
    torch._dynamo.reset()


MASKS = {
    "none": None,
    "bool": make_mask("bool", B, 1, L, L, empty_rows=(3,)),
    "key_additive": make_mask("key_additive", B, 1, L, L, dtype=torch.float32),
}


def test_op_is_one_node_without_graph_break(block):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(B, L, D)
    explanation = torch._dynamo.explain(block)(x, MASKS["bool"])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=record, fullgraph=True, dynamic=False)
    compiled(x, MASKS["bool"])
    assert len(graphs) == 1
    assert "openwam.sdpa" in graphs[0].code


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_aot_eager_matches_eager(block, mask):
    check_against_eager(block, "aot_eager", mask)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU codegen needs a C++ compiler")
def test_inductor_matches_eager(block):
    check_against_eager(block, "inductor", MASKS["bool"])


def test_fx_symbolic_trace_records_the_op():
    """torch.fx's Proxy is no tensor: the op had handed it to F.sdpa, whose
    __torch_function__ recorded PyTorch's builtin, and the traced module ran
    stock attention (on CUDA without the fix; found in review). The node
    calls openwam_sdpa.sdpa, also through the patched F.sdpa."""
    import torch.nn.functional as F

    import openwam_sdpa

    class Direct(torch.nn.Module):
        def forward(self, q, k, v):
            return openwam_sdpa.sdpa(q, k, v, is_causal=True)

    class Patched(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    with openwam_sdpa.patch():
        patched = torch.fx.symbolic_trace(Patched())
    for gm in (torch.fx.symbolic_trace(Direct()), patched):
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets == [openwam_sdpa.sdpa], targets
        torch.testing.assert_close(gm(q, k, v), openwam_sdpa.sdpa(q, k, v, is_causal=True))
