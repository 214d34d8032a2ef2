"""`python -m openwam_sdpa doctor`: is this stack affected, and does the fix hold?

Reports the versions that matter, the backend PyTorch picks for a masked bf16
training call, what the guard table says about the runtime cuDNN, and runs the
adversarial case (one query row with logsumexp near -105, s_kv = 704) through
stock SDPA and through openwam_sdpa, counting non-finite gradient elements.

Exit codes: 0 nothing to do (not affected, or no CUDA GPU here to be affected);
1 this stack is affected (stock SDPA gives NaN, or the guard table lists it)
and openwam_sdpa fixes it; 2 openwam_sdpa itself gave non-finite gradients.
"""

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from . import ops

EXIT_OK, EXIT_AFFECTED, EXIT_BROKEN = 0, 1, 2

# The adversarial case: s_kv = 704 (704 % 128 == 64 fails on cuDNN 9.19).
CASE = dict(batch=2, heads=4, s_q=128, s_kv=704, head_dim=128)


def adversarial_inputs(batch, heads, s_q, s_kv, head_dim, device, dtype=torch.bfloat16,
                       target_logit=-110.0):
    """Random q/k/v where query row 0 is anti-aligned with a component all keys
    share: its logits are all near `target_logit`, so its logsumexp is far
    below -88.7 (random data never gets there)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shared = torch.ones(head_dim) / math.sqrt(head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    amplitude = 30.0
    q = torch.randn(batch, heads, s_q, head_dim, generator=gen)
    k = torch.randn(batch, heads, s_kv, head_dim, generator=gen) * 0.5 + amplitude * shared
    v = torch.randn(batch, heads, s_kv, head_dim, generator=gen)
    q[:, :, 0] = (target_logit / (amplitude * scale)) * shared
    grad_out = torch.randn(batch, heads, s_q, head_dim, generator=gen)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(grad_out)


def count_nonfinite_grads(attention, q, k, v, grad_out, mask):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, attn_mask=mask)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return {name: int((~torch.isfinite(g)).sum()) for name, g in zip("qkv", grads)}


def collect_facts():
    info = ops.build_info()
    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn_compiled": info["cudnn_compiled"],
        "cudnn_runtime": info["cudnn_runtime"],
        "built_for_torch": info["torch_version"],
        "extension_has_cuda": info["with_cuda"],
        "gpu": None,
        "not_checked": [],
    }
    if not torch.cuda.is_available():
        facts["not_checked"].append(
            "no CUDA GPU: PyTorch's default backend, the adversarial run and the "
            "fix could not be checked here; run the doctor on the training machine")
        return facts
    facts["gpu"] = f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    version = facts["cudnn_runtime"]
    facts["affected_remainders_d128"] = [
        r for r in range(128) if ops.key_tail_defect(version, 512 + r, 128)]
    q, k, v, grad_out = adversarial_inputs(device="cuda", **CASE)
    mask = torch.ones(CASE["s_q"], CASE["s_kv"], dtype=torch.bool, device="cuda")
    probe = q.detach().requires_grad_()
    facts["openwam_plan"] = ops.explain(probe, k, v, mask)
    facts["pytorch_default_backend"] = facts["openwam_plan"]["pytorch_choice"]
    runs = {}
    for mask_kind, m in (("bool mask", mask), ("no mask", None)):
        runs[f"stock F.sdpa, {mask_kind}"] = count_nonfinite_grads(
            F.scaled_dot_product_attention, q, k, v, grad_out, m)
        runs[f"openwam_sdpa, {mask_kind}"] = count_nonfinite_grads(
            ops.sdpa, q, k, v, grad_out, m)
    facts["adversarial_nonfinite"] = runs
    return facts


def verdict(facts):
    """(one-line verdict, exit code) from collect_facts()'s result."""
    if facts["gpu"] is None:
        return ("not affected here: no CUDA GPU (the defect lives in cuDNN's GPU "
                "backward); run this on the training machine", EXIT_OK)
    runs = facts["adversarial_nonfinite"]
    ours = sum(sum(c.values()) for name, c in runs.items() if name.startswith("openwam"))
    stock = sum(sum(c.values()) for name, c in runs.items() if name.startswith("stock"))
    if ours:
        return (f"BROKEN: openwam_sdpa gave {ours} non-finite gradient elements; "
                "please report this with the output above", EXIT_BROKEN)
    listed = bool(facts["affected_remainders_d128"])
    if stock or listed:
        why = (f"stock SDPA gave {stock} non-finite gradient elements"
               if stock else "the guard table lists this cuDNN as affected")
        return (f"AFFECTED: {why}; openwam_sdpa gave none: use openwam_sdpa.sdpa "
                "or openwam_sdpa.patch()", EXIT_AFFECTED)
    return ("not affected: stock SDPA gave finite gradients and the guard table "
            "lists no failing key length for this cuDNN", EXIT_OK)


def format_report(facts):
    cudnn = lambda v: f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else "none"  # noqa: E731
    lines = [
        "openwam_sdpa doctor",
        f"  torch            {facts['torch']} (extension built for {facts['built_for_torch']})",
        f"  CUDA             {facts['cuda'] or 'none (CPU build)'}",
        f"  cuDNN            runtime {cudnn(facts['cudnn_runtime'])}, compiled {cudnn(facts['cudnn_compiled'])}",
        f"  GPU              {facts['gpu'] or 'none'}",
    ]
    if facts["gpu"] is not None:
        rems = facts["affected_remainders_d128"]
        lines += [
            f"  default backend  {facts['pytorch_default_backend']} (masked bf16 training call)",
            "  guard table      key-tail dQ NaN for s_kv % 128 in "
            + (f"{rems if len(rems) < 10 else 'every nonzero remainder'}" if rems else "none"),
            f"  openwam plan     {facts['openwam_plan']['backend']} / {facts['openwam_plan']['plan']}"
            f" (s_kv={CASE['s_kv']})",
            "  adversarial case (B=2, H=4, 128x704, D=128, bf16, one row lse ~ -105):",
        ]
        for name, counts in facts["adversarial_nonfinite"].items():
            lines.append(f"    {name:28s} non-finite dQ {counts['q']:5d}  dK {counts['k']:5d}  dV {counts['v']:5d}")
    for note in facts["not_checked"]:
        lines.append(f"  not checked: {note}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m openwam_sdpa doctor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(argv)
    facts = collect_facts()
    line, code = verdict(facts)
    if args.json:
        print(json.dumps(dict(facts, verdict=line, exit_code=code), indent=1, default=str))
    else:
        print(format_report(facts))
        print(f"verdict: {line}")
    return code


if __name__ == "__main__":
    sys.exit(main())
