"""A tiny randomly initialised Hugging Face Qwen2 (nothing downloaded, no
weight crafted) trained for a few steps on a left-padded batch, bf16, on the GPU.

Left padding alone trips cuDNN's key-tail defect: the padding's query rows
see no key, stock cuDNN turns the bool mask into -65504, their logsumexp
lands near -65504, and at an affected key length (s % 128 == 64 on cuDNN
9.19.0: s = 704) their dQ rows turn NaN in the first backward (measured on
the H200: docs/performance.md, the model benchmark). So:

* stock "sdpa" gives non-finite gradients where the guard table's measured
  rule marks the key length affected and PyTorch picks cuDNN (asserted
  there, recorded elsewhere);
* "openwam_sdpa" gives finite gradients, and its losses match "sdpa" with
  cuDNN disabled within bf16 tolerance;
* the same under torch.compile at default settings, default mode and
  "reduce-overhead" (CUDA graphs): this once gave 13.1M non-finite gradient
  elements while eager was finite.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from support import nonfinite

from .conftest import GPU_MARKS, SDPBackend, cudnn_version, sdpa_kernel, stock_defect_measured

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the integration has nothing to plug into")

pytestmark = GPU_MARKS

B, S, PAD = 2, 704, 64  # the second sequence starts with PAD padding tokens
HIDDEN, HEADS, LAYERS, VOCAB = 256, 2, 2, 1000  # no GQA: the backend probe below is exact
D = HIDDEN // HEADS  # 128
STEPS = 4
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def tiny_qwen2(attn):
    """The same weights for every attn_implementation (seeded)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=1024, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).to("cuda", torch.bfloat16)


def left_padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, :PAD] = 0
    labels = ids.masked_fill(attention_mask == 0, -100)
    return ids.cuda(), attention_mask.cuda(), labels.cuda()


def train(model, steps, context=contextlib.nullcontext, step_begin=None):
    """(losses, non-finite gradient elements per step) over `steps` AdamW
    steps on the left-padded batch, each step inside `context()`."""
    ids, attention_mask, labels = left_padded_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, bad = [], []
    for _ in range(steps):
        if step_begin is not None:
            step_begin()
        with context():
            loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
        losses.append(loss.item())
        bad.append(sum(nonfinite(p.grad) for p in model.parameters() if p.grad is not None))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, bad


def pytorch_picks_cudnn(ow) -> bool:
    """PyTorch's default backend for the model's attention call."""
    q = torch.zeros(B, HEADS, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.zeros(B, HEADS, S, D, device="cuda", dtype=torch.bfloat16)
    mask = ow.adversarial.left_padding_mask([S, S - PAD], S, device="cuda")
    return ow.explain(q, kv, kv, mask)["pytorch_choice"] == "cudnn_attention"


@pytest.fixture(autouse=True)
def _default_settings(ow):
    # tests/conftest.py clears OPENWAM_SDPA_* from the environment; the op
    # caches its settings, so they are re-read here.
    ow.reload_settings()


def test_left_padded_training(ow, suite_results):
    ours, ours_bad = train(tiny_qwen2("openwam_sdpa"), STEPS)
    reference, reference_bad = train(tiny_qwen2("sdpa"), STEPS, lambda: sdpa_kernel(NO_CUDNN))
    stock, stock_bad = train(tiny_qwen2("sdpa"), 1)
    picks_cudnn = pytorch_picks_cudnn(ow)
    affected = ow.key_tail_defect(cudnn_version(), S, D)
    suite_results.put("hf training", f"qwen2 left-padded s={S} eager",
                      pytorch_picks_cudnn=picks_cudnn, guard_marks_affected=affected,
                      stock_nonfinite_grads=stock_bad[0], openwam_nonfinite_grads=ours_bad,
                      openwam_losses=[round(x, 4) for x in ours],
                      no_cudnn_losses=[round(x, 4) for x in reference])

    assert ours_bad == [0] * STEPS and all(math.isfinite(x) for x in ours), (ours_bad, ours)
    assert reference_bad == [0] * STEPS, f"the cuDNN-free reference itself: {reference_bad}"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=2e-2, atol=0)
    assert ours[-1] < ours[0], ours
    if picks_cudnn and stock_defect_measured(S, D):
        assert stock_bad[0] > 0, "stock sdpa was expected to give non-finite gradients here"


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_left_padded_training(mode, ow, suite_results):
    torch._dynamo.reset()
    eager, _ = train(tiny_qwen2("openwam_sdpa"), 1)
    model = tiny_qwen2("openwam_sdpa")
    compiled = torch.compile(model) if mode == "default" else torch.compile(model, mode=mode)
    # CUDA graphs: each step's outputs may be overwritten by the next replay.
    step_begin = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else None
    # Three steps: under reduce-overhead the first warms up, the second
    # records the CUDA graph and the third replays it.
    losses, bad = train(compiled, 3, step_begin=step_begin)
    suite_results.put("hf training", f"qwen2 left-padded s={S} compiled {mode}",
                      openwam_nonfinite_grads=bad, losses=[round(x, 4) for x in losses])
    assert bad == [0, 0, 0] and all(math.isfinite(x) for x in losses), (bad, losses)
    torch.testing.assert_close(losses[0], eager[0], rtol=2e-2, atol=0)
