#!/usr/bin/env python3
"""openwam_sdpa inside PyTorch's distributed engines: DDP, FSDP2 (eager and
with compiled blocks) and tensor parallelism over DTensor, each compared with
a single-device run of the same model and data.

    torchrun --nproc-per-node 2 tools/train_distributed.py --out OUT
    torchrun --nproc-per-node 2 tools/train_distributed.py --backend gloo --out OUT
    torchrun --nproc-per-node 2 tools/train_distributed.py --device cpu --tiny --out OUT

A small randomly initialised transformer whose attention calls
openwam_sdpa.sdpa trains 5 steps (bf16, SGD) on a left-padded batch at a key
length the guard table marks affected (704 on cuDNN 9.19.0). Left padding is a
trigger of the cuDNN defect: stock F.sdpa turns the fully masked padding rows'
mask into -65504, their logsumexp falls below -88.7 and dQ goes NaN (the
"stock" run shows whether it does on this stack). Every mode must keep every
gradient finite, and its losses and gradient norms must match the
single-device run within bf16 tolerance. Last, on the GPU, a probe of
torch.distributed.tensor.experimental.context_parallel: one causal attention
call under it, by stock F.sdpa, through openwam_sdpa.patch() (default
settings and OPENWAM_SDPA_CUDNN=0) and by openwam_sdpa.sdpa called directly,
each compared with the same call on one device. Writes OUT/results.json and
OUT/results.md; exits 1 when a training check fails (the probe only reports).

On the CPU (gloo) there is no cuDNN path, and torch 2.13's DTensor cannot
shard PyTorch's CPU attention with a mask (its decomposition-based sharding
propagation does not finish), so there the model calls the cuDNN path's leaf
op directly, whose CPU kernel is an fp32 reference: the smoke test runs the
same DTensor sharding rules as the GPU run.

With --backend gloo the ranks may share GPUs (rank i takes GPU i modulo the
count): NCCL refuses two ranks on one GPU, gloo stages CUDA tensors through
the host. That runs the op's CUDA path under every engine on a one-GPU
machine; only the collectives differ from an NCCL run, and the op issues
none. The context-parallel probe needs NCCL's all-to-all and is left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import sys
import time

# NVLink SHARP (multicast) must stay off on the GPU machine (its KINDS.md);
# NCCL reads this when the first communicator is made.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel, RowwiseParallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import openwam_sdpa  # noqa: E402
import openwam_sdpa.distributed  # noqa: E402,F401  (DTensor rules of the leaf ops)
from openwam_sdpa.adversarial import left_padding_mask  # noqa: E402

# bf16 tolerance of a 5-step loss/grad-norm trajectory against the
# single-device run: bf16 keeps 8 significant bits (relative step 7.8e-3);
# the distributed runs reduce in other orders and the compiled blocks fuse.
LOSS_RTOL = 2e-2
GRAD_NORM_RTOL = 5e-2


@dataclasses.dataclass
class Config:
    vocab: int = 4096
    dim: int = 512
    heads: int = 4
    head_dim: int = 128
    layers: int = 2
    mlp: int = 1024
    batch: int = 8
    seq: int = 704          # s_kv % 128 == 64: affected on cuDNN 9.19.0
    steps: int = 5
    lr: float = 0.3


TINY = Config(vocab=128, dim=64, heads=4, head_dim=16, layers=2, mlp=128, batch=4, seq=40,
              lr=0.5)


# --------------------------------------------------------------------- model

class Attention(nn.Module):
    def __init__(self, cfg: Config, kernel: str):
        super().__init__()
        inner = cfg.heads * cfg.head_dim
        self.head_dim, self.kernel = cfg.head_dim, kernel
        self.q = nn.Linear(cfg.dim, inner, bias=False)
        self.k = nn.Linear(cfg.dim, inner, bias=False)
        self.v = nn.Linear(cfg.dim, inner, bias=False)
        self.o = nn.Linear(inner, cfg.dim, bias=False)
        self.seen: dict = {}  # what the first call saw (placements, route)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        if isinstance(q, DTensor) and not isinstance(mask, DTensor):
            # Tensor parallel: q/k/v are head-sharded DTensors; the mask is
            # the same on every rank.
            mask = DTensor.from_local(mask, q.device_mesh, [Replicate()], run_check=False)
        out = attend(self.kernel, q, k, v, mask)
        if not self.seen and not torch.compiler.is_compiling():
            self.seen = observe(self.kernel, q, k, v, mask, out)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def attend(kernel, q, k, v, mask):
    if kernel == "openwam":
        return openwam_sdpa.sdpa(q, k, v, attn_mask=mask)
    if kernel == "stock":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # "leaf" (CPU): the cuDNN path's leaf op with an additive bias, as
    # openwam::sdpa hands it over on the GPU.
    bias = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return torch.ops.openwam._cudnn_sdpa(q, k, v, bias, 0.0, False, None, True, 0)[0]


def observe(kernel, q, k, v, mask, out) -> dict:
    seen = {"query": placements(q), "output": placements(out)}
    if kernel == "openwam":
        e = openwam_sdpa.explain(q, k, v, mask)
        seen.update(route=e["route"], plan=e["plan"], rule=e["rule"])
    return seen


def placements(t) -> str:
    return str(tuple(t.placements)) if isinstance(t, DTensor) else "local tensor"


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.mlp, bias=False)
        self.down = nn.Linear(cfg.mlp, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config, kernel: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn, self.mlp = Attention(cfg, kernel), MLP(cfg)

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: Config, kernel: str):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, kernel) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens, mask):
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def build_model(cfg: Config, kernel: str, device) -> TinyLM:
    """The same weights on every rank and in every mode: built on the CPU in
    fp32 from one seed, then moved."""
    torch.manual_seed(0)
    model = TinyLM(cfg, kernel)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    return model.to(device=device, dtype=torch.bfloat16)


# ---------------------------------------------------------------------- data

@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor      # [B, S] int64
    mask: torch.Tensor        # [B, 1, S, S] bool, causal and left padding
    loss_mask: torch.Tensor   # [B, S - 1] float, 1 where input and target are real
    n_total: int              # real targets in the whole batch

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.tokens[start:stop], self.mask[start:stop],
                     self.loss_mask[start:stop], self.n_total)


def make_batch(cfg: Config, device) -> Batch:
    g = torch.Generator().manual_seed(1234)
    # Left padding of every length from none to most of the sequence.
    lengths = torch.linspace(cfg.seq, cfg.seq // 8, cfg.batch).round().long()
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    real = torch.arange(cfg.seq) >= (cfg.seq - lengths)[:, None]
    loss_mask = (real[:, :-1] & real[:, 1:]).float()
    mask = left_padding_mask(lengths, cfg.seq, causal=True, device="cpu")
    return Batch(tokens.to(device), mask.to(device), loss_mask.to(device),
                 int(loss_mask.sum()))


# ------------------------------------------------------------------ training

def train(model, batch: Batch, cfg: Config, *, data_parallel: bool, distributed: bool):
    """cfg.steps SGD steps; per step the global loss, gradient norm and non-finite
    gradient elements. Data parallel: each rank holds a slice of the batch,
    and its loss is scaled so that the ranks' averaged gradient is the
    gradient of the global mean loss."""
    # foreach=False: a tensor-parallel model mixes DTensor and plain parameters,
    # which the fused multi-tensor (foreach) update does not take.
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, foreach=False)
    world = dist.get_world_size() if distributed else 1
    scale = world if data_parallel else 1
    losses, norms, nonfinite = [], [], []
    for _ in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        logits = model(batch.tokens, batch.mask)
        nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                              batch.tokens[:, 1:].flatten(), reduction="none")
        loss_sum = (nll * batch.loss_mask.flatten()).sum()
        (loss_sum * (scale / batch.n_total)).backward()
        loss_sum = loss_sum.detach()
        bad, sq = grad_stats(model, distributed)
        if distributed and data_parallel:
            dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / batch.n_total)
        norms.append(math.sqrt(sq))
        nonfinite.append(bad)
        opt.step()
    return {"losses": losses, "grad_norms": norms, "nonfinite_grad_elements": nonfinite}


def grad_stats(model, distributed: bool):
    """(non-finite gradient elements summed over ranks, squared gradient norm).
    A gradient held whole on every rank (DDP's, TP's replicated parameters)
    enters the norm once; sharded DTensor gradients enter with every shard."""
    rank = dist.get_rank() if distributed else 0
    device = next(model.parameters()).device
    bad = torch.zeros((), dtype=torch.int64, device=device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        whole = not isinstance(g, DTensor) or all(pl.is_replicate() for pl in g.placements)
        local = g.to_local() if isinstance(g, DTensor) else g
        bad += (~torch.isfinite(local)).sum()
        if not whole or rank == 0:
            sq += local.double().pow(2).sum()
    if distributed:
        dist.all_reduce(bad)
        dist.all_reduce(sq)
    return int(bad), float(sq)


# --------------------------------------------------------------------- modes

def run_single(cfg, batch, kernel, device):
    model = build_model(cfg, kernel, device)
    result = train(model, batch, cfg, data_parallel=False, distributed=False)
    result["attention"] = model.blocks[0].attn.seen
    return result


def run_ddp(cfg, batch, kernel, device, rank, world):
    model = build_model(cfg, kernel, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    per = cfg.batch // world
    result = train(ddp, batch.rows(rank * per, (rank + 1) * per), cfg,
                   data_parallel=True, distributed=True)
    result["attention"] = model.blocks[0].attn.seen
    return result


def run_fsdp(cfg, batch, kernel, device, rank, world, compile_backend=None):
    model = build_model(cfg, kernel, device)
    mesh = init_device_mesh(device.type, (world,))
    for i, block in enumerate(model.blocks):
        if compile_backend:
            # As torchtitan does: compile each block, then shard it.
            block = torch.compile(block, backend=compile_backend)
            model.blocks[i] = block
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    per = cfg.batch // world
    result = train(model, batch.rows(rank * per, (rank + 1) * per), cfg,
                   data_parallel=True, distributed=True)
    first = model.blocks[0]
    result["attention"] = getattr(first, "_orig_mod", first).attn.seen
    return result


def run_tp(cfg, batch, kernel, device, world):
    model = build_model(cfg, kernel, device)
    mesh = init_device_mesh(device.type, (world,))
    plan = {}
    for i in range(cfg.layers):
        for proj in ("q", "k", "v"):
            # DTensor out, so that attention sees head-sharded q/k/v.
            plan[f"blocks.{i}.attn.{proj}"] = ColwiseParallel(use_local_output=False)
        plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.up"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.down"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    result = train(model, batch, cfg, data_parallel=False, distributed=True)
    result["attention"] = model.blocks[0].attn.seen
    return result


def measured(fn, device, *args, **kwargs):
    """fn's result with its wall time and this rank's peak memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    openwam_sdpa.frontend_stats(reset=True)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        result["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    result["seconds"] = time.perf_counter() - start
    # On this rank: backward calls that ran with cuDNN's padding mask, calls
    # on shifted scores (the fixes; a key mask's shift runs in its forward),
    # and calls that took ATen's cuDNN attention
    # instead (a graph the frontend could not build); 0 on the CPU.
    stats = openwam_sdpa.frontend_stats(reset=True)
    result["padding_mask_backwards"] = stats["padding_mask_backwards"]
    result["score_shift_backwards"] = stats["score_shift_backwards"]
    result["aten_fallback_calls"] = stats["aten_fallback_calls"]
    return result


# ---------------------------------------------------- context parallel probe

CP_ATOL = 5e-2  # of outputs and gradients scaled to max |reference| = 1 (bf16)


def probe_context_parallel(cfg: Config, device, world: int) -> dict:
    """One causal attention call (forward and backward) under context_parallel,
    made four ways, against the same call on one device. context_parallel
    wraps F.scaled_dot_product_attention as it finds it on entry and turns
    PyTorch's own attention ops into ring attention."""
    mesh = init_device_mesh(device.type, (world,))
    g = torch.Generator().manual_seed(99)
    q, k, v = (torch.randn(2, cfg.heads, cfg.seq, cfg.head_dim, generator=g)
               .to(device, torch.bfloat16) for _ in range(3))
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=True)
    ref_out.sum().backward()
    reference = [ref_out.detach()] + [t.grad for t in ref]

    def with_settings(cudnn):
        def enter():
            os.environ["OPENWAM_SDPA_CUDNN"] = cudnn
            openwam_sdpa.reload_settings()
            return openwam_sdpa.patch()
        return enter

    def patched_inside(*args, **kwargs):
        # What attn_implementation="openwam_sdpa" does around transformers' sdpa code.
        with openwam_sdpa.patch():
            return F.scaled_dot_product_attention(*args, **kwargs)

    cases = {
        "stock F.sdpa": (None, lambda: F.scaled_dot_product_attention),
        "openwam_sdpa.patch() before entering": (
            openwam_sdpa.patch, lambda: F.scaled_dot_product_attention),
        "openwam_sdpa.patch() before entering, OPENWAM_SDPA_CUDNN=0": (
            with_settings("0"), lambda: F.scaled_dot_product_attention),
        "openwam_sdpa.sdpa called directly": (None, lambda: openwam_sdpa.sdpa),
        "openwam_sdpa.patch() inside (attn_implementation=\"openwam_sdpa\")": (
            None, lambda: patched_inside),
    }
    pytorch_sdpa = F.scaled_dot_product_attention
    saved = os.environ.get("OPENWAM_SDPA_CUDNN")
    results = {}
    for name, (before, attention) in cases.items():
        try:
            patch = before() if before else None
            try:
                results[name] = cp_call(mesh, attention, q, k, v, reference)
            finally:
                if patch is not None:
                    patch.__exit__(None, None, None)
                if saved is None:
                    os.environ.pop("OPENWAM_SDPA_CUDNN", None)
                else:
                    os.environ["OPENWAM_SDPA_CUDNN"] = saved
                openwam_sdpa.reload_settings()
        except Exception as exc:
            results[name] = {"outcome": f"raises {type(exc).__name__}",
                             "message": str(exc).splitlines()[0][:400]}
        if F.scaled_dot_product_attention is not pytorch_sdpa:
            results[name]["outcome"] += "; F.scaled_dot_product_attention left replaced"
            F.scaled_dot_product_attention = pytorch_sdpa
    return results


