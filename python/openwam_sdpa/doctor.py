"""`python -m openwam_sdpa doctor`: is this stack affected, and does the fix hold?

Reports the versions that matter, which known torch/cuDNN pair this is and
how the guard table covers its cuDNN (a measured rule, a conservative one, or
a cuDNN newer than any known: unverified), the backend PyTorch picks, and
runs two cases through stock F.scaled_dot_product_attention (PyTorch's default
path) and through openwam_sdpa, counting non-finite gradient elements:

* adversarial: row 0 of every head has a logsumexp near -103, as a "massive
  activation" head gives it; s_kv = 704 (704 % 128 == 64 fails on cuDNN 9.19);
* left padding: a left-padded causal batch with Hugging Face's bool mask, as
  padded prompts (DPO, GRPO) give it. The padding's query rows see no key;
  stock cuDNN turns the mask into -65504, so their logsumexp is near -65504.

Exit codes (the command line's, cli.py, one meaning each):

  0  nothing to do: not affected, or no CUDA GPU here to be affected
  1  the command failed (Python's code for an uncaught error, such as an
     extension built for another torch; never a verdict)
  2  usage error (argparse's code; never a verdict)
  3  openwam_sdpa itself gave non-finite gradients
  4  this stack is affected (stock SDPA gives NaN, or the guard table lists
     it) and openwam_sdpa fixes it
"""

import re

import torch
import torch.nn.functional as F

from . import ops
from .adversarial import adversarial_inputs, left_padding_mask

# 1 is Python's code for an uncaught error and 2 argparse's for a usage
# error: no verdict reuses them, so a script can tell a verdict from a crash.
EXIT_OK, EXIT_AFFECTED, EXIT_BROKEN = 0, 4, 3

ADVERSARIAL = dict(batch=2, heads=4, s_q=128, s_kv=704, head_dim=128)
LEFT_PADDED = dict(batch=2, heads=4, s=704, head_dim=128, padding=64)

# The cuDNN each torch release's CUDA wheels ship (cuDNN encodes 9.x.y as
# 90000 + 100 * x + y; a pair names major.minor).
KNOWN_PAIRS = {"2.11": 91900, "2.12": 92000, "2.13": 92000, "2.14": 92400, "2.15": 92600}


def cudnn_str(version):
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}" if version else "none"


def minor_str(version):
    return f"{version // 10000}.{version // 100 % 100}"


def shipped_cudnn(torch_version):
    """The cuDNN (encoded) that this torch release ships, None if not a known pair."""
    return KNOWN_PAIRS.get(".".join(torch_version.split("+")[0].split(".")[:2]))


def defect_of(name):
    """A row's defect: its name less a version suffix (key_tail_nan_dq_9.19
    is the measured twin of key_tail_nan_dq)."""
    return re.sub(r"_\d+\.\d+$", "", name)


def rules_for(version, rules):
    """The guard rows whose cuDNN range [first_version, end_version) holds
    `version`, in table order, each with `measured` (the version lies in the
    row's measured range). A defect's measured row stands in front of its
    general row, which still covers the calls the measurement did not reach
    (on 9.19.0: key-tail head_dims other than 64 and 128, one-query-row causal
    calls in fp16 or at other head_dims), so both are listed."""
    found = []
    for row in rules:
        if not row.get("first_version", 0) <= version < row.get("end_version", 0):
            continue
        measured = row.get("measured_first_version", 0) <= version < row.get("measured_end_version", 0)
        found.append(dict(row, measured=measured))
    return found


def dense_rows(rows):
    """The rows about F.sdpa's dense calls (the ragged rows choose sdpa_varlen's
    engine: no stock call meets them)."""
    return [r for r in rows if r["layout"] == "dense"]


