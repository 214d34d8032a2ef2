"""Inputs that trip cuDNN's SDPA backward defects, for the doctor, the tests
and the benchmarks (one builder for all three).

Random data never reaches the defects: a query row must have a logsumexp far
below -88.7 (= -ln FLT_MAX). Here every key shares a large component
``A * u`` (u = ones(D) / sqrt(D)) and each chosen query row points against it,
so every logit of that row is about ``target`` and its logsumexp about
``target + ln(s_kv)``: about -103 for the default -110. That is what a
"massive activation" head does to a real model.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import torch

# The shared key component's size; the affected rows are scaled against it.
AMPLITUDE = 30.0
DEFAULT_TARGET = -110.0

# Which query rows of every (batch, head) are affected:
#   "none"          no row (ordinary data, the defect cannot fire)
#   "first"         row 0 of every (b, h)
#   "one_per_head"  one row per (b, h), at a random position
#   "all"           every row
#   a float p       each row independently with probability p (0 < p < 1)
#   a bool tensor   [B, H, s_q] (or broadcastable to it), True = affected
Rows = Union[str, float, torch.Tensor]


class Adversarial(NamedTuple):
    query: torch.Tensor       # [B, H, s_q, D]
    key: torch.Tensor         # [B, Hkv, s_kv, D]
    value: torch.Tensor       # [B, Hkv, s_kv, D]
    grad_out: torch.Tensor    # [B, H, s_q, D], for backward
    affected: torch.Tensor    # bool [B, H, s_q] on the inputs' device


def affected_rows(rows: Rows, batch: int, heads: int, s_q: int, *,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The bool [B, H, s_q] selection (on the CPU) that `rows` describes."""
    shape = (batch, heads, s_q)
    if isinstance(rows, torch.Tensor):
        return rows.to(device="cpu", dtype=torch.bool).expand(shape).clone()
    if isinstance(rows, float):
        if not 0.0 < rows < 1.0:
            raise ValueError(f"a share of rows must lie in (0, 1), got {rows}")
        return torch.rand(shape, generator=generator) < rows
    sel = torch.zeros(shape, dtype=torch.bool)
    if rows == "none" or s_q == 0:
        return sel
    if rows == "first":
        sel[..., 0] = True
    elif rows == "one_per_head":
        index = torch.randint(0, s_q, (batch, heads, 1), generator=generator)
        sel.scatter_(-1, index, True)
    elif rows == "all":
        sel[:] = True
    else:
        raise ValueError(
            f"rows must be 'none', 'first', 'one_per_head', 'all', a share in "
            f"(0, 1) or a bool tensor, got {rows!r}")
    return sel


def as_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """BHSD contiguous ("bhsd"), or BSHD storage viewed as BHSD ("bshd"),
    what a model that projects [B, S, H*D] and transposes hands to attention."""
    if layout == "bhsd":
        return x.contiguous()
    if layout == "bshd":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")


def adversarial_inputs(batch: int, heads: int, s_q: int, s_kv: int, head_dim: int, *,
                       rows: Rows = "first", target: float = DEFAULT_TARGET,
                       kv_heads: int | None = None, scale: float | None = None,
                       layout: str = "bhsd", dtype: torch.dtype = torch.bfloat16,
                       device: Union[str, torch.device] = "cpu", seed: int = 0,
                       requires_grad: bool = False) -> Adversarial:
    """q, k, v (and an upstream gradient) whose `rows` have every logit near
    `target`. Other rows are standard normal. Built in float32 on the CPU
    from `seed`, so every device and dtype gets the same numbers."""
    g = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    u = torch.ones(head_dim) / math.sqrt(head_dim)
    k = torch.randn(batch, kv_heads, s_kv, head_dim, generator=g) * 0.5 + AMPLITUDE * u
    v = torch.randn(batch, kv_heads, s_kv, head_dim, generator=g)
    q = torch.randn(batch, heads, s_q, head_dim, generator=g)
    grad_out = torch.randn(batch, heads, s_q, head_dim, generator=g)
    sel = affected_rows(rows, batch, heads, s_q, generator=g)
    magnitude = -target / (AMPLITUDE * scale)
    low = -magnitude * u + 0.05 * torch.randn(batch, heads, s_q, head_dim, generator=g)
    q = torch.where(sel.unsqueeze(-1), low, q)

    def finish(t):
        t = as_layout(t.to(device=device, dtype=dtype), layout)
        return t.requires_grad_(requires_grad)

    return Adversarial(finish(q), finish(k), finish(v),
                       as_layout(grad_out.to(device=device, dtype=dtype), layout),
                       sel.to(device))


def left_padding_mask(lengths, s: int, *, causal: bool = True,
                      device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """The bool [B, 1, s, s] mask of a left-padded batch, as Hugging Face
    builds it for "sdpa": sequence b holds its `lengths[b]` real tokens at the
    end, and query i sees key j when j is a real token (and j <= i if
    `causal`). Under a causal mask the padding queries see no key at all.
    Those fully masked rows are the trigger: stock cuDNN gives them a
    logsumexp near -65504."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    pos = torch.arange(s)
    real_key = pos.unsqueeze(0) >= (s - lengths).unsqueeze(1)          # [B, s]
    mask = real_key.unsqueeze(1).expand(-1, s, -1).clone()              # [B, q, k]
    if causal:
        mask &= pos.unsqueeze(1) >= pos.unsqueeze(0)
    return mask.unsqueeze(1).to(device)
