"""copy_along's kernel (csrc/row_copy.h) against ATen's copy_ and fill_: the
K/V shim's padded copies of K, V and the bias, and the copies of dK, dV and
dQ back out, in every layout the shim gives them (each must take the
kernel), and layouts the kernel must hand back to ATen (unaligned rows, a
dtype it does not take, heads sliced out of BSHD, sides in different
orders)."""
import math

import pytest
import torch

from .conftest import GPU_MARKS

pytestmark = GPU_MARKS + [pytest.mark.own_cuda_kernel]

NEG_INF = -math.inf


def _C():
    import openwam_sdpa._C as C

    return C


def _expected(dst, src, dim, fill):
    """What copy_along writes, by ATen."""
    out = dst.clone()
    n = min(dst.size(dim), src.size(dim))
    out.narrow(dim, 0, n).copy_(src.narrow(dim, 0, n))
    if dst.size(dim) > n:
        out.narrow(dim, n, dst.size(dim) - n).fill_(fill)
    return out


def _bshd(b, s, h, d, dtype):
    """[B, H, S, D] viewed over BSHD storage, as Hugging Face models pass it."""
    return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)


def _check(dst, src, dim, fill, kernel=True):
    """dst as ATen would write it, by the kernel where `kernel`, else by ATen."""
    want = _expected(dst, src, dim, fill)
    assert _C()._copy_along(dst, src, dim, fill) == kernel
    torch.cuda.synchronize()
    assert torch.equal(dst, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("s_kv", [4032, 130, 64])
def test_keys_padded_and_cut_back(dtype, layout, s_kv):
    s_pad = (s_kv + 127) // 128 * 128
    # The padded buffer in the key's stride order (as pad_dim allocates it),
    # holding stale values.
    if layout == "bhsd":
        key = torch.randn(2, 3, s_kv, 64, device="cuda", dtype=dtype)
        padded = torch.full((2, 3, s_pad, 64), 7.0, device="cuda", dtype=dtype)
    else:
        key = _bshd(2, s_kv, 3, 64, dtype)
        padded = torch.full((2, s_pad, 3, 64), 7.0, device="cuda", dtype=dtype).transpose(1, 2)
    _check(padded, key, 2, 0.0)
    # dK out of a padded gradient, into a tensor laid out like the key.
    grad = torch.randn_like(padded)
    _check(torch.empty_like(key), grad, 2, 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 1, 704, 704), (2, 1, 1, 4032), (1, 4, 64, 4032)])
def test_bias_padded_with_neg_inf(dtype, shape):
    bias = torch.randn(shape, device="cuda", dtype=dtype)
    s_pad = (shape[-1] + 127) // 128 * 128
    padded = torch.zeros(*shape[:-1], s_pad, device="cuda", dtype=dtype)
    _check(padded, bias, 3, NEG_INF)
    assert padded[..., shape[-1]:].isneginf().all()


def test_slices_of_batch_and_heads():
    """The sliced backward's dQ and dK copies: one batch element, some heads;
    a slice of batch elements out of a padded gradient in the key's order."""
    dq = torch.zeros(4, 6, 128, 64, device="cuda", dtype=torch.bfloat16)
    part = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    _check(dq.narrow(0, 1, 1).narrow(1, 2, 2), part, 2, 0.0)
    dk = _bshd(4, 200, 6, 64, torch.bfloat16)
    _check(dk.narrow(0, 2, 2), _bshd(2, 256, 6, 64, torch.bfloat16), 2, 0.0)


def test_one_query_row_cut_from_two():
    """The first of two query rows (a narrowed copy of a row axis)."""
    _check(torch.empty(1, 4, 1, 64, device="cuda", dtype=torch.bfloat16),
           torch.randn(1, 4, 2, 64, device="cuda", dtype=torch.bfloat16), 2, 0.0)


def test_layouts_handed_to_aten():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    # Rows of 3 x 2 bytes: not a multiple of 16 bytes.
    _check(torch.zeros(5, 8, **bf16), torch.randn(5, 3, **bf16), 1, NEG_INF, kernel=False)
    # A dtype the kernel does not take.
    _check(torch.zeros(2, 3, 256, 64, device="cuda", dtype=torch.float64),
           torch.randn(2, 3, 200, 64, device="cuda", dtype=torch.float64), 2, 0.0,
           kernel=False)
    # Heads sliced out of BSHD: the keys' stride is not the row's.
    key = _bshd(2, 200, 6, 64, torch.bfloat16).narrow(1, 0, 3)
    _check(torch.zeros(2, 3, 256, 64, **bf16), key, 2, 0.0, kernel=False)
    # A start one element into its storage: not 16-byte aligned.
    flat = torch.randn(2 * 3 * 200 * 64 + 1, **bf16)
    _check(torch.zeros(2, 3, 256, 64, **bf16), flat[1:].view(2, 3, 200, 64), 2, 0.0,
           kernel=False)
    # BSHD out of BHSD: the two sides' rows run in different orders.
    _check(_bshd(2, 200, 6, 64, torch.bfloat16), torch.randn(2, 6, 256, 64, **bf16), 2, 0.0,
           kernel=False)


def test_capturable_in_a_cuda_graph():
    key = torch.randn(2, 3, 4032, 128, device="cuda", dtype=torch.bfloat16)
    padded = torch.empty(2, 3, 4096, 128, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        assert _C()._copy_along(padded, key, 2, 0.0)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _C()._copy_along(padded, key, 2, 0.0)
    padded.fill_(7.0)
    key.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(padded, _expected(padded, key, 2, 0.0))
