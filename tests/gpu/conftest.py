"""Shared fixtures and helpers of the GPU suite.

Everything here is importable on a machine without CUDA (the test modules
import the helpers at collection time); nothing touches the GPU until a test
runs, and every test module skips itself without CUDA.

What the helpers build:

* adversarial inputs: keys share a large component ``A * u`` and chosen query
  rows point against it, so that every visible logit of those rows is about
  ``target`` and the row's logsumexp lies far below -88.7 (= -ln FLT_MAX).
  That is what trips the cuDNN key-tail defect (DESIGN.md section 1).
* masks: bool, additive (random bias, -inf where hidden) or none, with at least
  one visible key per query row unless asked otherwise.
* a float64 reference with a safe softmax (a row that sees no key gives zero
  output and zero gradient), differentiated by autograd.
* the error rule of flash-attention: in half precision our error against the
  reference must be at most twice PyTorch's own error on the same inputs, plus
  a small floor.
* a session-wide results record written to $OUT as gpu_suite_results.json/.md.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
from collections import Counter
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

# tests/conftest.py, on sys.path through pytest's rootdir-relative import.
from conftest import reference_attention_lse

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - only on very old torch
    SDPBackend = sdpa_kernel = None

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "needs a CUDA GPU: the cuDNN defect and its fix only exist there"

# Every module of the suite carries these marks: `gpu` (declared in
# pyproject.toml) and a skip, with the reason, where there is no CUDA device.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON),
]

# -ln(FLT_MAX): a row whose logsumexp lies below this overflows exp(0 - lse).
LSE_OVERFLOW = -88.72
# The cuDNN backward walks keys in tiles of this many rows.
KEY_TILE = 128
# The stack the defect was measured on (torch 2.11.0+cu130, cuDNN 9.19.0, H200).
MEASURED_CUDNN = 91900
# The adversarial construction: keys share A * u; the query row is scaled so
# that scale * q.k is about `target` for every key.
ADVERSARIAL_A = 30.0
DEFAULT_TARGET = -110.0



# --------------------------------------------------------------------------
# Environment of the suite
# --------------------------------------------------------------------------


def cudnn_version() -> int:
    """The loaded cuDNN, e.g. 91900; 0 where there is none."""
    return torch.backends.cudnn.version() or 0


def stock_defect_measured(s_kv: int, head_dim: int, is_causal: bool = False) -> bool:
    """Whether stock cuDNN was *measured* to give non-finite dQ for this key
    length on this stack (cuDNN 9.19.0, H200, 2026-11-30): s_kv % 128 == 64
    at head_dim 128 (64, 192, 320, 704, 1088 failed) and 64 (64 and 320
    failed; the remainder sweep found no other r). is_causal never failed.
    Elsewhere the stock count is recorded, not asserted."""
    if is_causal or cudnn_version() != MEASURED_CUDNN:
        return False
    return head_dim in (64, 128) and s_kv % KEY_TILE == 64


@functools.lru_cache(maxsize=None)
def cudnn_attention_unusable() -> str | None:
    """Why stock cuDNN attention cannot run a tiny forward+backward here, or
    None when it can. Cached: probed once per session."""
    if not HAS_CUDA:
        return NO_CUDA_REASON
    if sdpa_kernel is None:
        return "torch.nn.attention.sdpa_kernel is missing (torch too old)"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available to this PyTorch build"
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            .requires_grad_()
            for _ in range(3)
        )
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v)
        out.sum().backward()
        torch.cuda.synchronize()
    except RuntimeError as e:  # "No available kernel", missing sm90 support, ...
        return f"cuDNN attention is not usable here: {str(e).splitlines()[0]}"
    return None


@pytest.fixture(autouse=True)
def _require_cudnn_attention():
    """Skip (with the reason) where stock cuDNN attention does not run: the
    suite compares against it and exercises the cuDNN path."""
    reason = cudnn_attention_unusable()
    if reason is not None:
        pytest.skip(reason)


# The `settings` and `ow` fixtures and the per-test reset of the
# OPENWAM_SDPA_* environment come from tests/conftest.py.


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def _generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _as_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """BHSD contiguous, or BSHD storage viewed as BHSD (what a model that
    projects [B, S, H*D] and transposes hands to attention)."""
    if layout == "bhsd":
        return x.contiguous()
    if layout == "bshd":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    raise ValueError(f"unknown layout {layout!r}")


def random_qkv(
    B, H, s_q, s_kv, D, *, dtype=torch.bfloat16, hkv=None, layout="bhsd", seed=0,
    device="cuda", requires_grad=True,
):
    """Ordinary inputs: standard normal q, k, v. Leaf tensors."""
    g = _generator(seed, device)
    hkv = H if hkv is None else hkv
    q = torch.randn(B, H, s_q, D, generator=g, device=device)
    k = torch.randn(B, hkv, s_kv, D, generator=g, device=device)
    v = torch.randn(B, hkv, s_kv, D, generator=g, device=device)
    return tuple(
        _as_layout(t.to(dtype), layout).requires_grad_(requires_grad) for t in (q, k, v)
    )


def adversarial_qkv(
    B, H, s_q, s_kv, D, low_rows, *, target=DEFAULT_TARGET, dtype=torch.bfloat16,
    hkv=None, layout="bhsd", scale=None, seed=0, device="cuda", requires_grad=True,
):
    """Keys share the large component A * u (u = ones(D) / sqrt(D)); the query
    rows in `low_rows` (every batch and head) are -(|target| / (A * scale)) * u
    plus a little noise, so each of their logits is about `target` and their
    logsumexp about target + ln(s_kv) (about -103 for -110): far below the
    overflow threshold. Other rows are ordinary. Leaf tensors."""
    g = _generator(seed, device)
    hkv = H if hkv is None else hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    u = torch.ones(D, device=device) / math.sqrt(D)
    k = torch.randn(B, hkv, s_kv, D, generator=g, device=device) * 0.5 + ADVERSARIAL_A * u
    v = torch.randn(B, hkv, s_kv, D, generator=g, device=device)
    q = torch.randn(B, H, s_q, D, generator=g, device=device)
    magnitude = -target / (ADVERSARIAL_A * scale)
    for r in low_rows:
        q[:, :, r] = -magnitude * u + 0.05 * torch.randn(B, H, D, generator=g, device=device)
    return tuple(
        _as_layout(t.to(dtype), layout).requires_grad_(requires_grad) for t in (q, k, v)
    )


def upstream_grad(out_shape, *, dtype=torch.bfloat16, seed=1, device="cuda", gain=1.0):
    g = _generator(seed, device)
    return (torch.randn(out_shape, generator=g, device=device) * gain).to(dtype)


MASK_KINDS = ("bool", "additive", "none")


def make_mask(
    kind, B, s_q, s_kv, *, dtype=torch.bfloat16, shape="full", keep=0.8,
    empty_rows=(), seed=2, device="cuda",
):
    """An attention mask as F.sdpa takes it.

    kind: "bool" (True = attend), "additive" (0.5 * N(0, 1) where visible,
    -inf where hidden, in `dtype`), or "none" (returns None).
    shape: "full" [B, 1, s_q, s_kv], "keypad" [B, 1, 1, s_kv] (key padding),
    "2d" [s_q, s_kv].
    Every row keeps at least one visible key, except `empty_rows` (query rows
    that see no key at all; "full" and "2d" only).
    """
    if kind == "none":
        return None
    g = _generator(seed, device)
    rows = {"full": s_q, "keypad": 1, "2d": s_q}[shape]
    visible = torch.rand(B, 1, rows, s_kv, generator=g, device=device) < keep
    # At least one visible key per row, at a random position.
    anchor = torch.randint(0, s_kv, (B, 1, rows, 1), generator=g, device=device)
    visible.scatter_(-1, anchor, True)
    for r in empty_rows:
        visible[:, :, r, :] = False
    if shape == "2d":
        visible = visible[0, 0]
    if kind == "bool":
        return visible
    if kind == "additive":
        bias = 0.5 * torch.randn(visible.shape, generator=g, device=device)
        return bias.masked_fill(~visible, float("-inf")).to(dtype)
    raise ValueError(f"unknown mask kind {kind!r}")


# --------------------------------------------------------------------------
# Reference and runs
# --------------------------------------------------------------------------


class Attn(NamedTuple):
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def reference(q, k, v, go, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Attention and its gradients in float64 from the (half-precision) input
    values (tests/conftest.py's reference_attention_lse, differentiated by
    autograd), and the row logsumexp (-inf for a row that sees no key)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention_lse(q64, k64, v64, attn_mask, is_causal, scale, enable_gqa)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), go.double())
    return Attn(out.detach(), dq, dk, dv), lse


def run(fn, q, k, v, go, **kwargs) -> Attn:
    """Forward through `fn` (F.sdpa's signature), then dQ, dK, dV for `go`."""
    out = fn(q, k, v, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return Attn(out.detach(), dq, dk, dv)


def _expand_gqa(fn):
    """F.sdpa with enable_gqa done by repeat_interleave (differentiable), so
    that every PyTorch backend can serve a GQA baseline."""

    def call(q, k, v, enable_gqa=False, **kwargs):
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        return fn(q, k, v, **kwargs)

    return call


def run_stock(backend, q, k, v, go, **kwargs) -> Attn | None:
    """Stock F.sdpa restricted to `backend` (an SDPBackend, or None for
    PyTorch's own choice); None when that backend refuses the inputs."""
    fn = _expand_gqa(F.scaled_dot_product_attention)
    try:
        if backend is None:
            return run(fn, q, k, v, go, **kwargs)
        with sdpa_kernel([backend]):
            return run(fn, q, k, v, go, **kwargs)
    except RuntimeError:  # "No available kernel", or a cuDNN plan it cannot build
        return None


def stock_cudnn(q, k, v, go, **kwargs) -> Attn | None:
    return run_stock(SDPBackend.CUDNN_ATTENTION, q, k, v, go, **kwargs)


def _padded_keys(fn):
    """F.sdpa on keys zero-padded to a multiple of 128 and hidden by the
    mask (False / -inf): the same attention, computed by stock cuDNN without
    the key-tail defect (DESIGN.md: 0 non-finite in every measured case).
    Differentiable; the padded keys' gradients are dropped by F.pad's
    backward."""

    def call(q, k, v, attn_mask=None, **kwargs):
        s_kv = k.shape[-2]
        extra = -s_kv % KEY_TILE
        k, v = (F.pad(t, (0, 0, 0, extra)) for t in (k, v))
        if attn_mask is None:
            attn_mask = (torch.arange(s_kv + extra, device=q.device) < s_kv).view(1, 1, 1, -1)
        elif attn_mask.dtype == torch.bool:
            attn_mask = F.pad(attn_mask, (0, extra), value=False)
        else:
            attn_mask = F.pad(attn_mask, (0, extra), value=float("-inf"))
        return fn(q, k, v, attn_mask=attn_mask, **kwargs)

    return call


def stock_cudnn_padded(q, k, v, go, **kwargs) -> Attn | None:
    """Stock cuDNN on key-padded inputs (not for is_causal, whose diagonal
    the padding would have to fold into the mask; stock is clean there)."""
    if kwargs.get("is_causal") or k.shape[-2] % KEY_TILE == 0:
        return None
    fn = _expand_gqa(_padded_keys(F.scaled_dot_product_attention))
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return run(fn, q, k, v, go, **kwargs)
    except RuntimeError:
        return None


def stock_baseline(q, k, v, go, **kwargs):
    """What stock PyTorch gets on these inputs where it works: stock cuDNN,
    its non-finite elements (the defect) replaced by stock cuDNN's values on
    key-padded inputs, else by efficient attention's; efficient attention
    throughout where cuDNN refuses the inputs.
    Returns (baseline, stock_cudnn_result_or_None); baseline is None only
    when no stock backend serves the inputs."""
    cudnn = stock_cudnn(q, k, v, go, **kwargs)
    if cudnn is not None and all(bool(torch.isfinite(t).all()) for t in cudnn):
        return cudnn, cudnn
    fill = None
    if cudnn is not None:
        fill = stock_cudnn_padded(q, k, v, go, **kwargs)
        if fill is not None and not all(bool(torch.isfinite(t).all()) for t in fill):
            fill = None
    if fill is None:
        fill = run_stock(SDPBackend.EFFICIENT_ATTENTION, q, k, v, go, **kwargs)
    if cudnn is None or fill is None:
        return fill, cudnn
    mixed = Attn(*(torch.where(torch.isfinite(c), c, f) for c, f in zip(cudnn, fill)))
    return mixed, cudnn


# --------------------------------------------------------------------------
# Metrics and the error rule
# --------------------------------------------------------------------------


def nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def nonfinite_grads(r: Attn) -> int:
    return nonfinite(r.dq) + nonfinite(r.dk) + nonfinite(r.dv)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference; inf if x has a non-finite element."""
    if x.numel() == 0:
        return 0.0
    return float((x.double() - ref).abs().max())


def floor_for(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The absolute floor of the error rule: a quarter of one ulp of `dtype`
    at the tensor's largest entry (bf16: 2^-9 * max|ref|; fp16: 2^-12). It
    only matters where stock's own error is ~0; real defects are O(1)."""
    if ref.numel() == 0:
        return 0.0
    return torch.finfo(dtype).eps / 4 * float(ref.abs().max())


def rule_violation(name, ours, baseline, ref, dtype, factor=2.0) -> str | None:
    """flash-attention's tolerance rule: |ours - ref| <= factor * |stock - ref|
    + floor (max norms). Returns a message when violated, else None."""
    err = max_err(ours, ref)
    base = max_err(baseline, ref)
    bound = factor * base + floor_for(ref, dtype)
    if not err <= bound:  # also catches NaN
        return f"{name}: error {err:.3e} > {factor} x stock {base:.3e} + floor = {bound:.3e}"
    return None


def assert_within_stock(ours: Attn, baseline: Attn, ref: Attn, dtype, names="out dq dk dv"):
    problems = [
        rule_violation(n, getattr(ours, n), getattr(baseline, n), getattr(ref, n), dtype)
        for n in names.split()
    ]
    problems = [p for p in problems if p]
    assert not problems, "; ".join(problems)


def assert_close_to_reference(name, x, ref, dtype, ulps=4.0):
    """For checks without a stock baseline: max|x - ref| <= ulps * eps(dtype)
    * max|ref|. Stock bf16/fp16 kernels measure well under 2 eps * max on
    random data; a wrong mask, scale or layout gives errors of order max|ref|."""
    err = max_err(x, ref)
    bound = ulps * torch.finfo(dtype).eps * float(ref.abs().max()) + 1e-12
    assert err <= bound, f"{name}: error {err:.3e} > {bound:.3e} ({ulps} eps x max|ref|)"


def row_rel_errs(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error (2-norm over head_dim) of every query row: [..., S]."""
    num = (x.double() - ref).norm(dim=-1)
    return num / ref.norm(dim=-1).clamp_min(1e-30)


def row_rel_err(x: torch.Tensor, ref: torch.Tensor, rows) -> float:
    """Worst relative error of the given query rows, over batch and heads."""
    return float(row_rel_errs(x, ref)[..., list(rows)].max())


# A repaired (adversarial) dQ row against the float64 reference, relative
# 2-norm error. Every half-precision backward, stock's included, computes
# D_i = dO_i . o_i from the bf16 output, and the keys' shared 30 * u component
# does not cancel that rounding out of dQ_i = scale * sum_j P_ij (dP_ij - D_i)
# k_j: stock's own ordinary rows measure 4% (99th percentile) on these
# inputs, an fp32 recompute of the adversarial row 2-9%, and 80% where a
# causal row sees ten keys. So the bound is relative to stock's own error on
# the same rows (stock cuDNN on key-padded inputs, which is finite there):
# twice it plus 1e-2. A wrong or missing repair is O(1) or NaN.
LOW_ROW_FLOOR = 1e-2


def low_row_problem(dq, ref_dq, rows, baseline_dq) -> str | None:
    """The adversarial rows of dQ against the reference, within twice the
    baseline's error on the same rows plus LOW_ROW_FLOOR. A message when not,
    else None."""
    err = row_rel_err(dq, ref_dq, rows)
    base = row_rel_err(baseline_dq, ref_dq, rows)
    bound = 2 * base + LOW_ROW_FLOOR
    if not err <= bound:
        return (f"adversarial dQ rows {tuple(rows)}: relative error {err:.3e} > "
                f"2 x stock {base:.3e} + {LOW_ROW_FLOOR}")
    return None


def other_rows(t: torch.Tensor, rows) -> torch.Tensor:
    """`t` without the given query rows (dim -2)."""
    keep = torch.ones(t.shape[-2], dtype=torch.bool, device=t.device)
    keep[list(rows)] = False
    return t[..., keep, :]


# --------------------------------------------------------------------------
# Session results, written to $OUT
# --------------------------------------------------------------------------


class SuiteResults:
    """Rows keyed by (section, key); fields merge, so the tests of one case at
    several settings fill one row. Written at session end."""

    def __init__(self):
        self.sections: dict[str, dict[str, dict]] = {}
        self.outcomes: Counter = Counter()
        self.failed: list[str] = []

    def put(self, section: str, key: str, **fields):
        row = self.sections.setdefault(section, {}).setdefault(key, {"case": key})
        row.update(fields)

    def stack(self) -> dict:
        info = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": cudnn_version(),
        }
        if HAS_CUDA:
            info["gpu"] = torch.cuda.get_device_name()
        try:
            import openwam_sdpa

            info["openwam_sdpa"] = getattr(openwam_sdpa, "__version__", "unknown")
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            info["openwam_sdpa"] = f"import failed: {e}"
        try:
            import transformers

            info["transformers"] = transformers.__version__
        except ImportError:
            pass
        return info

    def to_json(self) -> dict:
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "stack": self.stack(),
            "outcomes": dict(self.outcomes),
            "failed": self.failed,
            "sections": {s: list(rows.values()) for s, rows in self.sections.items()},
        }

    @staticmethod
    def to_markdown(doc: dict) -> str:
        st = doc["stack"]
        lines = [
            "# openwam_sdpa GPU suite results",
            "",
            f"- date (UTC): {doc['date']}",
            "- stack: " + ", ".join(f"{k} {v}" for k, v in st.items()),
            "- outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(doc["outcomes"].items())),
        ]
        if doc["failed"]:
            lines.append("- failed: " + ", ".join(f"`{n}`" for n in doc["failed"]))
        for section, rows in doc["sections"].items():
            columns: list[str] = []
            for row in rows:
                columns += [c for c in row if c not in columns]
            lines += ["", f"## {section}", "", "| " + " | ".join(columns) + " |",
                      "|" + "---|" * len(columns)]
            for row in rows:
                lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str):
        doc = self.to_json()
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gpu_suite_results.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
        with open(os.path.join(out_dir, "gpu_suite_results.md"), "w") as f:
            f.write(self.to_markdown(doc))


RESULTS = SuiteResults()


@pytest.fixture(scope="session")
def suite_results() -> SuiteResults:
    return RESULTS


_SUITE_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = {}


def pytest_configure(config):
    # Historic hook: also called for this conftest when it is loaded late
    # (during collection), unlike pytest_sessionstart.
    _ROOT["path"] = str(config.rootpath)


def _in_suite(report) -> bool:
    path = os.path.abspath(os.path.join(_ROOT.get("path", os.getcwd()), report.location[0]))
    return path.startswith(_SUITE_DIR + os.sep)


def pytest_runtest_logreport(report):
    """Count this suite's outcomes for the results record."""
    if not _in_suite(report):
        return
    if report.when == "call" or not report.passed:
        outcome = "error" if report.when != "call" and report.failed else report.outcome
        RESULTS.outcomes[outcome] += 1
        if report.failed:
            RESULTS.failed.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    out_dir = os.environ.get("OUT")
    if out_dir and HAS_CUDA and sum(RESULTS.outcomes.values()):
        RESULTS.write(out_dir)
