"""Train a Hugging Face causal LM with openwam_sdpa on a left-padded batch.

Nothing is downloaded: the model (Qwen2 architecture) is built from a config
and randomly initialised. Left padding is what batched prompts look like in
DPO, GRPO and generation-style fine-tuning, and it is the most common way to
meet cuDNN's backward NaN: the padding's query rows see no key, stock cuDNN
gives them a logsumexp near -65504, and their dQ rows turn NaN at the key
lengths the defect hits (s % 128 == 64 on cuDNN 9.19, e.g. 704).

Run it from the repository root; transformers comes with the `hf` extra:

    pip install --no-build-isolation ".[hf]"
    python examples/train_hf.py                  # CUDA GPU: bf16 autocast, 704 tokens
    python examples/train_hf.py --attn sdpa      # stock SDPA, for comparison
    python examples/train_hf.py --device cpu --steps 3 --seq 40 --hidden 64 --layers 1

The last line is the verdict: whether every step's loss and gradients were
finite, and which attention ran (openwam_sdpa.explain() of the first call).
Stock SDPA goes NaN only on a CUDA GPU whose cuDNN has the defect
(`python -m openwam_sdpa doctor` says whether yours does); on the CPU the
example trains and says so.
"""

import argparse
import contextlib
import math
import sys

import torch

import openwam_sdpa  # registers attn_implementation="openwam_sdpa" once transformers is imported
# this folder's attention_verdict.py, on sys.path as the example runs
from attention_verdict import FirstAttentionCall, check_sizes, verdict

try:
    from transformers import AutoModelForCausalLM, Qwen2Config
except ImportError:
    sys.exit('examples/train_hf.py needs transformers: pip install --no-build-isolation ".[hf]" '
             "(or pip install transformers)")

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attn", default="openwam_sdpa", choices=["openwam_sdpa", "sdpa", "eager"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=704, help="tokens per row, padding included")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=4,
                   help="query heads (half as many key/value heads, at least one: GQA)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    args = p.parse_args()
    check_sizes(p, args, "hidden", kv_heads(args.heads), even_head_dim=True)
    return args


def kv_heads(heads):
    """The key/value heads of the model: half the query heads (GQA), at least one."""
    return max(1, heads // 2)


def left_padded_batch(batch, seq, vocab, device):
    """Random tokens; row i starts with i * seq // (2 * batch) padding tokens,
    which the attention mask hides and the loss ignores (label -100)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (batch, seq), generator=g)
    padding = torch.arange(batch) * seq // (2 * batch)
    attention_mask = (torch.arange(seq) >= padding[:, None]).long()
    labels = ids.masked_fill(attention_mask == 0, -100)
    return ids.to(device), attention_mask.to(device), labels.to(device)


def main():
    args = parse_args()
    device = torch.device(args.device)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=kv_heads(args.heads),
                         max_position_embeddings=max(args.seq, 128), use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, attention_mask, labels = left_padded_batch(args.batch, args.seq, args.vocab, device)
    # bf16 autocast on the GPU, as mixed-precision training runs; fp32 on the CPU.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    print(f"{args.attn} on {device}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, batch {args.batch} x {args.seq} tokens, left-padded")
    openwam_sdpa.frontend_stats(reset=True)
    first_call, bad_steps = FirstAttentionCall(), []
    for step in range(args.steps):
        # Step 0's forward runs inside FirstAttentionCall, which names the attention.
        with autocast, (first_call if step == 0 else contextlib.nullcontext()):
            loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # nan if any is
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}  grad norm {grad_norm.item():.3f}")
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())):
            bad_steps.append(step)
    if device.type != "cuda" and not bad_steps:
        print("note: no NaN to show here: the NaN demonstration needs a CUDA GPU with cuDNN "
              "attention (the defect is in cuDNN's attention backward); this run checks that "
              "training works on the CPU")
    print(verdict(bad_steps, args.steps, first_call, openwam_sdpa.frontend_stats(),
                  none_seen="no scaled_dot_product_attention call seen (eager attention)"))


if __name__ == "__main__":
    main()
