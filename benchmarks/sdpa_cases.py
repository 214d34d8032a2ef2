"""What the op benchmark (bench_sdpa.py) runs: shapes, layouts, methods and inputs.

Sections:
  methods  every method on SHAPES x LAYOUTS, then the paired timing of
           openwam_sdpa as shipped against stock cuDNN (and stock again);
  shares   adversarial inputs with a growing share of affected query rows
           (the defect's trigger) on affected key lengths, SHARE_SHAPES;
  memory   peak memory with large materialised masks, MEMORY_CASES.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from stack import openwam_settings

DTYPE = torch.bfloat16
BASE = "cudnn"  # every ratio of the methods and shares sections is to this method

# ---------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One attention problem. mask: None, "q" = [B,1,Sq,Skv] or "k" = [B,1,1,Skv] (bool key padding)."""

    name: str
    b: int
    h: int
    d: int
    sq: int
    skv: int
    mask: str = None

    def mask_shape(self):
        if self.mask is None:
            return None
        return [self.b, 1, self.sq if self.mask == "q" else 1, self.skv]

    def label(self):
        return f"B{self.b} H{self.h} D{self.d} {self.sq}x{self.skv}"

    def mask_label(self):
        return "none" if self.mask is None else "bool " + ("[B,1,Sq,Skv]" if self.mask == "q" else "[B,1,1,Skv]")


SHAPES = [
    Shape("b32_392x392_none", 32, 24, 128, 392, 392),
    Shape("b32_392x392_bool", 32, 24, 128, 392, 392, "q"),
    Shape("b32_360x64_bool", 32, 24, 128, 360, 64, "q"),
    Shape("b16_704x704_none", 16, 24, 128, 704, 704),
    Shape("b16_704x704_bool", 16, 24, 128, 704, 704, "q"),
    Shape("b32_392x392_d64_bool", 32, 24, 64, 392, 392, "q"),
    Shape("b4_4096x4000_none", 4, 24, 128, 4096, 4000),
    Shape("b4_4096x4032_bool", 4, 24, 128, 4096, 4032, "k"),
    Shape("b16_512x512_bool", 16, 24, 128, 512, 512, "q"),
]
QUICK_SHAPES = ("b32_392x392_none", "b32_392x392_bool", "b4_4096x4000_none")
LAYOUTS = ("bshd", "bhsd")

# Affected key lengths on cuDNN 9.19 (s_kv % 128 == 64), at head_dim 128 and 64.
SHARE_SHAPES = [
    Shape("b32_360x64_bool", 32, 24, 128, 360, 64, "q"),
    Shape("b16_704x704_none", 16, 24, 128, 704, 704),
    Shape("b4_4096x4032_none", 4, 24, 128, 4096, 4032),
]
SHARE_HEAD_DIMS = (128, 64)
# Which query rows are affected (openwam_sdpa.adversarial's `rows`): none,
# one per (batch, head), each row with probability 0.1, every row.
SHARES = ("none", "one_per_head", 0.1, "all")
SHARE_LABELS = {"none": "none", "one_per_head": "1 per (b,h)", 0.1: "10%", "all": "all"}

# The selftest's tiny stand-ins (CPU, seconds).
SELFTEST_SHAPES = [
    Shape("tiny_24x24_none", 1, 2, 16, 24, 24),
    Shape("tiny_20x8_bool", 1, 2, 16, 20, 8, "q"),
    Shape("tiny_24x40_bool", 1, 2, 16, 24, 40, "k"),
]
SELFTEST_SHARE_SHAPES = [Shape("tiny_20x8_bool", 2, 2, 16, 20, 8, "q"), Shape("tiny_24x40_none", 1, 2, 16, 24, 40)]
SELFTEST_SHARE_HEAD_DIMS = (16, 8)


def with_head_dim(shape, d):
    return shape if d == shape.d else dataclasses.replace(shape, d=d, name=f"{shape.name}_d{d}")


