"""torch.library.opcheck of every op the package registers, on CUDA tensors:
schema, autograd registration, fake (meta) kernels and AOT dispatch, for each
mask kind, with and without requires_grad. s_kv = 704 is a key length the
guard table marks affected on cuDNN 9.19, so the differentiated calls take
the repair_dq plan (and the _repair_dq_ op is traced). The internal
_repair_dq_ has CUDA and Meta kernels only, so it is checked here alone.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import GPU_MARKS, adversarial_qkv, make_mask, random_qkv

pytestmark = GPU_MARKS

B, H, S_Q, S_KV, D = 1, 2, 128, 704, 64


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_opcheck_sdpa(mask_kind, requires_grad, ow, settings):
    settings(cudnn="1")
    q, k, v = random_qkv(B, H, S_Q, S_KV, D, seed=5, requires_grad=requires_grad)
    mask = make_mask(mask_kind, B, S_Q, S_KV)
    torch.library.opcheck(torch.ops.openwam.sdpa.default, (q, k, v, mask))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_opcheck_pad_keys(mask_kind, ow):
    _, k, v = random_qkv(B, H, S_Q, S_KV, D, seed=6)
    mask = make_mask(mask_kind, B, S_Q, S_KV)
    torch.library.opcheck(torch.ops.openwam.pad_keys.default, (k, v, mask, 128))


@pytest.mark.parametrize("mask_kind", ["none", "additive"])
def test_opcheck_repair_dq(mask_kind, ow):
    """The in-place dQ repair on the stock cuDNN forward of an adversarial
    input (row 9 below the threshold, so the op does write to grad_query)."""
    q, k, v = adversarial_qkv(B, H, S_Q, S_KV, D, (9,), seed=7, requires_grad=False)
    mask = make_mask(mask_kind, B, S_Q, S_KV)
    fwd = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, 0.0, False, False)
    out, lse = fwd[0], fwd[1]
    assert lse[:, :, 9].max().item() < -40.0, "the adversarial row must be below the repair threshold"
    grad_out = torch.randn_like(out)
    grad_query = torch.zeros_like(q)
    bias = None if mask is None else mask.expand(B, H, S_Q, S_KV)
    torch.library.opcheck(torch.ops.openwam._repair_dq_.default,
                          (grad_query, grad_out, q, k, v, out, lse, bias, False, D ** -0.5))
