"""Padding-free training through the "openwam_sdpa" transformers backend on
CUDA, bf16: a small Llama trained a few steps on a packed batch (the
collator's flash keyword arguments, and position_ids alone) and with
OPENWAM_SDPA_UNPAD=1 gives the losses of the padded run within bf16
tolerance, finite, with its attention on the engine that explain_varlen()
names for it (cuDNN's ragged layout on cuDNN 9.19). The CPU counterpart
(exact fp32) is tests/test_hf_varlen_cpu.py."""

from __future__ import annotations

import pytest
import torch

import openwam_sdpa
from openwam_sdpa.varlen import cu_seqlens_from_lengths

pytest.importorskip("transformers")

from test_hf_varlen_cpu import LAYERS, packed_batch, padded_batch, token_sum_loss  # noqa: E402

from .conftest import GPU_MARKS  # noqa: E402

pytestmark = GPU_MARKS
STEPS = 3


def model(attn="openwam_sdpa"):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                            dtype=torch.bfloat16).cuda()


def expected_engine():
    """The engine varlen_sdpa picks for this model's packed attention (bf16, 4 heads over 2 KV
    heads of 64, causal)."""
    cu, longest = cu_seqlens_from_lengths([5, 9], device="cuda")
    q = torch.empty(14, 4, 64, dtype=torch.bfloat16, device="cuda")
    kv = torch.empty(14, 2, 64, dtype=torch.bfloat16, device="cuda")
    return openwam_sdpa.explain_varlen(q, kv, kv, cu, cu, longest, longest, is_causal=True,
                                       enable_gqa=True)["backend"]


def train(m, batch):
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    losses = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            opt.zero_grad()
            loss = token_sum_loss(m, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    keys = {e.key: e.count for e in prof.key_averages()}
    return torch.tensor(losses), keys


@pytest.mark.parametrize("how", ["cu_seq_lens", "position_ids", "unpad"])
def test_packed_training_matches_padded_in_bf16(how, monkeypatch):
    ref, ref_keys = train(model(), padded_batch())
    openwam_sdpa.clear_graph_cache()
    openwam_sdpa.frontend_stats(reset=True)
    if how == "unpad":
        monkeypatch.setenv("OPENWAM_SDPA_UNPAD", "1")
        losses, keys = train(model(), padded_batch())
    else:
        losses, keys = train(model(), packed_batch(how == "cu_seq_lens"))
    assert torch.isfinite(losses).all() and torch.isfinite(ref).all()
    assert keys.get("openwam::sdpa_varlen") == LAYERS * STEPS, keys
    engine = expected_engine()
    flash_calls = keys.get("aten::_flash_attention_forward", 0)
    if engine == "cudnn_ragged":
        assert openwam_sdpa.frontend_stats()["ragged_graphs_built"] >= 1
        assert flash_calls == 0, keys
    else:
        assert engine == "flash", engine
        assert flash_calls >= LAYERS * STEPS, keys
    assert ref_keys.get("openwam::sdpa_varlen", 0) == 0
    # bf16: the two layouts round differently (other matmul shapes); the
    # losses are sums over ~40 tokens of O(5) each.
    torch.testing.assert_close(losses, ref, rtol=2e-2, atol=0.5)
