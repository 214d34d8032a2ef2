"""openwam::_mask_bias on the CPU (its ATen composite; the CUDA kernel is
compared with it in tests/gpu/test_mask_bias_gpu.py): values, grown keys,
broadcast keys, its errors, and opcheck (schema, Meta kernel)."""
import math

import pytest
import torch

import openwam_sdpa  # noqa: F401  (registers the ops)

OP = torch.ops.openwam._mask_bias.default


def test_zero_where_true_and_neg_inf_elsewhere_and_past_the_keys():
    m = torch.tensor([[True, False, True], [False, False, True]])
    b = OP(m, torch.float32, 3, 8)
    assert b.shape == (2, 8) and b.is_contiguous()
    want = torch.full((2, 8), -math.inf)
    want[:, :3] = torch.where(m, 0.0, -math.inf)
    assert torch.equal(b, want)


def test_a_mask_broadcast_along_the_keys_fills_them():
    m = torch.tensor([[True], [False]])
    b = OP(m, torch.bfloat16, 5, 8)
    assert b.shape == (2, 8)
    assert torch.equal(b[0, :5].float(), torch.zeros(5))
    assert b[0, 5:].isneginf().all() and b[1].isneginf().all()


@pytest.mark.parametrize("args, message", [
    ((torch.zeros(2, 3), torch.float32, 3, 3), "mask must be bool"),
    ((torch.ones(2, 4, dtype=torch.bool), torch.float32, 3, 3), r"mask's last dim must be s_kv \(3\) or 1, got 4"),
    ((torch.ones(2, 3, dtype=torch.bool), torch.float32, 3, 2), r"s_kv_padded \(2\) must be at least s_kv \(3\)"),
    ((torch.ones(2, 3, dtype=torch.bool), torch.int32, 3, 3), "dtype must be a floating-point type"),
])
def test_errors(args, message):
    with pytest.raises(RuntimeError, match="openwam::_mask_bias: " + message):
        OP(*args)


def test_opcheck():
    m = torch.rand(2, 1, 4, 70) > 0.5
    torch.library.opcheck(OP, (m, torch.bfloat16, 70, 128))
