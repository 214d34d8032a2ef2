"""The examples' last line: whether training stayed finite, and which attention ran.

Imported by examples/train_hf.py and examples/train_patch.py, which Python runs
with this folder on sys.path.
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import openwam_sdpa

STOCK_SDPA = F.scaled_dot_product_attention  # PyTorch's own, bound before any patch()


class FirstAttentionCall(TorchFunctionMode):
    """Sees every torch call inside it and keeps openwam_sdpa.explain() of the
    first attention call: stock F.sdpa, or the op openwam_sdpa routes it to."""

    def __init__(self):
        super().__init__()
        self.plan, self.stock = None, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.plan is None and (func is STOCK_SDPA or func is torch.ops.openwam.sdpa.default):
            self.plan, self.stock = openwam_sdpa.explain(*args, **kwargs), func is STOCK_SDPA
        return func(*args, **kwargs)


def check_sizes(parser, args, width_flag, kv_heads, even_head_dim=False):
    """parser.error() for sizes the model cannot take, before any tensor is
    built: a next-token loss needs two tokens a row, and the width (the
    option `width_flag`) must split into the heads, the query heads into the
    key/value heads, and with rotary positions (even_head_dim) into heads of
    an even size (review: these had ended in a traceback, or a loss over no
    labels)."""
    width = getattr(args, width_flag)
    for name in ("steps", "batch", "heads", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.seq < 2:
        parser.error(f"--seq must be at least 2 (a next-token loss needs two tokens), "
                     f"got {args.seq}")
    if args.vocab < 2:
        parser.error(f"--vocab must be at least 2, got {args.vocab}")
    if width < 1 or width % args.heads:
        parser.error(f"--{width_flag} ({width}) must be a positive multiple of --heads ({args.heads})")
    if even_head_dim and (width // args.heads) % 2:
        parser.error(f"--{width_flag} / --heads ({width} / {args.heads}) must be even: rotary "
                     "positions rotate pairs of channels")
    if args.heads % kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of the key/value heads ({kv_heads})")


def fix_text(stats):
    """What the cuDNN path did, from openwam_sdpa.frontend_stats() over the run:
    calls whose backward runs on shifted scores (a bool mask's fix; a key
    mask's shift runs in its forward) and backward calls that ran with
    cuDNN's padding mask (the others' fix), both on the op's own cuDNN graphs, and
    calls that took ATen's cuDNN attention instead (a graph the frontend could
    not build). All 0 off the cuDNN path, e.g. on the CPU."""
    return (f"calls on shifted scores: {stats['score_shift_backwards']}, "
            f"with cuDNN's padding mask: {stats['padding_mask_backwards']}, "
            f"calls on the ATen fallback: {stats['aten_fallback_calls']}")


def attention_text(first_call, stats, none_seen="no scaled_dot_product_attention call seen"):
    """Which attention ran, from explain() of its first call, and what the
    cuDNN path did over the run (stats: openwam_sdpa.frontend_stats())."""
    p = first_call.plan
    if p is None:
        return none_seen
    if first_call.stock:
        asked = not p["pytorch_choice"].startswith("not asked")
        text = ("stock F.scaled_dot_product_attention ("
                + (f"PyTorch picks {p['pytorch_choice']})" if asked else f"{p['reason']})"))
        return text + (f"; the guard table lists this call: {p['rule']}" if p["rule"] else "")
    text = f"openwam_sdpa, route {p['route']} ({p['reason']}), plan {p['plan']}"
    text += f", rule {p['rule']}" if p["rule"] else ""
    text += f", engine {p['engine']}" if p["engine"] else ""
    return text + f"; {fix_text(stats)}"


def verdict(bad_steps, steps, first_call, stats, **attention):
    finite = (f"finite: loss and gradients finite in all {steps} steps" if not bad_steps else
              f"NOT finite: loss or gradients non-finite from step {bad_steps[0]} "
              f"({len(bad_steps)} of {steps} steps)")
    return f"verdict: {finite}; attention: {attention_text(first_call, stats, **attention)}"
