"""Padding-free training through the "openwam_sdpa" transformers backend on
the CPU: a tiny Llama / Qwen2 built from a config (nothing downloaded),
trained a few steps on a packed batch (DataCollatorWithFlattening: with its
flash-attention keyword arguments, and with position_ids alone), gives the
losses of the same model trained on the padded batch; its attention runs
through openwam::sdpa_varlen, not the dense block-diagonal mask. And
OPENWAM_SDPA_UNPAD=1 runs a padded batch padding-free with the same losses.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the integration has nothing to plug into")

from transformers import AutoModelForCausalLM, DataCollatorWithFlattening  # noqa: E402
from transformers import LlamaConfig, Qwen2Config  # noqa: E402

import openwam_sdpa  # noqa: E402,F401

LAYERS, STEPS = 2, 3
LENGTHS = (9, 1, 17, 5, 12)


def tiny_model(arch, attn="openwam_sdpa", use_cache=False):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  use_cache=use_cache)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def sequences():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(96, (n,), generator=g).tolist() for n in LENGTHS]


def padded_batch(side="right"):
    seqs = sequences()
    S = max(LENGTHS)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(S - len(s), S)
        ids[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def packed_batch(flash_kwargs):
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": s} for s in sequences()])


def token_sum_loss(model, batch):
    """Sum of the next-token losses over every real token: the same number
    for the padded and the packed layout (their mean would differ only by
    the count of tokens, which is the same too; summing makes it exact)."""
    out = model(**{k: v for k, v in batch.items() if k != "labels"})
    logits = out.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100,
                                             reduction="sum")


def train(model, batch, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            opt.zero_grad()
            loss = token_sum_loss(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    counts = {key: sum(e.count for e in prof.key_averages() if e.key == key)
              for key in ("openwam::sdpa_varlen", "openwam::sdpa")}
    return losses, counts


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_training_matches_padded(arch, flash_kwargs):
    batch = packed_batch(flash_kwargs)
    assert batch["input_ids"].shape == (1, sum(LENGTHS))
    # The collator marks every sequence's first label -100; the padded batch
    # does the same through its shift, so both count the same tokens.
    packed_losses, counts = train(tiny_model(arch), batch)
    padded_losses, padded_counts = train(tiny_model(arch), padded_batch())
    assert counts["openwam::sdpa_varlen"] == LAYERS * STEPS, counts
    assert counts["openwam::sdpa"] == 0, counts
    assert padded_counts["openwam::sdpa_varlen"] == 0, padded_counts
    assert all(torch.isfinite(torch.tensor(packed_losses)))
    torch.testing.assert_close(torch.tensor(packed_losses), torch.tensor(padded_losses),
                               rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("use_cache", [False, True], ids=["use_cache_off", "model_default"])
def test_packed_position_ids_give_the_per_sequence_loss_whatever_use_cache(use_cache):
    """transformers looks for packed position_ids only with use_cache off: with
    a model's default (use_cache=True) its "sdpa" and "eager" attend across
    sequence boundaries (a Llama on the GPU: loss 4.850 against the
    per-sequence 4.870; docs/varlen.md). The "openwam_sdpa" implementation
    reads the restarting position_ids itself: the per-sequence loss either
    way, on sdpa_varlen."""
    batch = packed_batch(False)
    model = tiny_model("llama", use_cache=use_cache)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        packed = token_sum_loss(model, batch)
    padded = token_sum_loss(tiny_model("llama", use_cache=use_cache), padded_batch())
    assert sum(e.count for e in prof.key_averages() if e.key == "openwam::sdpa_varlen") == LAYERS
    torch.testing.assert_close(packed, padded, rtol=2e-5, atol=1e-4)


def test_packed_matches_hf_sdpa_block_diagonal_mask():
    """The same packed batch through transformers' own "sdpa" (its dense
    block-diagonal mask from position_ids): the same logits."""
    batch = packed_batch(False)
    ours = tiny_model("llama")(**{k: v for k, v in batch.items() if k != "labels"}).logits
    ref = tiny_model("llama", "sdpa")(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_unpad_setting_matches_padded(monkeypatch, side):
    batch = padded_batch(side)
    ref_losses, ref_counts = train(tiny_model("llama"), batch)
    monkeypatch.setenv("OPENWAM_SDPA_UNPAD", "1")
    losses, counts = train(tiny_model("llama"), batch)
    assert ref_counts["openwam::sdpa_varlen"] == 0
    assert counts["openwam::sdpa_varlen"] == LAYERS * STEPS, counts
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-5,
                               atol=1e-4)


def test_unpad_setting_rejects_other_values(monkeypatch):
    from openwam_sdpa.transformers_integration import unpad_enabled

    monkeypatch.setenv("OPENWAM_SDPA_UNPAD", "yes")
    with pytest.raises(ValueError, match="OPENWAM_SDPA_UNPAD must be unset, '0' or '1'"):
        unpad_enabled()


def test_one_unpacked_sequence_takes_the_usual_path():
    """position_ids 0..T-1 (no restart): transformers' "sdpa" path with the op."""
    ids = torch.randint(96, (1, 16), generator=torch.Generator().manual_seed(0))
    model = tiny_model("llama")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, position_ids=torch.arange(16)[None])
    keys = {e.key: e.count for e in prof.key_averages()}
    assert keys.get("openwam::sdpa_varlen", 0) == 0
    assert keys.get("openwam::sdpa", 0) == LAYERS


