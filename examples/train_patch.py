"""Route a plain PyTorch model's attention through openwam_sdpa with patch().

The model below calls F.scaled_dot_product_attention, as most hand-written
transformers do, with a causal mask over a left-padded batch: the padding's
query rows see no key, which is what trips cuDNN's backward NaN on a GPU.
patch() sends every such call through openwam_sdpa:

    openwam_sdpa.patch()             # process-wide, from here on
    with openwam_sdpa.patch(): ...   # for the block only, restored on exit

Run it from the repository root (after `pip install --no-build-isolation .`):

    python examples/train_patch.py                 # CUDA GPU: bf16 autocast, 704 tokens
    python examples/train_patch.py --route global  # the process-wide form
    python examples/train_patch.py --route stock   # stock F.sdpa, for comparison
    python examples/train_patch.py --device cpu --steps 3 --seq 40 --dim 64 --layers 1

The last line is the verdict: whether every step's loss and gradients were
finite, and which attention ran (openwam_sdpa.explain() of the first call).
The NaN itself needs a CUDA GPU with cuDNN attention and an affected cuDNN
(`python -m openwam_sdpa doctor` says whether yours is); on the CPU the
example trains and says so.
"""

import argparse
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import openwam_sdpa
# this folder's attention_verdict.py, on sys.path as the example runs
from attention_verdict import FirstAttentionCall, check_sizes, verdict


class Block(nn.Module):
    """Pre-norm transformer block; attention is F.scaled_dot_product_attention."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        B, S, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, ids, mask):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def left_padded_batch(batch, seq, vocab, device):
    """Random tokens; row i starts with i * seq // (2 * batch) padding tokens.
    The mask [B, 1, S, S] is causal and hides the padding keys, so the
    padding's own query rows see no key at all (the cuDNN trigger)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (batch, seq), generator=g)
    real = torch.arange(seq) >= (torch.arange(batch) * seq // (2 * batch))[:, None]  # [B, S]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = causal & real[:, None, None, :]
    labels = ids.masked_fill(~real, -100)
    return ids.to(device), mask.to(device), labels.to(device)


def train(model, batch, steps, device):
    """Train; returns (steps whose loss or gradient norm was not finite,
    the first attention call's FirstAttentionCall)."""
    ids, mask, labels = batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first_call, bad_steps = FirstAttentionCall(), []
    for step in range(steps):
        # bf16 autocast on the GPU, as mixed-precision training runs; fp32 on the CPU.
        # Step 0's forward runs inside FirstAttentionCall, which names the attention.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"), \
                (first_call if step == 0 else contextlib.nullcontext()):
            logits = model(ids, mask)
        # Next-token loss; padding positions carry label -100.
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                               ignore_index=-100)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # nan if any is
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}  grad norm {grad_norm.item():.3f}")
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())):
            bad_steps.append(step)
    return bad_steps, first_call


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--route", default="with", choices=["with", "global", "stock"],
                   help="with: `with openwam_sdpa.patch():`; global: openwam_sdpa.patch(); "
                        "stock: PyTorch's own F.sdpa")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=704, help="tokens per row, padding included")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    args = p.parse_args()
    check_sizes(p, args, "dim", args.heads)

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.heads, args.layers).to(device)
    batch = left_padded_batch(args.batch, args.seq, args.vocab, device)
    attention = {"with": "with openwam_sdpa.patch():", "global": "openwam_sdpa.patch()",
                 "stock": "stock F.scaled_dot_product_attention (not patched)"}[args.route]
    print(f"{attention} on {device}: batch {args.batch} x {args.seq} tokens, left-padded")
    openwam_sdpa.frontend_stats(reset=True)
    if args.route == "global":
        openwam_sdpa.patch()
        bad_steps, first_call = train(model, batch, args.steps, device)
    elif args.route == "with":
        with openwam_sdpa.patch():
            bad_steps, first_call = train(model, batch, args.steps, device)
    else:
        bad_steps, first_call = train(model, batch, args.steps, device)
    if device.type != "cuda" and not bad_steps:
        print("note: no NaN to show here: the NaN demonstration needs a CUDA GPU with cuDNN "
              "attention (the defect is in cuDNN's attention backward); this run checks that "
              "training works on the CPU")
    print(verdict(bad_steps, args.steps, first_call, openwam_sdpa.frontend_stats()))


if __name__ == "__main__":
    main()