@dataclass(frozen=True)
class MemoryCase:
    """A large materialised mask. mask: "bool" = causal [B,H,S,S] bool, "additive" = random
    [B,H,S,S] in q's dtype, "bool-broadcast" = causal [1,1,S,S] expanded to [B,H,S,S] (stride 0)."""

    name: str
    b: int
    h: int
    d: int
    s: int
    mask: str

    def label(self):
        return f"B{self.b} H{self.h} D{self.d} {self.s}x{self.s}"

    def mask_label(self):
        return {"bool": "bool [B,H,S,S]", "additive": "additive [B,H,S,S]",
                "bool-broadcast": "bool [1,1,S,S] expanded"}[self.mask]


# The shape of PyTorch's test_mem_eff_attention_long_sequence_mask, which ran
# out of memory only when patched; 8128 is an affected key length (repair plan).
MEMORY_CASES = [MemoryCase(f"b1_{s}_{m}", 1, 32, 64, s, m)
                for s in (8192, 8128) for m in ("bool", "additive", "bool-broadcast")]
SELFTEST_MEMORY_CASES = [MemoryCase(f"tiny_{s}_{m}", 1, 2, 16, s, m)
                         for s in (32, 40) for m in ("bool", "additive", "bool-broadcast")]

# --------------------------------------------------------------------- methods


@dataclass
class Method:
    """One way to run attention: context() is entered around all its calls;
    call(q, k, v, mask) is the forward. openwam: it goes through openwam_sdpa,
    whose decision (openwam_sdpa.explain) is recorded."""

    name: str
    context: Callable
    call: Callable
    no_mask_only: bool = False
    openwam: bool = False


def stock_backend(backend, device):
    """sdpa_kernel(backend). The CPU has no cuDNN or efficient kernel: there (the
    selftest) PyTorch's math backend stands in for a backend the CPU lacks."""
    if device == "cuda":
        return lambda: sdpa_kernel(backend)
    return lambda: sdpa_kernel([backend, SDPBackend.MATH])