def cp_call(mesh, attention, q, k, v, reference) -> dict:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    cq, ck, cv = (t.detach().clone() for t in (q, k, v))
    with context_parallel(mesh, buffers=[cq, ck, cv], buffer_seq_dims=[2, 2, 2]):
        wrapper = F.scaled_dot_product_attention  # context_parallel's
        try:
            for t in (cq, ck, cv):
                t.requires_grad_()
            out = attention()(cq, ck, cv, is_causal=True)
            out.sum().backward()
            local = [out.detach()] + [t.grad for t in (cq, ck, cv)]
            wrapper_kept = F.scaled_dot_product_attention is wrapper
        finally:
            # context_parallel restores the buffers with resize_(), which a
            # tensor that requires grad refuses (and that error would hide
            # the one raised above).
            for t in (cq, ck, cv):
                t.requires_grad_(False)
    got = context_parallel_unshard(mesh, local, [2] * 4)
    errors = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
              for a, b in zip(got, reference)]
    matches = all(e <= CP_ATOL for e in errors)
    outcome = "matches one device" if matches else "WRONG values, no error"
    if not wrapper_kept:
        outcome += "; context_parallel's F.scaled_dot_product_attention was replaced"
    return {"outcome": outcome, "max_scaled_error_out_dq_dk_dv": errors}