def varlen_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(e.count for e in prof.key_averages() if e.key == "openwam::sdpa_varlen")


def test_generate_style_left_padding_is_not_taken_for_packed():
    """Batch 1, left-padded, with generate()'s position_ids (cumsum of the mask
    minus 1, padding filled with 1: [1, 1, 1, 0, 1, ...]): no packing, so the
    attention mask rules, as in transformers' own "sdpa". Before the
    packing rule asked for a start at 0, the row was split at every 1 and
    the real tokens' logits were off by 0.58 (found in review)."""
    ids = torch.randint(96, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 0] + [1] * 9])
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    args = dict(input_ids=ids, attention_mask=mask, position_ids=pos)
    with torch.no_grad():
        ours, calls = varlen_calls(lambda: tiny_model("llama")(**args).logits)
        ref = tiny_model("llama", "sdpa")(**args).logits
    assert calls == 0
    torch.testing.assert_close(ours[:, 3:], ref[:, 3:], rtol=1e-4, atol=1e-5)


def test_inference_mode_forward_and_generate():
    """Under torch.inference_mode (pipelines, serving) tensors have no version
    counter: the per-forward cache must not read one. An unpacked batch of
    one (generate's prefill) and a packed one both run, with the logits and
    tokens of transformers' "sdpa"."""
    ids = torch.randint(96, (1, 10), generator=torch.Generator().manual_seed(2))
    ours, ref = tiny_model("llama").eval(), tiny_model("llama", "sdpa").eval()
    batch = {k: v for k, v in packed_batch(False).items() if k != "labels"}
    with torch.inference_mode():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-5)
        assert torch.equal(ours.generate(ids, max_new_tokens=4, do_sample=False),
                           ref.generate(ids, max_new_tokens=4, do_sample=False))
        packed, calls = varlen_calls(lambda: ours(**batch).logits)
        torch.testing.assert_close(packed, ref(**batch).logits, rtol=1e-4, atol=1e-5)
    assert calls == LAYERS


