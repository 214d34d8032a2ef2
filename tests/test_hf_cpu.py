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


def sparse_attention_model(name, attn):
    """A tiny DeepSeek-V3.2-style model: an indexer picks each query's top 4
    keys, so the attention is sparse over a sequence of 12."""
    import transformers

    classes = {"deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
               "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")}[name]
    if not hasattr(transformers, classes[1]):
        pytest.skip(f"transformers {transformers.__version__} has no {classes[1]}")
    config = getattr(transformers, classes[0])(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, head_dim=8,
        index_topk=4, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
        max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_models_keep_their_selection(name):
    """transformers applies the indexer's top-k selection as a mask only for
    a backend named "eager" or "sdpa"; others get it as `indices=`, which
    the backend had dropped: dense attention, logits off by 0.1 (found in
    review). The backend now masks as "sdpa" does."""
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = sparse_attention_model(name, "openwam_sdpa")(input_ids=ids).logits
        ref = sparse_attention_model(name, "sdpa")(input_ids=ids).logits
    torch.testing.assert_close(ours, ref)


def test_block_sparse_selection_is_refused_not_dropped():
    """MiniMax-M3's block selection (`block_indices=`) is built from inputs the
    backend does not see: the backend refuses it, naming the way out."""
    from openwam_sdpa.transformers_integration import _sparse_selection_as_mask

    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="attn_implementation='sdpa'"):
        _sparse_selection_as_mask(torch.nn.Module(), q, q, None,
                                  {"block_indices": torch.zeros(1, 3, 1, dtype=torch.long)})
    assert _sparse_selection_as_mask(torch.nn.Module(), q, q, None, {"block_indices": None}) is None


def test_a_sparse_selection_takes_the_sdpa_path_whole(monkeypatch):
    """With a selection the packed routes are not consulted: they read a
    padding token from the mask's diagonal, which the top-k selection may
    clear for a real query (its sequence merged with the one before, or its
    row crossed sequences; found in review)."""
    from transformers import AttentionInterface

    from openwam_sdpa import transformers_integration as ti

    def refuse(*args, **kwargs):
        raise AssertionError("the packed routes were consulted")

    monkeypatch.setattr(ti, "packed_attention", refuse)
    forward = AttentionInterface()["openwam_sdpa"]
    q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(4))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    indices = torch.arange(8).clamp(max=3)[None, :, None].expand(1, 8, 2).contiguous()
    out, _ = forward(module, q, q, q, mask.clone(), indices=indices, position_ids=torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 3]]))
    keep = torch.zeros(1, 8, 8, dtype=torch.bool).scatter(-1, indices, True)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask & keep)
    torch.testing.assert_close(out.transpose(1, 2), ref)


def test_gemma4_kv_shared_layers_with_logits_to_keep():
    """Gemma 4's KV-shared layers drop all but the last logits_to_keep queries
    for every backend not named "sdpa" (transformers 5.25), without a mask:
    those queries attended top-left (last logits off by 0.34; found in
    review). They see every key up to their own position, as in the full
    forward, also in a static cache longer than the sequence; a static cache's
    prefill, also without a mask and with fewer queries than keys, keeps
    top-left (generate's tokens are "sdpa"'s)."""
    import transformers

    if not hasattr(transformers, "Gemma4ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, StaticCache

    config = Gemma4TextConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
        vocab_size_per_layer_input=100, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config).eval()
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    tokens = {}
    with torch.no_grad():
        model.set_attn_implementation("eager")
        full = model(input_ids=ids, use_cache=False).logits[:, -4:]
        for attn in ("sdpa", "openwam_sdpa"):
            model.set_attn_implementation(attn)
            kept = model(input_ids=ids, logits_to_keep=4, use_cache=True).logits
            torch.testing.assert_close(kept, full, rtol=1e-4, atol=1e-5, msg=attn)
            # A static cache longer than the sequence: the keys past it are empty slots.
            static = StaticCache(config=model.config, max_cache_len=16)
            kept = model(input_ids=ids, logits_to_keep=4, cache=static).logits
            torch.testing.assert_close(kept, full, rtol=1e-4, atol=1e-5, msg=f"{attn}, static")
            tokens[attn] = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False,
                                          cache_implementation="static", pad_token_id=0,
                                          eos_token_id=None)[0, -5:].tolist()
    assert tokens["openwam_sdpa"] == tokens["sdpa"]