# -------------------------------------------------------------------- checks

def check(result, reference) -> list:
    """What is wrong with a mode's run against the single-device reference."""
    problems = []
    if any(result["nonfinite_grad_elements"]):
        problems.append(f"non-finite gradients {result['nonfinite_grad_elements']}")
    for name, rtol in (("losses", LOSS_RTOL), ("grad_norms", GRAD_NORM_RTOL)):
        got, want = result[name], reference[name]
        diff = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        result[f"max_rel_diff_{name}"] = diff
        if not math.isfinite(diff) or diff > rtol:
            problems.append(f"{name} differ from the single-device run by {diff:.3g} "
                            f"(tolerance {rtol})")
    return problems


def stack_facts(cfg, device, world, backend) -> dict:
    info = openwam_sdpa.build_info()
    facts = {"torch": torch.__version__, "device": str(device), "ranks": world,
             "backend": backend,
             "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
             "openwam_sdpa": openwam_sdpa.__version__, "config": dataclasses.asdict(cfg)}
    if device.type == "cuda":
        version = torch.backends.cudnn.version() or 0
        facts.update(gpu=torch.cuda.get_device_name(device), cudnn=version,
                     affected=openwam_sdpa.key_tail_defect(version, cfg.seq, cfg.head_dim))
    facts["build_info"] = {k: str(v) for k, v in info.items()}
    return facts