def test_position_ids_refilled_in_place_between_forwards():
    """One position_ids buffer reused across forwards, refilled through .data
    (no version bump): each forward reads its boundaries afresh (at its first
    layer), so the second forward attends per its own sequences."""
    model, ref = tiny_model("llama").eval(), tiny_model("llama", "sdpa").eval()
    ids = torch.randint(96, (1, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
        pos.data.copy_(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]]))
        ours, calls = varlen_calls(lambda: model(input_ids=ids, position_ids=pos).logits)
        expected = ref(input_ids=ids, position_ids=pos.clone()).logits
    assert calls == LAYERS
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_unpad_setting_keeps_packed_rows_on_the_sdpa_path(monkeypatch):
    """Rows that each pack several sequences (position_ids restarting inside a
    row, no attention mask): transformers builds a block-diagonal mask. Read as
    key padding, that mask had kept only each row's last sequence, and every
    other token's attention came out zero (logits off by 0.25-0.59); it is no
    key-padding mask, so the "sdpa" path takes it."""
    ids = torch.randint(96, (2, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    with torch.no_grad():
        ref = tiny_model("llama", "sdpa")(input_ids=ids, position_ids=pos).logits
        monkeypatch.setenv("OPENWAM_SDPA_UNPAD", "1")
        ours, calls = varlen_calls(
            lambda: tiny_model("llama")(input_ids=ids, position_ids=pos).logits)
    assert calls == 0
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("unpad", ["0", "1"])
def test_a_float_mask_keeps_its_bias(monkeypatch, unpad):
    """Falcon with ALiBi carries its position bias in a float attention mask,
    which varlen_sdpa has no place for: packed (position_ids restarting) or
    batched under OPENWAM_SDPA_UNPAD=1, the bias had been dropped (logits off
    by 9e-3 and 3e-2). Both now take the "sdpa" path, as stock does."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, alibi=True, new_decoder_architecture=False,
                          multi_query=False, parallel_attn=False, bias=True, use_cache=False)

    def falcon(attn):
        torch.manual_seed(0)
        return FalconForCausalLM._from_config(config, attn_implementation=attn).eval()

    monkeypatch.setenv("OPENWAM_SDPA_UNPAD", unpad)
    g = torch.Generator().manual_seed(0)
    packed = dict(input_ids=torch.randint(96, (1, 10), generator=g),
                  position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]))
    batched = dict(input_ids=torch.randint(96, (2, 8), generator=g))
    with torch.no_grad():
        for inputs in (packed, batched):
            ref = falcon("sdpa")(**inputs).logits
            ours, calls = varlen_calls(lambda: falcon("openwam_sdpa")(**inputs).logits)
            assert calls == 0
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_cpu_training_with_attention_dropout_takes_the_sdpa_path():
    """varlen_sdpa's CPU reference has no dropout: a packed batch trained on
    the CPU with attention_dropout raised there, where "sdpa" trains."""
    collator = DataCollatorWithFlattening()
    batch = collator([{"input_ids": s} for s in sequences()])
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         attention_dropout=0.1, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="openwam_sdpa").train()
    loss, calls = varlen_calls(lambda: model(**batch).loss)
    loss.backward()
    assert calls == 0 and torch.isfinite(loss)


def prefix_lm_mask(lengths, prefix):
    """[1, 1, T, T] bool: each sequence causal and apart, the first `prefix`
    tokens of the first sequence seeing each other (a prefix-LM's mask)."""
    total = sum(lengths)
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    first = torch.arange(total) < prefix
    allowed = torch.ones(total, total, dtype=torch.bool).tril() | (first[:, None] & first[None, :])
    return (allowed & (sequence[:, None] == sequence[None, :]))[None, None]


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_a_mask_beyond_the_packing_is_kept(flash_kwargs):
    """A packed row whose mask asks more than the packing (a custom 4-D
    prefix-LM mask here; Gemma 3's and PaliGemma's image blocks alike): the
    packed route had run each sequence causal and dropped it (logits off by
    0.33). It now reads the mask once per forward and takes the "sdpa" path
    with it, as transformers' "sdpa" does."""
    batch = {k: v for k, v in packed_batch(flash_kwargs).items() if k != "labels"}
    batch["attention_mask"] = prefix_lm_mask(LENGTHS, prefix=5)
    with torch.no_grad():
        ours, calls = varlen_calls(lambda: tiny_model("llama")(**batch).logits)
        ref = tiny_model("llama", "sdpa")(**batch).logits
    assert calls == 0
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_the_mask_of_a_plain_packing_is_read_once_per_forward(monkeypatch):
    """With use_cache off transformers builds the packing's own block-diagonal
    mask: read once per forward (not per layer), it keeps the varlen path."""
    from openwam_sdpa import transformers_integration as ti

    reads = []
    check = ti._mask_beyond_packing
    monkeypatch.setattr(ti, "_mask_beyond_packing", lambda *a: reads.append(1) or check(*a))
    batch = {k: v for k, v in packed_batch(False).items() if k != "labels"}
    model = tiny_model("llama", use_cache=False)
    with torch.no_grad():
        for forward in range(2):
            _, calls = varlen_calls(lambda: model(**batch).logits)
            assert calls == LAYERS and len(reads) == forward + 1


def test_padding_inside_a_packed_row_keeps_the_sequences_apart():
    """A packed row padded at its end (the padding's positions going on from
    the last sequence) with a 2-D attention mask: transformers sees no packing
    then, and its "sdpa" lets the sequences see each other. The op takes the
    "sdpa" path with the mask restricted to each sequence: the logits of
    every sequence run alone."""
    seqs, pad = sequences(), 3
    ids = torch.tensor([sum(seqs, [])])
    total = ids.shape[1]
    pos = torch.cat([torch.arange(len(s)) for s in seqs[:-1]]
                    + [torch.arange(len(seqs[-1]) + pad)])[None]
    ids = torch.cat([ids, torch.zeros(1, pad, dtype=torch.long)], 1)
    mask = torch.ones(1, total + pad, dtype=torch.long)
    mask[0, total:] = 0
    with torch.no_grad():
        ours, calls = varlen_calls(lambda: tiny_model("llama")(
            input_ids=ids, position_ids=pos, attention_mask=mask).logits[:, :total])
        ref_model = tiny_model("llama", "sdpa")
        ref = torch.cat([ref_model(input_ids=torch.tensor([s])).logits for s in seqs], 1)
    assert calls == 0
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_gemma3_image_blocks_in_a_packed_row(flash_kwargs):
    """Gemma 3's image tokens see each other both ways (token_type_ids ->
    transformers' block overlay). A packed row with two images: the packed
    route had run each sequence causal, and the sequences holding an image
    came out off by 0.05-0.08 from each sequence run alone. Its mask asks more
    than the packing, so it takes the "sdpa" path: every sequence's logits."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    image, boi, eoi, n = 100, 101, 102, 4
    config = Gemma3Config(
        vision_config=dict(model_type="siglip_vision_model", image_size=32, patch_size=8,
                           hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2),
        mm_tokens_per_image=n, image_token_index=image, boi_token_index=boi,
        eoi_token_index=eoi,
        text_config=dict(model_type="gemma3_text", vocab_size=128, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         layer_types=["full_attention"] * LAYERS, max_position_embeddings=64))
    seqs = [[2, boi] + [image] * n + [eoi, 5, 6, 7], [2, 9, 10, 11, 12, 13, 14],
            [2, 20, 21, boi] + [image] * n + [eoi, 22, 23]]
    types = [[int(t == image) for t in s] for s in seqs]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    pixels = torch.randn(2, 3, 32, 32)
    lengths = [len(s) for s in seqs]
    batch = dict(input_ids=torch.tensor([sum(seqs, [])]), token_type_ids=torch.tensor([sum(types, [])]),
                 pixel_values=pixels,
                 position_ids=torch.cat([torch.arange(m) for m in lengths])[None])
    if flash_kwargs:
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=max(lengths),
                     max_length_k=max(lengths))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = [model(input_ids=torch.tensor([s]), token_type_ids=torch.tensor([t]),
                       **(dict(pixel_values=pixels[i:i + 1]) if image in s else {})).logits[0]
                 for i, (s, t) in zip((0, 0, 1), zip(seqs, types))]
        model.set_attn_implementation("openwam_sdpa")
        packed, calls = varlen_calls(lambda: model(**batch).logits[0])
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)
    assert calls == 0


@pytest.mark.parametrize("use_cache", [False, True], ids=["use_cache_off", "model_default"])
@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_sliding_window_layers_keep_packed_sequences_apart(use_cache, flash_kwargs):
    """Sliding-window layers (Mistral's here) take "sdpa": varlen_sdpa has no
    window. transformers' mask for them crosses the sequences of a packed row
    where it does not see the packing (with a cache, the model's default):
    the op restricts it to each sequence, so every sequence gets the logits
    it gets alone, whatever use_cache says (they had crossed: the pitfall of
    the test above, on the window's layers)."""
    from transformers import MistralConfig

    config = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=LAYERS, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=6, use_cache=use_cache)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="openwam_sdpa").eval()
    batch = {k: v for k, v in packed_batch(flash_kwargs).items() if k != "labels"}
    with torch.no_grad():
        packed, calls = varlen_calls(lambda: model(**batch).logits[0])
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in sequences()])
    assert calls == 0
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_cross_attention_is_no_packing():
    """A BERT decoder with cross-attention passes its packed position_ids to
    the cross-attention too, whose keys are the encoder's: read as one
    packing they had been split by the decoder's sequences (logits off by
    4.8e-3; found in review). Cross-attention keeps the "sdpa" path: each
    decoder sequence sees its own tokens and the whole encoder output."""
    from transformers import BertConfig, BertLMHeadModel

    config = BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=LAYERS,
                        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
                        is_decoder=True, add_cross_attention=True, use_cache=False)
    torch.manual_seed(0)
    model = BertLMHeadModel(config).eval()
    model.set_attn_implementation("openwam_sdpa")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(96, (1, 12), generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    encoded = torch.randn(1, 12, 64, generator=g)
    with torch.no_grad():
        ours, calls = varlen_calls(lambda: model(input_ids=ids, position_ids=pos,
                                                 encoder_hidden_states=encoded).logits)
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(input_ids=ids[:, a:b], encoder_hidden_states=encoded).logits
                           for a, b in ((0, 5), (5, 12))], 1)
    torch.testing.assert_close(ours, alone, rtol=1e-4, atol=1e-5)
    assert calls == LAYERS  # the self-attention layers only


