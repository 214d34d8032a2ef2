"""openwam::_mask_bias's CUDA kernel (csrc/mask_bias.h) against its ATen
composite on the CPU: every mask shape the cuDNN path converts (key masks,
[B, 1, L, S] masks, broadcast and expanded leading dims, a mask broadcast
along the keys), grown or not, in each dtype, and the layouts it hands back
to ATen."""
import pytest
import torch

import openwam_sdpa  # noqa: F401  (registers the ops)

from .conftest import GPU_MARKS

pytestmark = GPU_MARKS + [pytest.mark.own_cuda_kernel]

OP = torch.ops.openwam._mask_bias.default

MASKS = {
    "key_mask": lambda: torch.rand(2, 1, 1, 4032) > 0.3,
    "left_padded": lambda: torch.rand(2, 1, 64, 4032) > 0.3,
    "per_head": lambda: torch.rand(2, 3, 16, 704) > 0.5,
    "rank2": lambda: torch.rand(64, 4032) > 0.5,
    "expanded_heads": lambda: (torch.rand(2, 1, 8, 256) > 0.5).expand(2, 3, 8, 256),
    "broadcast_keys": lambda: torch.rand(2, 1, 8, 1) > 0.5,
    "strided_keys": lambda: (torch.rand(2, 1, 8, 512) > 0.5)[..., ::2],
    # The kernel's byte-by-byte path: a mask that starts off an 8-byte boundary.
    "unaligned_start": lambda: (torch.rand(2, 1, 8, 513) > 0.5)[..., 1:],
    # s_kv = 4040: grown, the vector at key 4040 crosses s_kv (its bytes one by one).
    "vector_crosses_s_kv": lambda: torch.rand(2, 1, 16, 4040) > 0.5,
    # Short rows: eight rows of 64 keys share a block.
    "short_rows": lambda: torch.rand(4, 1, 360, 64) > 0.5,
    # More rows than the grid has blocks (32 a multiprocessor): the grid strides.
    "grid_stride": lambda: torch.rand(1, 1, 4500 + 32 * 132, 2048) > 0.5,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grow", [False, True])
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_kernel_equals_aten(mask, grow, dtype):
    torch.manual_seed(0)
    m = mask()
    s_kv = 256 if m.shape[-1] == 1 else m.shape[-1]
    padded = (s_kv + 127) // 128 * 128 if grow else s_kv
    want = OP(m, dtype, s_kv, padded)
    got = OP(m.cuda(), dtype, s_kv, padded)
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.equal(got.cpu(), want)


def test_layouts_handed_to_aten():
    # 100 bf16 keys: rows of 200 bytes, not a multiple of 16.
    m = torch.rand(2, 1, 4, 100) > 0.5
    assert torch.equal(OP(m.cuda(), torch.bfloat16, 100, 100).cpu(), OP(m, torch.bfloat16, 100, 100))
    # float64: not the kernel's.
    assert torch.equal(OP(m.cuda(), torch.float64, 100, 128).cpu(), OP(m, torch.float64, 100, 128))


def test_capturable_in_a_cuda_graph():
    m = (torch.rand(2, 1, 64, 4032, device="cuda") > 0.5)
    out = OP(m, torch.bfloat16, 4032, 4096)  # warm-up, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(m, torch.bfloat16, 4032, 4096)
    m.copy_(torch.rand(2, 1, 64, 4032, device="cuda") > 0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), OP(m.cpu(), torch.bfloat16, 4032, 4096))