def coverage(version, rules=None, newest_known=None):
    """How the guard table covers cuDNN `version`: a dict with `status`
    ("none", "measured", "conservative", "fixed" or "unverified"), the
    key-tail `remainders` it treats as failing at head_dim 128, the `rules`
    that apply, and a one-line `summary`. A cuDNN past `newest_known` (the
    guard table's, by default) is unverified."""
    if not version:
        return dict(cudnn=0, status="none", remainders=[], rules=[],
                    summary="the defect cannot occur")
    rows = rules_for(version, ops.guard_rules() if rules is None else rules)
    newest_known = ops.build_info()["newest_known_cudnn"] if newest_known is None else newest_known
    remainders = [r for r in range(128) if ops.key_tail_defect(version, 512 + r, 128)]
    key_tail = next((r for r in rows if r["name"].startswith("key_tail")), None)
    if remainders:
        status = "measured" if key_tail and key_tail["measured"] else "conservative"
        rule = key_tail["name"] if key_tail else "key-tail rule"
        summary = (f"measured rule {rule} (s_kv % 128 in {remainders} at "
                   "head_dim 64/128; other head_dims treated as any remainder)"
                   if status == "measured" else
                   f"conservative rule {rule} (not measured on this version: "
                   "every s_kv % 128 != 0 treated as failing)")
    elif version > newest_known:
        status = "unverified"
        summary = (f"unverified: newer than the last known cuDNN ({minor_str(newest_known)}); "
                   "the key tail gets no fix there, the rows of defects with no known fix "
                   "stay")
    else:
        status = "fixed"
        # 9.26 (torch 2.15's pin) is fixed on upstream's word; no row was measured there.
        summary = ("the key-tail defect is fixed in this cuDNN "
                   "(upstream's report, not measured here)")
    others = [r["name"] + (" (measured)" if r["measured"] else "")
              for r in rows if not r["name"].startswith("key_tail")]
    if others:
        summary += "; other rules: " + ", ".join(others)
    return dict(cudnn=version, status=status, remainders=remainders, rules=rows,
                summary=summary)


def known_pair(torch_version, cudnn_runtime):
    """The known pair of this torch, and whether the loaded cuDNN is its own."""
    shipped = shipped_cudnn(torch_version)
    pairs = ", ".join(f"{t}/{minor_str(c)}" for t, c in KNOWN_PAIRS.items())
    if shipped is None:
        return dict(shipped=None, summary=f"torch {torch_version} is not a known pair ({pairs})")
    # The CUDA builds: a CPU build of the same release ships no cuDNN.
    text = f"torch {torch_version.split('+')[0]}'s CUDA builds ship cuDNN {minor_str(shipped)}"
    if cudnn_runtime and cudnn_runtime // 100 != shipped // 100:
        text += f", but cuDNN {cudnn_str(cudnn_runtime)} is loaded"
    return dict(shipped=shipped, summary=text)


def count_nonfinite_grads(attention, q, k, v, grad_out, mask):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, attn_mask=mask)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return {name: int((~torch.isfinite(g)).sum()) for name, g in zip("qkv", grads)}


def adversarial_case(device, dtype=torch.bfloat16):
    return adversarial_inputs(**ADVERSARIAL, rows="first", device=device, dtype=dtype)


def left_padded_case(device, dtype=torch.bfloat16):
    """Ordinary q/k/v and the bool mask of a batch whose last sequence starts
    with LEFT_PADDED["padding"] padding tokens."""
    c = LEFT_PADDED
    q, k, v, grad_out, _ = adversarial_inputs(c["batch"], c["heads"], c["s"], c["s"],
                                              c["head_dim"], rows="none", device=device,
                                              dtype=dtype, seed=1)
    lengths = [c["s"]] * (c["batch"] - 1) + [c["s"] - c["padding"]]
    return q, k, v, grad_out, left_padding_mask(lengths, c["s"], device=device)