def build_methods(ow, ow_error, device):
    """Every method, by name. Stock cuDNN is the reference of the methods and shares sections."""

    def need_ow():
        if ow is None:
            raise RuntimeError(f"openwam_sdpa not importable: {ow_error}")
        return ow

    def stock(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def pad_fwd(q, k, v, mask):
        kp, vp, mp = need_ow().pad_keys(k, v, mask)
        if mp.dim() == 2:  # [1, S_padded] key mask -> [1, 1, 1, S_padded]
            mp = mp[None, None]
        return F.scaled_dot_product_attention(q, kp, vp, attn_mask=mp)

    def openwam(q, k, v, mask):
        return need_ow().sdpa(q, k, v, attn_mask=mask)

    def openwam_with(pad):  # PAD=pad, and cuDNN wherever it can serve the call
        return Method(f"openwam-{pad}", lambda: openwam_settings(PAD=pad, CUDNN="1"), openwam, openwam=True)

    @contextlib.contextmanager
    def openwam_efficient():
        with efficient(), openwam_settings():
            yield

    cudnn = Method(BASE, stock_backend(SDPBackend.CUDNN_ATTENTION, device), stock)
    efficient = stock_backend(SDPBackend.EFFICIENT_ATTENTION, device)
    methods = [
        cudnn,
        Method("efficient", efficient, stock),
        Method("flash", stock_backend(SDPBackend.FLASH_ATTENTION, device), stock, no_mask_only=True),
        Method("pad-fwd", cudnn.context, pad_fwd),
        openwam_with("auto"),
        openwam_with("always"),
        openwam_with("never"),
        # openwam_sdpa as shipped: no OPENWAM_SDPA_* variable set.
        Method("openwam-default", openwam_settings, openwam, openwam=True),
        # F.sdpa with PyTorch's own choice of backend, and restricted to efficient
        # attention (where PyTorch's long-mask memory test runs).
        Method("stock", contextlib.nullcontext, stock),
        Method("stock-efficient", efficient, stock),
        Method("openwam-efficient", openwam_efficient, openwam, openwam=True),
        # A/A control: stock cuDNN again. Its ratio to "cudnn" is the run's
        # noise floor (the two run the very same kernels).
        dataclasses.replace(cudnn, name=f"{BASE}-again"),
    ]
    return {m.name: m for m in methods}


# The methods section's methods (timed one after another), in table order.
METHOD_NAMES = ("cudnn", "efficient", "flash", "pad-fwd", "openwam-auto", "openwam-always", "openwam-never",
                "cudnn-again")
# The paired timing's contenders after stock cuDNN.
PAIRED_NAMES = ("openwam-default", "cudnn-again")
# The shares section's contenders after stock cuDNN.
SHARE_NAMES = ("openwam-default", "openwam-always", "cudnn-again")
# The memory section's methods; ratios are to "stock" (or "stock-efficient").
MEMORY_NAMES = ("stock", "openwam-default", "stock-efficient", "openwam-efficient")

# ---------------------------------------------------------------------- inputs


def to_bhsd(t, layout):
    """The [B,H,S,D] view of a tensor stored in `layout`."""
    return t.transpose(1, 2) if layout == "bshd" else t


def key_padding_mask(shape, device):
    """Bool mask of shape.mask_shape() from the global RNG: batch element b keeps its
    first L_b keys, Skv/2 <= L_b < Skv."""
    lengths = torch.randint(max(1, shape.skv // 2), shape.skv, (shape.b,), device=device)
    keep = torch.arange(shape.skv, device=device)[None, :] < lengths[:, None]
    return keep[:, None, None, :].expand(shape.mask_shape()).contiguous()


def make_inputs(shape, layout, device, seed):
    """Random leaves q, k, v stored in `layout` (requires_grad), the output's gradient
    ([B,H,S,D] view) and the bool mask (or None)."""
    torch.manual_seed(seed)
    b, h, d, sq, skv = shape.b, shape.h, shape.d, shape.sq, shape.skv

    def rand(s):
        size = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
        return torch.randn(size, device=device, dtype=DTYPE)

    leaves = [rand(sq), rand(skv), rand(skv)]
    for t in leaves:
        t.requires_grad_(True)
    grad = to_bhsd(rand(sq), layout)
    mask = None if shape.mask is None else key_padding_mask(shape, device)
    return leaves, grad, mask


class ShareInputs:
    """openwam_sdpa.adversarial inputs of one shape, at any share of affected rows.

    adversarial_inputs() with rows="none" and rows="all" and one seed draw the
    same keys, values and output gradient, and the same low queries for the
    affected rows. So the query of any selection is where(selected, all's,
    none's): exactly adversarial_inputs(rows=selection) (the selftest checks
    this), for two builds per shape instead of one per share. Storage is BSHD,
    what a model hands over; the tensors are [B,H,S,D] views.
    """

    def __init__(self, adversarial, shape, device, seed):
        self.adversarial, self.shape, self.seed = adversarial, shape, seed
        build = dict(batch=shape.b, heads=shape.h, s_q=shape.sq, s_kv=shape.skv, head_dim=shape.d,
                     layout="bshd", dtype=DTYPE, device=device, seed=seed)
        self.ordinary = adversarial.adversarial_inputs(**build, rows="none")
        self.low = adversarial.adversarial_inputs(**build, rows="all")
        torch.manual_seed(seed)
        self.mask = None if shape.mask is None else key_padding_mask(shape, device)

    def select(self, share):
        """(leaves [q, k, v] requiring grad, the output's gradient, mask, number of affected rows)."""
        s = self.shape
        affected = self.adversarial.affected_rows(share, s.b, s.h, s.sq,
                                                  generator=torch.Generator().manual_seed(self.seed + 1))
        sel = affected.to(self.low.query.device)[..., None]
        q = self.adversarial.as_layout(torch.where(sel, self.low.query, self.ordinary.query).detach(), "bshd")
        k, v = (t.detach().clone().requires_grad_(True) for t in (self.ordinary.key, self.ordinary.value))
        return [q.requires_grad_(True), k, v], self.ordinary.grad_out, self.mask, int(affected.sum())


def memory_inputs(case, device, seed):
    """q, k, v ([B,H,S,D], requiring grad), the output's gradient and the case's mask."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size):
        return torch.randn(size, device=device, dtype=DTYPE, generator=gen)

    b, h, s, d = case.b, case.h, case.s, case.d
    leaves = [rand(b, h, s, d).requires_grad_(True) for _ in range(3)]
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    if case.mask == "bool":
        mask = causal.expand(b, h, s, s).contiguous()
    elif case.mask == "additive":
        mask = rand(b, h, s, s)
    else:
        mask = causal.expand(b, h, s, s)
    return leaves, rand(b, h, s, d), mask
