"""A tiny randomly initialised Hugging Face causal LM on the CPU: with
attn_implementation="openwam_sdpa" it gives the logits and gradients of
"sdpa" on a left-padded batch (whose padding query rows see no key), and its
attention really runs through the op. The GPU counterpart, where stock
"sdpa" meets cuDNN's defect, is tests/gpu/test_hf_training_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is not installed: the integration has nothing to plug into")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

LAYERS, S = 2, 24
PADDING = (0, 5, 11)  # left padding of each sequence


def tiny_model(arch, attn):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  use_cache=False)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def left_padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(128, (len(PADDING), S), generator=g)
    attention_mask = (torch.arange(S) >= torch.tensor(PADDING)[:, None]).long()
    return ids, attention_mask, ids.masked_fill(attention_mask == 0, -100)


def forward_backward(model):
    ids, attention_mask, labels = left_padded_batch()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = model(input_ids=ids, attention_mask=attention_mask, labels=labels)
        out.loss.backward()
    op_calls = sum(e.count for e in prof.key_averages() if e.key == "openwam::sdpa")
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.logits.detach(), grads, op_calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_openwam_sdpa_matches_sdpa_on_a_left_padded_batch(arch):
    logits, grads, op_calls = forward_backward(tiny_model(arch, "openwam_sdpa"))
    ref_logits, ref_grads, ref_op_calls = forward_backward(tiny_model(arch, "sdpa"))
    assert (op_calls, ref_op_calls) == (LAYERS, 0)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")