def run_cases(device):
    """Both cases through stock F.sdpa and openwam_sdpa on `device`."""
    facts = {}
    adv = adversarial_case(device)
    scale = ADVERSARIAL["head_dim"] ** -0.5
    lse = torch.logsumexp(adv.query.float() @ adv.key.float().transpose(-2, -1) * scale, -1)
    facts["adversarial_lse"] = round(float(lse[adv.affected].max()), 1)
    mask = torch.ones(ADVERSARIAL["s_q"], ADVERSARIAL["s_kv"], dtype=torch.bool, device=device)
    facts["openwam_plan"] = ops.explain(adv.query.detach().requires_grad_(), adv.key, adv.value, mask)
    facts["pytorch_default_backend"] = facts["openwam_plan"]["pytorch_choice"]
    runs = {}
    for mask_kind, m in (("bool mask", mask), ("no mask", None)):
        for name, fn in (("stock F.sdpa", F.scaled_dot_product_attention), ("openwam_sdpa", ops.sdpa)):
            runs[f"{name}, {mask_kind}"] = count_nonfinite_grads(fn, *adv[:4], m)
    facts["adversarial_nonfinite"] = runs

    q, k, v, grad_out, mask = left_padded_case(device)
    plan = ops.explain(q.detach().requires_grad_(), k, v, mask)
    facts["left_padding_plan"] = plan
    facts["left_padding_default_backend"] = plan["pytorch_choice"]
    facts["left_padding_nonfinite"] = {
        "stock F.sdpa": count_nonfinite_grads(F.scaled_dot_product_attention, q, k, v, grad_out, mask),
        "openwam_sdpa": count_nonfinite_grads(ops.sdpa, q, k, v, grad_out, mask),
    }
    return facts


def collect_facts():
    info = ops.build_info()
    runtime = info["cudnn_runtime"] or (torch.backends.cudnn.version() or 0)
    pair = known_pair(torch.__version__, runtime)
    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn_compiled": info["cudnn_compiled"],
        "cudnn_runtime": runtime,
        "built_for_torch": info["torch_version"],
        "extension_has_cuda": info["with_cuda"],
        "known_pair": pair,
        # Without a cuDNN here, what the cuDNN this torch ships would get.
        "coverage": coverage(runtime or pair["shipped"] or 0),
        "coverage_of": "runtime" if runtime else ("shipped" if pair["shipped"] else "none"),
        "settings": dict(ops.settings()),
        "gpu": None,
        "not_checked": [],
    }
    if not torch.cuda.is_available():
        facts["not_checked"].append(
            "no CUDA GPU: PyTorch's default backend, the two cases and the fix "
            "could not be checked here; run the doctor on the training machine")
        return facts
    major, minor = torch.cuda.get_device_capability()
    facts["gpu"] = f"{torch.cuda.get_device_name()} (sm{major}{minor})"
    facts.update(run_cases("cuda"))
    return facts


def _totals(facts, prefix):
    runs = list(facts["adversarial_nonfinite"].items()) + list(facts["left_padding_nonfinite"].items())
    return sum(sum(c.values()) for name, c in runs if name.startswith(prefix))