def test_unpad_setting_leaves_cross_attention_alone(monkeypatch):
    """BART with source and target padded to one length: under
    OPENWAM_SDPA_UNPAD=1 the decoder's cross-attention had been unpadded by
    the encoder's padding, and the decoder tokens past the source's length
    got no attention at all (logits off by 10 at init_std 0.3; found in
    review). It keeps the "sdpa" path; the self-attention layers unpad."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=96, d_model=64, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                        init_std=0.3)
    torch.manual_seed(0)
    model = BartForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(1)
    source = torch.randint(3, 96, (2, 10), generator=g)
    target = torch.randint(3, 96, (2, 10), generator=g)
    source_mask = torch.ones(2, 10, dtype=torch.long)
    source_mask[1, 6:] = 0
    args = dict(input_ids=source, attention_mask=source_mask, decoder_input_ids=target)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(**args).logits
        model.set_attn_implementation("openwam_sdpa")
        monkeypatch.setenv("OPENWAM_SDPA_UNPAD", "1")
        ours, calls = varlen_calls(lambda: model(**args).logits)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert calls == 1  # the encoder's self-attention (the decoder's is unpadded: no padding)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_from_a_padded_prompt_gives_sdpas_tokens(side, use_cache):
    """generate() gives a padded prompt's padding tokens position 0
    (transformers 5.25), so the prompt reads as a packing. Its padding
    queries keep transformers' mask: a right-padded prompt's last row, which
    picks the next token, had seen its padding token alone, and the greedy
    tokens differed from "sdpa"'s (found in review). Without a cache each
    step runs the whole row, the new tokens after the padding, whose
    positions restart in it: a sequence that starts at a padding token
    continues the prompt's (its real queries had lost the prompt)."""
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 0] + [1] * 9])
    mask = mask if side == "left" else mask.flip(-1)
    model = tiny_model("llama", use_cache=use_cache).eval()
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    args["use_cache"] = use_cache
    with torch.no_grad():
        ours = model.generate(**args)
        model.set_attn_implementation("sdpa")
        ref = model.generate(**args)
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_layers_alternating_between_two_masks_read_each_once(monkeypatch):
    """Llama 4's chunked and full layers take two masks, alternating. The
    per-forward cache held one entry and read the masks at every switch (6
    host syncs in a 12-layer forward; found in review): once each now."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from openwam_sdpa import transformers_integration as ti

    reads = []
    check = ti._mask_beyond_packing
    monkeypatch.setattr(ti, "_mask_beyond_packing", lambda *a: reads.append(1) or check(*a))
    layers = 8
    config = Llama4TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                              intermediate_size_mlp=128, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=2, num_experts_per_tok=1,
                              interleave_moe_layer_step=4, attention_chunk_size=4,
                              max_position_embeddings=64, use_cache=False,
                              no_rope_layers=[1, 1, 1, 0] * (layers // 4))
    torch.manual_seed(0)
    model = Llama4ForCausalLM._from_config(config, attn_implementation="openwam_sdpa").eval()
    with torch.no_grad():
        model(**{k: v for k, v in packed_batch(True).items() if k != "labels"})
    assert len(reads) == 2, len(reads)


def test_multimodal_rotary_positions_are_no_packing():
    """Ernie 4.5-VL hands its attention M-RoPE position_ids [3, B, T]:
    flattened, they had read as three sequences of T rows of a T-row batch
    (a RuntimeError on the CPU, offsets past the buffer on CUDA; found in
    review). One position a token is what the packed route reads."""
    if not hasattr(transformers, "Ernie4_5_VLMoeTextModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Ernie 4.5-VL")
    from transformers import Ernie4_5_VLMoeTextConfig, Ernie4_5_VLMoeTextModel

    config = Ernie4_5_VLMoeTextConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=[32, 32], moe_k=2,
        moe_num_experts=4, moe_num_shared_experts=0, mlp_layer_types=["dense"] * LAYERS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2, 2, 4]})
    torch.manual_seed(0)
    model = Ernie4_5_VLMoeTextModel(config).eval()
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, use_cache=False).last_hidden_state
        model.set_attn_implementation("openwam_sdpa")
        ours, calls = varlen_calls(lambda: model(input_ids=ids, use_cache=False).last_hidden_state)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert calls == 0


def test_unpad_setting_leaves_unmarked_cross_attention_alone(monkeypatch):
    """Moonshine's encoder_attn carries no cross-attention mark (no flag, no
    is_decoder, a class shared with self-attention): under
    OPENWAM_SDPA_UNPAD=1 a decoder as long as the encoder had its rows
    gathered by the encoder's padding (off by 1.8; found in review). In an
    encoder-decoder model, attention that is not causal keeps "sdpa"."""
    if not hasattr(transformers, "MoonshineForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Moonshine")
    from transformers import MoonshineConfig, MoonshineForConditionalGeneration

    config = MoonshineConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                             encoder_num_hidden_layers=1, decoder_num_hidden_layers=LAYERS,
                             encoder_num_attention_heads=4, decoder_num_attention_heads=4,
                             pad_token_id=0, decoder_start_token_id=1)
    torch.manual_seed(0)
    decoder = MoonshineForConditionalGeneration(config).eval().model.decoder
    g = torch.Generator().manual_seed(0)
    encoded = torch.randn(2, 6, 64, generator=g)
    args = dict(input_ids=torch.randint(3, 100, (2, 6), generator=g),
                attention_mask=torch.ones(2, 6, dtype=torch.long), encoder_hidden_states=encoded,
                encoder_attention_mask=torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]), use_cache=False)
    with torch.no_grad():
        decoder.set_attn_implementation("sdpa")
        ref = decoder(**args).last_hidden_state
        decoder.set_attn_implementation("openwam_sdpa")
        monkeypatch.setenv("OPENWAM_SDPA_UNPAD", "1")
        ours = decoder(**args).last_hidden_state
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_one_mask_read_by_causal_and_bidirectional_layers(monkeypatch):
    """The per-forward cache keyed a mask's reading on the mask alone: a
    bidirectional layer after a causal one, handed the same causal
    key-padding mask, reused the causal layer's reading (key padding, so
    varlen without the causal triangle) and attended to later tokens (found
    in review). Each causality reads the mask once."""
    from types import SimpleNamespace

    from openwam_sdpa import transformers_integration as ti

    monkeypatch.setenv("OPENWAM_SDPA_UNPAD", "1")
    g = torch.Generator().manual_seed(0)
    B, H, S, E = 2, 2, 6, 8
    q, k, v = (torch.randn(B, H, S, E, generator=g) for _ in range(3))
    real = torch.tensor([[1] * S, [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    mask = (real[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril())  # [B, 1, S, S]
    mask = mask | ~real[:, None, :, None]  # padding queries see every key (transformers' rule)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for layer, is_causal in ((0, True), (1, False)):
        module = SimpleNamespace(layer_idx=layer, is_causal=is_causal, training=False)
        args = (module, q, k, v, mask)
        # None: "sdpa" applies as it is (transformers' own attention).
        got, _ = (ti.packed_attention(*args, scaling=None, dropout=0.0)
                  or ti.sdpa_path(*args, scaling=None, dropout=0.0))
        real_rows = real[:, :, None, None]  # [B, S, 1, 1]: padding queries' rows are free
        torch.testing.assert_close(got * real_rows, want.transpose(1, 2) * real_rows,
                                   msg=f"layer {layer}, is_causal={is_causal}")