def markdown(facts, results, cp) -> str:
    cfg = facts["config"]
    shared = (f" sharing {facts['gpus']} GPU(s)" if 0 < facts["gpus"] < facts["ranks"]
              else "")
    lines = [
        "# openwam_sdpa under DDP, FSDP2 and tensor parallelism",
        "",
        f"torch {facts['torch']}, {facts.get('gpu', facts['device'])}, cuDNN "
        f"{facts.get('cudnn', 'n/a')}; key length {cfg['seq']} (guard table: "
        f"{'affected' if facts.get('affected') else 'not affected'}), head_dim "
        f"{cfg['head_dim']}, bf16, left-padded batch of {cfg['batch']}, "
        f"{cfg['steps']} SGD steps, {facts['ranks']} ranks over {facts['backend']}{shared}.",
        "",
        "| mode | attention sees (q; out) | route / plan | non-finite grads "
        "| loss first, last | max rel. diff loss / grad norm | peak MiB per rank | s | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        seen = r.get("attention") or {}
        sees = f"{seen['query']}; {seen['output']}" if seen else "- (compiled)"
        route = f"{seen.get('route', '-')} / {seen.get('plan', '-')}"
        peaks = r.get("peak_memory_mib_per_rank") or (
            [r["peak_memory_mib"]] if "peak_memory_mib" in r else [])
        peak = ", ".join(f"{m:.0f}" for m in peaks) or "-"
        diffs = (f"{r['max_rel_diff_losses']:.1e} / {r['max_rel_diff_grad_norms']:.1e}"
                 if "max_rel_diff_losses" in r else "-")
        losses = r.get("losses") or [float("nan")]
        lines.append(
            f"| {name} | {sees} | {route} | {sum(r.get('nonfinite_grad_elements', []))} "
            f"| {losses[0]:.4f}, {losses[-1]:.4f} | {diffs} | {peak} "
            f"| {r.get('seconds', 0.0):.1f} | {r['verdict']} |")
    if cp:
        lines += ["", "## context_parallel (one causal attention call, forward and backward)",
                  "", "| call | outcome | detail |", "|---|---|---|"]
        for name, r in cp.items():
            detail = r.get("message") or ", ".join(
                f"{e:.1e}" for e in r.get("max_scaled_error_out_dq_dk_dv", []))
            lines.append(f"| {name} | {r['outcome']} | {detail} |")
    return "\n".join(lines) + "\n"


def verdicts(results) -> bool:
    """Sets every mode's verdict; True when every training check passed."""
    reference, ok = results["single device"], True
    for name, r in results.items():
        if "error" in r:
            r["verdict"], ok = f"FAIL: {r['error']}", False
        elif "stock" in name:
            broke = any(r["nonfinite_grad_elements"]) or not all(map(math.isfinite, r["losses"]))
            r["verdict"] = ("control: stock goes non-finite" if broke
                            else "control: stock stays finite on this stack")
        else:
            problems = check(r, reference) if r is not reference else (
                ["non-finite gradients"] if any(r["nonfinite_grad_elements"]) else [])
            r["verdict"] = "FAIL: " + "; ".join(problems) if problems else "pass"
            ok = ok and not problems
    return ok


def write(out_dir, facts, results, cp, ok) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"stack": facts, "pass": ok, "results": results,
                   "context_parallel": cp}, f, indent=1)
    table = markdown(facts, results, cp)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    print(table, flush=True)


