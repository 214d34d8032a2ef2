"""patch()/unpatch()/patched() route torch.nn.functional.scaled_dot_product_attention
through openwam::sdpa, and the transformers attention backend "openwam_sdpa"
does the same for Hugging Face models."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from support import F_SDPA, grads, make_mask, qkv

pytestmark = pytest.mark.usefixtures("unpatched")

B, H, L, S, E = 2, 2, 5, 7, 8


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


def test_patched_routes_through_the_op(ow):
    """Without any monkeypatching: the profiler sees openwam::sdpa only when
    the call goes through the patch."""
    q, k, v = qkv(B, H, L, S, E)

    def ops_seen():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            F.scaled_dot_product_attention(q, k, v)
        return {e.key for e in prof.key_averages()}

    assert "openwam::sdpa" not in ops_seen()
    with ow.patch():
        assert "openwam::sdpa" in ops_seen()
    assert "openwam::sdpa" not in ops_seen()


def test_patch_is_a_call_and_a_context_manager(ow):
    ow.patch()
    assert ow.is_patched()
    ow.unpatch()
    with ow.patch() as p:
        assert ow.is_patched() and p is not None
    assert not ow.is_patched()
    ow.patch()
    with ow.patch():
        pass
    assert ow.is_patched()  # an outer plain patch() survives the block


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


def test_mask_requiring_grad_is_differentiated(ow, op_calls):
    """A learned bias needs its gradient: the op hands such a call to
    PyTorch's implementation, which differentiates the mask."""
    q, k, v = qkv(B, H, L, S, E, requires_grad=True)
    bias = make_mask("additive", B, H, L, S).requires_grad_()
    ref = F_SDPA(q, k, v, bias)
    with ow.patched():
        out = F.scaled_dot_product_attention(q, k, v, bias)
    assert len(op_calls) == 1
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    for a, b in zip(grads(out, (q, k, v, bias)), grads(ref, (q, k, v, bias))):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_errors_through_patch_are_pytorchs(ow):
    q, k, v = qkv(B, H, L, S, E)
    with pytest.raises(RuntimeError) as stock:
        F_SDPA(q, k.float(), v)
    with ow.patched():
        with pytest.raises(RuntimeError) as patched:
            F.scaled_dot_product_attention(q, k.float(), v)
    assert str(patched.value) == str(stock.value)


