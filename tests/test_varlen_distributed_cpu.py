"""sdpa_varlen under DTensor on the CPU: q, k, v sharded on the head dim
(tensor parallelism) and cu_seqlens replicated run shard-local through the
rules of python/openwam_sdpa/varlen_distributed.py, forward and backward
(and a forward nothing differentiates), and give what the unsharded call
gives; the block-diagonal engine, which is no leaf op, too. Two gloo
processes."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from support import spawn_gloo_workers

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available")

WORLD = 2


def _worker(rank, init_file, result_dir):
    import openwam_sdpa
    from openwam_sdpa.varlen import cu_seqlens_from_lengths
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        g = torch.Generator().manual_seed(0)
        lens = [5, 1, 9]
        q = torch.randn(15, 4, 8, generator=g, dtype=torch.float64)
        k = torch.randn(15, 2, 8, generator=g, dtype=torch.float64)
        v = torch.randn(15, 2, 8, generator=g, dtype=torch.float64)
        go = torch.randn(15, 4, 8, generator=g, dtype=torch.float64)
        cu, max_len = cu_seqlens_from_lengths(lens)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = openwam_sdpa.varlen_sdpa(*ref_leaves, cu, cu, max_len, max_len, is_causal=True,
                                       enable_gqa=True)
        ref_grads = torch.autograd.grad(ref, ref_leaves, go)
        leaves = [distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (q, k, v)]
        dcu = distribute_tensor(cu, mesh, [Replicate()])
        out = openwam_sdpa.varlen_sdpa(*leaves, dcu, dcu, max_len, max_len, is_causal=True,
                                       enable_gqa=True)
        assert isinstance(out, DTensor) and out.placements == (Shard(1),), out.placements
        grads = torch.autograd.grad(out, leaves, distribute_tensor(go, mesh, [Shard(1)]))
        assert all(gr.placements == (Shard(1),) for gr in grads), [gr.placements for gr in grads]
        torch.testing.assert_close(out.full_tensor(), ref)
        for gr, r in zip(grads, ref_grads):
            torch.testing.assert_close(gr.full_tensor(), r)
        with torch.no_grad():  # no logsumexp: the rule replicates the empty one
            served = openwam_sdpa.varlen_sdpa(*leaves, dcu, dcu, max_len, max_len,
                                              is_causal=True, enable_gqa=True)
        assert served.placements == (Shard(1),), served.placements
        torch.testing.assert_close(served.full_tensor(), ref.detach())
        # The block-diagonal engine (fp32 on CUDA, head_dim over 256...) is no
        # leaf op: its mask's fresh tensors had met DTensor's refusal to mix
        # (and an empty call hung in DTensor's flatten). It runs per shard.
        os.environ["OPENWAM_SDPA_VARLEN"] = "block_diagonal"
        openwam_sdpa.varlen_settings(reload=True)
        try:
            for placement in (Shard(1), Replicate()):
                leaves = [distribute_tensor(t, mesh, [placement]).requires_grad_()
                          for t in (q, k, v)]
                out = openwam_sdpa.varlen_sdpa(*leaves, dcu, dcu, max_len, max_len,
                                               is_causal=True, enable_gqa=True)
                assert out.placements == (placement,), (placement, out.placements)
                grads = torch.autograd.grad(out, leaves, distribute_tensor(go, mesh, [placement]))
                torch.testing.assert_close(out.full_tensor(), ref)
                for gr, r in zip(grads, ref_grads):
                    torch.testing.assert_close(gr.full_tensor(), r)
            empty = [distribute_tensor(t[:0], mesh, [Shard(1)]) for t in (q, k, v)]
            zero_cu = distribute_tensor(torch.zeros(1, dtype=torch.int32), mesh, [Replicate()])
            out = openwam_sdpa.varlen_sdpa(*empty, zero_cu, zero_cu, 0, 0, enable_gqa=True)
            assert out.shape == (0, 4, 8) and out.placements == (Shard(1),), out
        finally:
            del os.environ["OPENWAM_SDPA_VARLEN"]
            openwam_sdpa.varlen_settings(reload=True)
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write("ok")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_head_sharded_varlen_matches_unsharded():
    with tempfile.TemporaryDirectory() as tmp:
        results = [os.path.join(tmp, f"rank{r}") for r in range(WORLD)]
        spawn_gloo_workers(_worker, (os.path.join(tmp, "init"), tmp), WORLD, results,
                           timeout_s=300)
        assert [open(r).read() for r in results] == ["ok"] * WORLD