# ---------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json/.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="process group backend (default: nccl on cuda, gloo on cpu); "
                             "gloo lets ranks share a GPU")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the FSDP2 blocks (default inductor)")
    args = parser.parse_args()

    cfg = TINY if args.tiny else Config()
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu" and backend == "nccl":
        parser.error("--backend nccl needs --device cuda")
    # A rank that fails alone leaves the other waiting in a collective: end
    # the run in minutes rather than at the default 10.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.batch % world:
        raise SystemExit(f"batch {cfg.batch} does not split over {world} ranks")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        if torch.cuda.device_count() == 0:
            raise SystemExit("--device cuda: no CUDA GPU is visible (--device cpu runs on gloo)")
        if local >= torch.cuda.device_count() and backend == "nccl":
            raise SystemExit(f"rank {local} has no GPU of its own ({torch.cuda.device_count()} "
                             "visible) and NCCL refuses shared GPUs: pass --backend gloo")
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", local % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    kernel = "openwam" if device.type == "cuda" else "leaf"
    batch = make_batch(cfg, device)

    results = {}
    if rank == 0:
        # The single-device reference, and stock F.sdpa as a control: the
        # batch must trip the defect for the comparison to mean anything.
        results["single device"] = measured(run_single, device, cfg, batch, kernel, device)
        if device.type == "cuda":
            results["single device, stock F.sdpa"] = measured(
                run_single, device, cfg, batch, "stock", device)
    dist.barrier()
    modes = {
        "DDP": lambda: run_ddp(cfg, batch, kernel, device, rank, world),
        "FSDP2": lambda: run_fsdp(cfg, batch, kernel, device, rank, world),
        "FSDP2 + compiled blocks": lambda: run_fsdp(
            cfg, batch, kernel, device, rank, world, compile_backend=args.compile_backend),
        "tensor parallel (heads)": lambda: run_tp(cfg, batch, kernel, device, world),
    }
    for name, fn in modes.items():
        try:
            r = measured(fn, device)
        except Exception as exc:  # report it, and carry on with the other modes
            r = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (r.get("peak_memory_mib"), r.get("padding_mask_backwards"),
                                          r.get("aten_fallback_calls"),
                                          r.get("score_shift_backwards")))
        r["peak_memory_mib_per_rank"] = [m for m, _, _, _ in per_rank if m is not None]
        r["padding_mask_backwards_per_rank"] = [n for _, n, _, _ in per_rank if n is not None]
        r["aten_fallback_calls_per_rank"] = [n for _, _, n, _ in per_rank if n is not None]
        r["score_shift_backwards_per_rank"] = [n for _, _, _, n in per_rank if n is not None]
        results[name] = r

    ok = verdicts(results) if rank == 0 else True
    facts = stack_facts(cfg, device, world, backend) if rank == 0 else {}
    if rank == 0:
        write(args.out, facts, results, {}, ok)
    if device.type == "cuda" and backend == "nccl":
        # After the training results are on disk: a probe that hangs or
        # crashes costs only itself.
        cp = probe_context_parallel(cfg, device, world)
        if rank == 0:
            write(args.out, facts, results, cp, ok)
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0)
    dist.destroy_process_group()
    return 0 if verdict[0] else 1


if __name__ == "__main__":
    sys.exit(main())
