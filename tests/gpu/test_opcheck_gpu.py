"""torch.library.opcheck of every op the package registers, on CUDA tensors:
schema, autograd registration, fake (meta) kernels and AOT dispatch, for each
mask kind, with and without requires_grad. s_kv = 704 is a key length the
guard table marks affected on cuDNN 9.19, so the differentiated calls take
the repair_dq plan (and the _repair_dq_ op is traced).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import GPU_MARKS, make_mask, random_qkv

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