def test_nested_tensors_go_to_pytorch(ow):
    """Nested (jagged) tensors carry their own F.sdpa handling: the patched
    function hands them over untouched."""
    torch.manual_seed(0)
    lengths = (3, 5)
    parts = [torch.randn(n, H, E) for n in lengths]

    def nested():
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    ref = F_SDPA(nested(), nested(), nested())
    with ow.patched():
        out = F.scaled_dot_product_attention(nested(), nested(), nested())
    for a, b in zip(out.transpose(1, 2).unbind(), ref.transpose(1, 2).unbind()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_causal_bias_goes_to_pytorch(ow):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = qkv(B, H, L, S, E, dtype=torch.float32)
    for make in (causal_upper_left, causal_lower_right):
        bias = make(L, S)
        ref = F_SDPA(q, k, v, bias)
        with ow.patched():
            out = F.scaled_dot_product_attention(q, k, v, bias)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_torchscript_compiles_the_patched_function_to_the_op(ow):
    """torch.jit.script resolves F.scaled_dot_product_attention when it
    compiles; patched, it compiles to openwam::sdpa, whose schema is F.sdpa's.
    (TorchScript caches what it compiled: a function scripted while patched
    keeps calling the op after unpatch(), with the same results.)"""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64).eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    ref, _ = mha(x, x, x, need_weights=False)
    with ow.patched():
        scripted = torch.jit.script(torch.nn.MultiheadAttention(16, 4, batch_first=True,
                                                                dtype=torch.float64).eval())
        scripted.load_state_dict(mha.state_dict())
        out, _ = scripted(x, x, x, need_weights=False)
    assert "openwam::sdpa" in str(scripted.inlined_graph)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_torchscript_compiles_a_direct_call_to_the_op(ow):
    """Code that calls openwam_sdpa.sdpa itself scripts as code calling F.sdpa
    does: to openwam::sdpa (its Python body did not script)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor):
        return ow.sdpa(q, k, v, attn_mask=m, scale=0.5)

    q, k, v = qkv(B, H, L, S, E)
    m = make_mask("bool", B, H, L, S)
    scripted = torch.jit.script(attend)
    assert "openwam::sdpa" in str(scripted.graph)
    torch.testing.assert_close(scripted(q, k, v, m), F_SDPA(q, k, v, attn_mask=m, scale=0.5),
                               atol=0, rtol=0)


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


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_context_parallel_bypass_raises(ow, monkeypatch):
    """context_parallel (monkey-patch mode) turns only F.sdpa into ring
    attention; a direct call of the op on plain tensors, or patch() inside the
    context (what attn_implementation="openwam_sdpa" does per call), would
    attend within one rank's chunk: both raise, naming the way out. Measured
    on two H200s before this check: wrong values, no error."""
    import importlib

    from openwam_sdpa.distributed import _CONTEXT_PARALLEL_MODULES

    for name in _CONTEXT_PARALLEL_MODULES:  # its path moved between torch releases
        try:
            cp = importlib.import_module(name)
            break
        except ImportError:
            continue
    else:
        pytest.skip("this torch has no context_parallel module at a known path")
    pytorch_sdpa = F.scaled_dot_product_attention

    def ring_stand_in(*args, **kwargs):
        return pytorch_sdpa(*args, **kwargs)

    monkeypatch.setitem(cp._replaced_functions, ring_stand_in,
                        ("scaled_dot_product_attention", pytorch_sdpa))
    monkeypatch.setattr(F, "scaled_dot_product_attention", ring_stand_in)
    q, k, v = qkv(B, H, L, S, E)
    with pytest.raises(NotImplementedError, match="context_parallel is active"):
        ow.sdpa(q, k, v)
    # Under a __torch_function__ mode the call takes the op's general path:
    # checked there too (review: it attended within one rank's chunk).
    with torch.device("cpu"), pytest.raises(NotImplementedError,
                                            match="context_parallel is active"):
        ow.sdpa(q, k, v)
    with pytest.raises(NotImplementedError, match="patch\\(\\) before entering context_parallel"):
        ow.patch()
    assert F.scaled_dot_product_attention is ring_stand_in  # patch() left it alone


def test_patch_per_call_holds_across_threads(ow):
    """The transformers backend patches per attention call. Two threads inside
    at once (nn.DataParallel's replicas, a server's workers): the first to
    leave must neither unpatch the other mid-call nor, leaving last, keep
    the patch for good. A patch() per call failed both ways."""
    import threading

    from openwam_sdpa.patching import patched_while_inside

    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with patched_while_inside():
            a_inside.set()
            b_inside.wait(5)
        a_left.set()

    def b():
        a_inside.wait(5)
        with patched_while_inside():
            b_inside.set()
            a_left.wait(5)
            seen["patched after the other left"] = ow.is_patched()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"patched after the other left": True}
    assert F.scaled_dot_product_attention is F_SDPA


def test_patch_and_unpatch_while_the_backend_is_inside(ow):
    """patch(), a `with patch()` block and unpatch() in one thread while the
    transformers backend's call is inside in another: the call keeps the op
    until it leaves, and what the first thread set holds afterwards. A
    leaving call had restored what it found on entry: patch() for good was
    undone, and a closed `with patch()` block stayed patched."""
    import threading

    from openwam_sdpa.patching import patched_while_inside

    def during_a_call(action):
        inside, done = threading.Event(), threading.Event()
        seen = {}

        def call():
            with patched_while_inside():
                inside.set()
                done.wait(5)
                seen["op during the call"] = ow.is_patched()

        t = threading.Thread(target=call)
        t.start()
        assert inside.wait(5)
        action()
        done.set()
        t.join(10)
        return seen["op during the call"]

    assert during_a_call(ow.patch) and ow.is_patched()  # for good
    assert during_a_call(ow.unpatch) and F.scaled_dot_product_attention is F_SDPA

    def block():
        with ow.patch():
            pass

    assert during_a_call(block) and F.scaled_dot_product_attention is F_SDPA
