"""torch.library.opcheck of every op the package registers, on CUDA tensors:
schema, autograd registration, fake (meta) kernels and AOT dispatch, for each
mask kind, with and without requires_grad, at default settings. s_kv = 704 is
a key length the guard table marks affected on cuDNN 9.19, so the
differentiated calls take the padding-mask plan through the cuDNN path's leaf
ops, which are also checked on their own, plan by plan: their Meta kernels
must describe what cuDNN really returns.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import GPU_MARKS, cuda_mask, cuda_qkv

pytestmark = GPU_MARKS

B, H, S_Q, S_KV, D = 1, 2, 128, 704, 64


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_opcheck_sdpa(mask_kind, requires_grad, ow):
    q, k, v = cuda_qkv(B, H, S_Q, S_KV, D, seed=5, requires_grad=requires_grad)
    mask = cuda_mask(mask_kind, B, 1, S_Q, S_KV)
    torch.library.opcheck(torch.ops.openwam.sdpa.default, (q, k, v, mask))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_opcheck_pad_keys(mask_kind, ow):
    _, k, v = cuda_qkv(B, H, S_Q, S_KV, D, seed=6)
    mask = cuda_mask(mask_kind, B, 1, S_Q, S_KV)
    torch.library.opcheck(torch.ops.openwam.pad_keys.default, (k, v, mask, 128))


# Plan bits (csrc/plan.cpp): padding_mask 1, pad_keys_backward 2, pad_query_backward 8.
LEAF_CASES = {"none": (0, 128, 1), "padding_mask": (1, 128, 1),
              "padding_mask+pad_keys_backward": (3, 128, 1),
              "padding_mask+pad_query_backward": (9, 1, 1), "gqa": (1, 128, 2)}


@pytest.mark.parametrize("case", LEAF_CASES.values(), ids=LEAF_CASES.keys())
@pytest.mark.parametrize("mask_kind", ["none", "additive"])
def test_opcheck_cudnn_leaf_ops(case, mask_kind, ow):
    plan, s_q, groups = case
    q, _, _ = cuda_qkv(B, H * groups, s_q, S_KV, D, seed=8)
    _, k, v = cuda_qkv(B, H, s_q, S_KV, D, seed=9)
    mask = cuda_mask(mask_kind, B, 1, s_q, S_KV)
    bias = None if mask is None else mask.expand(B, 1, s_q, S_KV)
    fwd = torch.ops.openwam._cudnn_sdpa.default
    torch.library.opcheck(fwd, (q, k, v, bias, 0.0, False, None, True, plan))
    out, lse, seed, offset = fwd(q.detach(), k.detach(), v.detach(), bias, 0.0, False, None,
                                 True, plan)
    torch.library.opcheck(torch.ops.openwam._cudnn_sdpa_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), bias,
                           out, lse, seed, offset, 0.0, False, None, plan))
