"""patch()/unpatch()/patched() route torch.nn.functional.scaled_dot_product_attention
through openwam::sdpa, and the transformers attention backend "openwam_sdpa"
does the same for Hugging Face models."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import F_SDPA, grads, make_mask, qkv

B, H, L, S, E = 2, 2, 5, 7, 8


@pytest.fixture
def ow():
    import openwam_sdpa

    openwam_sdpa.unpatch()
    yield openwam_sdpa
    openwam_sdpa.unpatch()
    assert F.scaled_dot_product_attention is F_SDPA


@pytest.fixture
def op_calls(ow, monkeypatch):
    """Counts the calls that reach openwam_sdpa's op through the patch."""
    # sys.modules: the package's `patch` attribute is the function, which
    # shadows the submodule of the same name.
    patch_module = sys.modules["openwam_sdpa.patching"]
    calls = []
    real = patch_module.sdpa

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(patch_module, "sdpa", counting)
    return calls


def test_patch_and_unpatch(ow, op_calls):
    original = F.scaled_dot_product_attention
    assert original is F_SDPA and not ow.is_patched()
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    mask = make_mask("bool", B, H, L, S)
    ref = F.scaled_dot_product_attention(q, k, v, mask)
    assert op_calls == []

    ow.patch()
    assert ow.is_patched()
    assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention.__name__ == original.__name__
    out = F.scaled_dot_product_attention(q, k, v, mask)
    assert len(op_calls) == 1
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)

    ow.patch()  # idempotent
    ow.unpatch()
    assert not ow.is_patched()
    assert F.scaled_dot_product_attention is original
    F.scaled_dot_product_attention(q, k, v, mask)
    assert len(op_calls) == 1


def test_patched_routes_through_the_op(ow, settings):
    """Without any monkeypatching: an invalid setting makes the op (and only
    the op) raise, so a raise proves the call reached it."""
    q, k, v = qkv(B, H, L, S, E)
    settings(pad="bogus")
    F.scaled_dot_product_attention(q, k, v)  # stock: ignores the setting
    with ow.patched():
        with pytest.raises(RuntimeError, match="openwam::sdpa: environment variable OPENWAM_SDPA_PAD"):
            F.scaled_dot_product_attention(q, k, v)
    F.scaled_dot_product_attention(q, k, v)


def test_patched_keyword_arguments(ow, op_calls):
    q, k, v = qkv(B, 4, L, S, E, Hkv=2)
    ref = F_SDPA(q, k, v, None, 0.0, True, scale=0.3, enable_gqa=True)
    with ow.patched():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
        out2 = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.3, enable_gqa=True)
    assert len(op_calls) == 2
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(out2, ref, atol=1e-12, rtol=0)


def test_patched_context_restores(ow):
    with ow.patched():
        assert ow.is_patched()
    assert not ow.is_patched() and F.scaled_dot_product_attention is F_SDPA
    with pytest.raises(ZeroDivisionError):
        with ow.patched():
            1 / 0
    assert not ow.is_patched()


def test_nested_patched_keeps_outer(ow):
    with ow.patched():
        with ow.patched():
            assert ow.is_patched()
        assert ow.is_patched()  # the inner block does not undo the outer
    assert not ow.is_patched()


def test_patched_keeps_an_outer_patch(ow):
    ow.patch()
    with ow.patched():
        assert ow.is_patched()
    assert ow.is_patched()


def test_mask_requiring_grad_goes_to_original(ow, op_calls):
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    bias = make_mask("additive", B, H, L, S).requires_grad_()
    ref = F_SDPA(q, k, v, bias)
    with ow.patched():
        out = F.scaled_dot_product_attention(q, k, v, bias)
    assert op_calls == []
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    (dbias,) = grads(out, (bias,))
    assert dbias is not None and dbias.shape == bias.shape
    # The same mask without requires_grad does go to the op.
    with ow.patched():
        F.scaled_dot_product_attention(q, k, v, bias.detach())
    assert len(op_calls) == 1


def test_op_errors_surface_through_patch(ow):
    q, k, v = qkv(B, H, L, S, E)
    with ow.patched():
        with pytest.raises(RuntimeError, match=r"openwam::sdpa: scale must be a positive"):
            F.scaled_dot_product_attention(q, k, v, scale=-1.0)


@pytest.mark.parametrize("masks", ["none", "attn_mask", "key_padding_mask", "causal"])
def test_multihead_attention_same_patched_and_unpatched(ow, op_calls, masks):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64).train()
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    kw = {"need_weights": False}
    if masks == "attn_mask":
        kw["attn_mask"] = ~make_mask("bool", 1, 1, 6, 6, rank=2)  # True = masked out
    elif masks == "key_padding_mask":
        kpm = torch.zeros(2, 6, dtype=torch.bool)
        kpm[1, 4:] = True
        kw["key_padding_mask"] = kpm
    elif masks == "causal":
        kw["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
        kw["is_causal"] = True

    ref, _ = mha(x, x, x, **kw)
    ref_g = grads(ref, (x, mha.in_proj_weight))
    with ow.patched():
        out, _ = mha(x, x, x, **kw)
    assert len(op_calls) == 1
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(grads(out, (x, mha.in_proj_weight)), ref_g):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# --------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="transformers is not installed (optional integration)")


@needs_transformers
def test_registered_in_transformers(ow):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "openwam_sdpa" in ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS["openwam_sdpa"] is AttentionInterface()["openwam_sdpa"]
    assert "openwam_sdpa" in ALL_MASK_ATTENTION_FUNCTIONS
    from openwam_sdpa.transformers_integration import register

    assert register() is True  # registering again is harmless


@needs_transformers
def test_tiny_llama_same_logits(ow, op_calls):
    from transformers import AutoModelForCausalLM, LlamaConfig

    def config():  # one each: a model may write its attn_implementation into it
        return LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_config(config(),
                                            attn_implementation="openwam_sdpa").eval()
    ours.load_state_dict(stock.state_dict())
    assert stock.config._attn_implementation == "sdpa"
    assert ours.config._attn_implementation == "openwam_sdpa"
    assert next(ours.parameters()).dtype == torch.float32

    input_ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding on the second sequence
    with torch.no_grad():
        ref = stock(input_ids=input_ids, attention_mask=attention_mask).logits
        assert op_calls == []
        out = ours(input_ids=input_ids, attention_mask=attention_mask).logits
    assert len(op_calls) == ours.config.num_hidden_layers
    assert not ow.is_patched()  # the backend patches only for its own calls
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    # Training step: gradients agree too.
    ours.train(), stock.train()
    loss_ref = stock(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
    loss = ours(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
    loss_ref.backward()
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    for (name, p), p_ref in zip(ours.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)