def verdict(facts):
    """(one-line verdict, exit code) from collect_facts()'s result."""
    if facts["gpu"] is None:
        return ("not affected here: no CUDA GPU (the defect lives in cuDNN's GPU "
                "backward); run this on the training machine", EXIT_OK)
    if not facts["extension_has_cuda"]:
        # A CUDA torch, an extension built without CUDA: the op hands every
        # CUDA call to stock F.sdpa, so it has the defects stock has.
        return ("BROKEN: this openwam_sdpa was built without CUDA kernels (no CUDA toolkit "
                "at build time, or OPENWAM_SDPA_NO_CUDA=1), so CUDA calls run stock F.sdpa "
                "without the fix; with nvcc on PATH (or CUDA_HOME set): pip install "
                "--no-build-isolation --force-reinstall --no-deps . in the openwam_sdpa "
                "checkout", EXIT_BROKEN)
    ours, stock = _totals(facts, "openwam"), _totals(facts, "stock")
    if ours:
        if facts["settings"].get("pad") == "never":
            return (f"BROKEN: openwam_sdpa gave {ours} non-finite gradient elements: "
                    "OPENWAM_SDPA_PAD=never turns the fix off", EXIT_BROKEN)
        return (f"BROKEN: openwam_sdpa gave {ours} non-finite gradient elements; "
                "please report this with the output above", EXIT_BROKEN)
    cov = facts["coverage"]
    use = ('use attn_implementation="openwam_sdpa", openwam_sdpa.sdpa or '
           "openwam_sdpa.patch()")
    if stock or cov["remainders"]:
        why = (f"stock SDPA gave {stock} non-finite gradient elements"
               if stock else "the guard table lists this cuDNN as affected")
        return f"AFFECTED: {why}; openwam_sdpa gave none: {use}", EXIT_AFFECTED
    # Rows the two cases cannot hit: on cuDNN 9.26 (torch 2.15) and newer, the
    # one-query-row defects (cudnn-frontend #1071, #1072), with no known fix.
    listed = [r["name"] for r in dense_rows(cov["rules"]) if not r["name"].startswith("key_tail")]
    if listed:
        newer = (f"; cuDNN {cudnn_str(facts['cudnn_runtime'])} is newer than any known"
                 if cov["status"] == "unverified" else "")
        return (f"AFFECTED: the guard table lists defects of this cuDNN that the two cases "
                f"cannot hit: {', '.join(listed)} (`python -m openwam_sdpa guards` describes "
                f"them; no key length fails{newer}); openwam_sdpa fixes the calls they "
                f"cover: {use}", EXIT_AFFECTED)
    if cov["status"] == "unverified":
        return (f"not affected as far as checked: stock SDPA gave finite gradients, but "
                f"cuDNN {cudnn_str(facts['cudnn_runtime'])} is unverified (newer than any "
                "known); openwam_sdpa gives the key tail no fix there", EXIT_OK)
    return ("not affected: stock SDPA gave finite gradients and the guard table "
            "lists no defect of this cuDNN", EXIT_OK)


def _count_line(name, counts):
    return f"    {name:28s} non-finite dQ {counts['q']:5d}  dK {counts['k']:5d}  dV {counts['v']:5d}"


def format_report(facts):
    cov = facts["coverage"]
    cudnn = cudnn_str(cov["cudnn"])
    if facts["coverage_of"] == "shipped":
        cudnn = f"{minor_str(cov['cudnn'])} (shipped with this torch; none loaded here)"
    lines = [
        "openwam_sdpa doctor",
        f"  torch            {facts['torch']} (extension built for {facts['built_for_torch']}"
        f"{'' if facts['extension_has_cuda'] else ', without CUDA kernels'})",
        f"  CUDA             {facts['cuda'] or 'none (CPU build)'}",
        f"  cuDNN            runtime {cudnn_str(facts['cudnn_runtime'])}, "
        f"compiled {cudnn_str(facts['cudnn_compiled'])}",
        f"  known pair       {facts['known_pair']['summary']}",
        f"  guard table      cuDNN {cudnn}: {cov['summary']}",
        f"  settings         {' '.join(f'{k}={v}' for k, v in facts['settings'].items())}",
        f"  GPU              {facts['gpu'] or 'none'}",
    ]
    if facts["gpu"] is not None:
        plan, a = facts["openwam_plan"], ADVERSARIAL
        lines += [
            f"  default backend  {facts['pytorch_default_backend']} (masked bf16 training call)",
            f"  openwam plan     {plan['backend']} / {plan['plan']} (s_kv={a['s_kv']})",
            f"  adversarial case (B={a['batch']}, H={a['heads']}, {a['s_q']}x{a['s_kv']}, "
            f"D={a['head_dim']}, bf16, row 0 of every head at lse {facts['adversarial_lse']}):",
        ]
        lines += [_count_line(name, c) for name, c in facts["adversarial_nonfinite"].items()]
        lp, plan = LEFT_PADDED, facts["left_padding_plan"]
        lines.append(
            f"  left-padded causal batch (B={lp['batch']}, H={lp['heads']}, {lp['s']}x{lp['s']}, "
            f"D={lp['head_dim']}, bf16, {lp['padding']} padding tokens, bool mask; "
            f"default backend {facts['left_padding_default_backend']}, "
            f"openwam plan {plan['backend']} / {plan['plan']}):")
        lines += [_count_line(name, c) for name, c in facts["left_padding_nonfinite"].items()]
    for note in facts["not_checked"]:
        lines.append(f"  not checked: {note}")
    return "\n".join(lines)
