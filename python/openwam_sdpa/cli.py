"""The command line, `python -m openwam_sdpa COMMAND`: doctor, explain, guards.

What prints is here; doctor.py gathers the doctor's facts and verdict (and
imports nothing of this module).

Exit codes mean one thing each, whatever the command (EXIT_CODES below):
Python's 1 is an uncaught error and argparse's 2 the usage error, so the
doctor's verdicts use 0, 3 and 4.
"""

import argparse
import json
import math
import re
import sys

import torch

from . import doctor, ops
from ._extension import _C
from .varlen import varlen_settings

EXIT_ERROR = 1  # Python's own code for an uncaught error
EXIT_USAGE = 2  # argparse's own code for a bad command line

EXIT_CODES = f"""\
exit codes:
  {doctor.EXIT_OK}  success; doctor: nothing to do (not affected, or no CUDA GPU here)
  {EXIT_ERROR}  the command failed (an uncaught error, with its traceback)
  {EXIT_USAGE}  usage error: unknown command, bad argument or bad OPENWAM_SDPA_* setting
     (argparse's code)
  {doctor.EXIT_BROKEN}  doctor: openwam_sdpa itself gave non-finite gradients, or has no CUDA kernels
  {doctor.EXIT_AFFECTED}  doctor: this stack is affected, and openwam_sdpa fixes it"""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}

ROUTES = {
    "cudnn": "the guarded cuDNN path",
    "pytorch": "PyTorch's own F.scaled_dot_product_attention, untouched",
    "pytorch_without_cudnn": "PyTorch's F.scaled_dot_product_attention with cuDNN off for the call",
    "math": "PyTorch's math backend (vmap on CUDA; before torch 2.13, an empty input)",
}


# A list of numbers as json.dumps(indent=1) lays it out, one number a line.
# Its newlines mark it: JSON strings cannot hold a raw newline.
_NUMBER_LIST = re.compile(r"\[\n\s*(-?\d[\d.eE+-]*(?:,\n\s*-?\d[\d.eE+-]*)*)\n\s*\]")


def _finite(obj):
    """obj with every non-finite float as the string Python prints for it:
    JSON has no NaN or Infinity, and strict readers refuse them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def to_json(obj):
    """Indented JSON, with each list of numbers on one line (the doctor's
    127 key-tail remainders would take 127 lines)."""
    text = json.dumps(_finite(obj), indent=1, default=str, allow_nan=False)
    return _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)


def version_text():
    from . import __version__
    info = ops.build_info()
    cuda = torch.version.cuda or "none (CPU build)"
    kernels = "with" if info["with_cuda"] else "without"
    return (f"openwam_sdpa {__version__} (torch {torch.__version__}, extension built for "
            f"torch {info['torch_version']} {kernels} CUDA kernels; CUDA {cuda}; cuDNN runtime "
            f"{doctor.cudnn_str(info['cudnn_runtime'])}, compiled "
            f"{doctor.cudnn_str(info['cudnn_compiled'])})")


# A size of one dimension: cuDNN's and PyTorch's attention kernels index
# within int32.
MAX_SIZE = 2**31 - 1


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer up to {MAX_SIZE} (1, 2, ...), got {text!r}")
    return value


def cudnn_version(text):
    """9.19.0, 9.19 or 91900 to cuDNN's encoding (90000 + 100 * minor + patch);
    9.19.0.56, as pip names the nvidia-cudnn wheels, too (the build number
    is no part of the encoding)."""
    # ASCII digits only: int() alone also takes "+5", " 56", "1_9" and "-0".
    parts = text.split(".") if re.fullmatch(r"[0-9]+(\.[0-9]+){0,3}", text) else []
    try:
        if len(parts) == 1 and 10000 <= int(text) < 1000000:
            return int(text)
        if len(parts) == 4:
            parts = parts[:3]
        if 2 <= len(parts) <= 3:
            major, minor, patch = (int(p) for p in parts + ["0"] * (3 - len(parts)))
            if 0 < major < 100 and 0 <= minor < 100 and 0 <= patch < 100:
                return major * 10000 + minor * 100 + patch
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"expected a cuDNN version such as 9.19.0, 9.19.0.56 or 91900, got {text!r}")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m openwam_sdpa",
        description="openwam_sdpa: torch SDPA with cuDNN's backward NaN defects guarded.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_text())
    # Each command keeps its parser (`subparser`): errors show its usage line.
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = commands.add_parser(
        "doctor", help="is this stack affected, and does the fix hold? (runs two cases on the GPU)",
        description=doctor.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the facts and the verdict as JSON")
    p.set_defaults(subparser=p)

    p = commands.add_parser(
        "explain", help="what the op would do for given shapes, dtype, mask and head counts",
        description="What openwam_sdpa.sdpa would do with a call of these shapes: its route, "
                    "PyTorch's own backend choice, the fix plan and the guard rule. Nothing "
                    "is allocated for the call (fake tensors) and it is never run; "
                    "F.scaled_dot_product_attention checks --dropout and --scale on a "
                    "one-row CPU call, and its error exits 2.",
        epilog="example: python -m openwam_sdpa explain --batch 2 --heads 16 --kv-heads 4 "
               "--q-len 307 --kv-len 320 --head-dim 96 --dtype bf16 --mask bool --device cuda")
    p.add_argument("--batch", type=positive_int, metavar="N", default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=positive_int, metavar="N", default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=positive_int, metavar="N",
                   help="key/value heads (default: --heads); fewer means grouped-query "
                        "attention (enable_gqa=True)")
    p.add_argument("--q-len", type=positive_int, metavar="N", default=1024, help="query length (default 1024)")
    p.add_argument("--kv-len", type=positive_int, metavar="N", help="key/value length (default: --q-len)")
    p.add_argument("--head-dim", type=positive_int, metavar="N", default=128, help="default 128")
    p.add_argument("--value-head-dim", type=positive_int, metavar="N", help="default: --head-dim")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="dtype of query, key and value (default bf16)")
    p.add_argument("--mask", choices=["none", "bool", "additive"], default="none",
                   help="attn_mask of shape [batch, 1, q_len, kv_len]: bool (True: attend, as "
                        "Hugging Face's sdpa mask) or additive in --dtype (default none)")
    p.add_argument("--causal", action="store_true",
                   help="is_causal=True (with --mask, as F.sdpa: PyTorch's backends decide)")
    p.add_argument("--dropout", type=float, metavar="P", default=0.0, help="dropout_p (default 0)")
    p.add_argument("--scale", type=float, metavar="S", help="scale (default 1/sqrt(head_dim))")
    p.add_argument("--inference", action="store_true",
                   help="a call without gradients (the defects are in the backward)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default: cuda when a CUDA GPU is here")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.set_defaults(subparser=p)

    p = commands.add_parser(
        "guards", help="the guard table, and the rows that apply to this stack's cuDNN",
        description="The guard table of known cuDNN attention defects, and which rows apply "
                    "to the runtime cuDNN (without one: to the cuDNN this torch ships).")
    p.add_argument("--cudnn", type=cudnn_version, metavar="VERSION",
                   help="read the table for this cuDNN instead (9.19.0, 9.19, 9.19.0.56 or 91900)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(subparser=p)
    return parser


# ------------------------------------------------------------------ explain


def explain_call(args):
    """The call the options describe, as a dict (JSON's and the report's)."""
    kv_heads = args.kv_heads or args.heads
    return dict(batch=args.batch, heads=args.heads, kv_heads=kv_heads, q_len=args.q_len,
                kv_len=args.kv_len or args.q_len, head_dim=args.head_dim,
                value_head_dim=args.value_head_dim or args.head_dim, dtype=args.dtype,
                mask=args.mask, causal=args.causal, dropout=args.dropout, scale=args.scale,
                enable_gqa=kv_heads != args.heads, differentiated=not args.inference,
                device=args.device)


def tensor_shapes(call):
    """The shapes of query, key, value and the mask (if any) of the call."""
    b, lq, lk = call["batch"], call["q_len"], call["kv_len"]
    shapes = [(b, call["heads"], lq, call["head_dim"]), (b, call["kv_heads"], lk, call["head_dim"]),
              (b, call["kv_heads"], lk, call["value_head_dim"])]
    return shapes + ([(b, 1, lq, lk)] if call["mask"] != "none" else [])


def fake_inputs(call):
    """query, key, value and mask as fake tensors on call["device"]: shapes,
    strides and dtype without memory, on a machine without CUDA too."""
    dtype = DTYPES[call["dtype"]]
    shapes = tensor_shapes(call)
    q, k, v = (torch.empty(shape, dtype=dtype, device=call["device"]) for shape in shapes[:3])
    q.requires_grad_(call["differentiated"])
    mask = None
    if call["mask"] != "none":
        mask_dtype = torch.bool if call["mask"] == "bool" else dtype
        mask = torch.empty(shapes[3], dtype=mask_dtype, device=call["device"])
    return q, k, v, mask


def pytorch_refusal(call):
    """F.scaled_dot_product_attention's error for the call's dropout_p,
    is_causal and scale (its message on the CPU, asked with a one-row call),
    or None where it takes them."""
    if call["dropout"] == 0.0 and call["scale"] is None:
        return None  # the defaults: nothing to ask, nothing allocated
    q = torch.zeros(1, 1, 1, 8)
    try:
        ops._PYTORCH_SDPA(q, q, q, dropout_p=call["dropout"], is_causal=call["causal"],
                          scale=call["scale"])
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def explain(call):
    """openwam_sdpa.explain() for the call, with notes where this machine
    cannot answer for a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = (call["dropout"], call["causal"], call["scale"], call["enable_gqa"])
    notes, cuda_available = [], torch.cuda.is_available()
    # Without a GPU, the guard table read for the cuDNN this torch ships.
    shipped = doctor.shipped_cudnn(torch.__version__) \
        if call["device"] == "cuda" and not cuda_available else None

    def ask(device):
        inputs = fake_inputs(dict(call, device=device))
        hits = _C.guard_hits(*inputs, *args, shipped) if shipped else None
        dropout_p, is_causal, scale, enable_gqa = args
        return ops.explain(*inputs, dropout_p, is_causal, scale=scale,
                           enable_gqa=enable_gqa), hits

    try:
        # Fake tensors: the decision reads only metadata (as under torch.compile).
        with FakeTensorMode():
            answer, hits = ask(call["device"])
    except Exception as e:  # noqa: BLE001  (a torch that cannot fake a CUDA device here)
        if call["device"] != "cuda" or cuda_available:
            raise
        notes.append(f"fake CUDA tensors failed here ({type(e).__name__}: {e}); "
                     "explained for meta tensors of the same shapes")
        answer, hits = ask("meta")
    answer = dict(answer, call=call, cuda_available=cuda_available, notes=notes,
                  shipped_cudnn_key_tail=None, shipped_cudnn_rules=None)
    rows = {r["name"]: r for r in ops.guard_rules()}
    answer["rule_defect"] = rows[answer["rule"]]["defect"] if answer["rule"] in rows else ""
    if call["device"] == "cuda" and not answer["cuda_available"]:
        answer["notes"].append(
            "no CUDA GPU here: the answer is what the op does on this machine. On a GPU the "
            "route depends on the GPU, its cuDNN and PyTorch's backend choice: run this "
            "command there.")
        if shipped:
            hit = ops.key_tail_defect(shipped, call["kv_len"], call["head_dim"], call["causal"])
            status = doctor.coverage(shipped)["status"]
            answer["shipped_cudnn_key_tail"] = dict(cudnn=shipped, hit=bool(hit), status=status)
            # A call with dropout takes the plan without gradients too (C++ says
            # which calls take one: SdpaCall::takes_training_forward).
            planned, rejected, hits = hits["planned"], hits["cudnn_rejects"], hits["rules"]
            answer["shipped_cudnn_rules"] = hits
            table = (f"the guard table for cuDNN {doctor.minor_str(shipped)} (what torch "
                     f"{torch.__version__.split('+')[0]}'s CUDA builds ship, {status})")
            if rejected:
                answer["notes"].append(f"{table}: the cuDNN path cannot take this call "
                                       f"({rejected}): no rule applies")
            elif not planned:
                answer["notes"].append(f"{table}: no rule applies to a call without gradients "
                                       "(the defects are in the backward)")
            elif hits:
                answer["notes"].append(
                    f"{table}, on the cuDNN path "
                    + ("with gradients: " if call["differentiated"] else "with dropout: ")
                    + "; ".join(f"{name} covers this call ({rows[name]['defect']}): "
                                f"{rows[name]['action']}" for name in hits))
            else:
                answer["notes"].append(f"{table}: no rule covers this call")
    return answer


def format_explain(a):
    c = a["call"]
    mask = {"none": "no mask", "bool": "bool mask", "additive": f"additive {c['dtype']} mask"}
    flags = [mask[c["mask"]]] + (["is_causal"] if c["causal"] else [])
    flags += [f"dropout {c['dropout']}"] if c["dropout"] else []
    flags += [f"scale {c['scale']}"] if c["scale"] is not None else []
    flags += ["enable_gqa"] if c["enable_gqa"] else []
    flags.append("with gradients" if c["differentiated"] else "without gradients")
    value_dim = f" (value {c['value_head_dim']})" if c["value_head_dim"] != c["head_dim"] else ""
    settings = " ".join(f"{k}={v}" for k, v in a["settings"].items())
    lines = [
        f"openwam_sdpa explain: query [{c['batch']}, {c['heads']}, {c['q_len']}, {c['head_dim']}], "
        f"key/value [{c['batch']}, {c['kv_heads']}, {c['kv_len']}, {c['head_dim']}]{value_dim}, "
        f"{c['dtype']} on {c['device']}; {', '.join(flags)}",
        f"  route           {a['route']}: {ROUTES.get(a['route'], a['route'])}",
        f"  PyTorch picks   {a['pytorch_choice']}",
        f"  plan            {a['plan']}",
        f"  guard rule      {a['rule'] or 'none'}" + (f": {a['rule_defect']}" if a["rule"] else ""),
        f"  reason          {a['reason']}",
        f"  cuDNN           {doctor.cudnn_str(a['cudnn_runtime'])}",
        f"  settings        {settings}",
    ]
    lines += [f"  note: {note}" for note in a["notes"]]
    return "\n".join(lines)


def run_explain(args):
    parser = args.subparser
    if args.kv_heads and args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    call = explain_call(args)
    elements = sum(math.prod(shape) for shape in tensor_shapes(call))
    if elements >= 2**63:
        parser.error(f"the call's tensors would hold {elements} elements, more than PyTorch "
                     "can index (2**63 - 1)")
    refusal = pytorch_refusal(call)
    if refusal is not None:
        given = f"dropout_p={args.dropout}" + ("" if args.scale is None else f", scale={args.scale}")
        parser.error(f"F.scaled_dot_product_attention rejects {given}: {refusal}")
    answer = explain(call)
    print(to_json(answer) if args.json else format_explain(answer))
    return doctor.EXIT_OK


# ------------------------------------------------------------------ guards


def guard_table(cudnn=None):
    """The guard rows for the cuDNN read (--cudnn, else the runtime one, else
    the one this torch ships), each with `applies` (its versions hold it),
    `measured`, `in_range` and `behind` (a row of the same defect that comes
    first and takes the calls it covers)."""
    runtime = ops.build_info()["cudnn_runtime"]
    shipped = doctor.shipped_cudnn(torch.__version__)
    if cudnn:
        version, source = cudnn, "given"
    elif runtime:
        version, source = runtime, "runtime"
    else:
        version, source = shipped or 0, "shipped" if shipped else "none"
    cov = doctor.coverage(version)
    applying = {r["name"]: r for r in cov["rules"]}
    first_of = {}
    for r in cov["rules"]:
        first_of.setdefault(doctor.defect_of(r["name"]), r["name"])
    rows = []
    for r in ops.guard_rules():
        in_range = bool(version) and r["first_version"] <= version < r["end_version"]
        behind = first_of.get(doctor.defect_of(r["name"])) if in_range else None
        rows.append(dict(r, applies=r["name"] in applying, in_range=in_range,
                         behind=None if behind == r["name"] else behind,
                         measured=applying[r["name"]]["measured"] if r["name"] in applying else False))
    return dict(cudnn=version, cudnn_source=source, cudnn_runtime=runtime, torch=torch.__version__,
                status=cov["status"], summary=cov["summary"],
                newest_known_cudnn=ops.build_info()["newest_known_cudnn"], rules=rows)


def format_guards(t):
    source = {"given": "given with --cudnn", "runtime": "loaded here",
              "shipped": f"what torch {t['torch'].split('+')[0]}'s CUDA builds ship; none loaded here",
              "none": "none loaded here, and this torch is not a known pair"}[t["cudnn_source"]]
    cudnn = doctor.cudnn_str(t["cudnn"]) if t["cudnn_source"] != "shipped" \
        else doctor.minor_str(t["cudnn"])
    lines = [f"openwam_sdpa guards: cuDNN {cudnn} ({source})",
             f"  {t['summary']}",
             f"  the table knows cuDNN up to {doctor.minor_str(t['newest_known_cudnn'])}; "
             f"rows are checked in this order:"]
    for r in t["rules"]:
        if r["applies"]:
            mark = "applies, measured" if r["measured"] else "applies"
            if r["behind"]:
                mark += f", where {r['behind']} above does not"
        else:
            mark = "does not apply"
        lines += [f"  {'*' if r['applies'] else '-'} {r['name']}  [{mark}]",
                  f"      versions  {r['versions']}",
                  f"      defect    {r['defect']}",
                  f"      action    {r['action']}",
                  f"      source    {r['source']}"]
    return "\n".join(lines)


def run_guards(args):
    table = guard_table(args.cudnn)
    print(to_json(table) if args.json else format_guards(table))
    return doctor.EXIT_OK


# ------------------------------------------------------------------ doctor


def run_doctor(as_json=False):
    """Diagnose, print the report (or JSON) and the verdict; the exit code."""
    facts = doctor.collect_facts()
    line, code = doctor.verdict(facts)
    if as_json:
        print(to_json(dict(facts, verdict=line, exit_code=code)))
    else:
        print(doctor.format_report(facts))
        print(f"verdict: {line}")
    return code


# ------------------------------------------------------------------ main

_NUMBER_OPTIONS = ("--scale", "--dropout")


def _joined_numbers(argv: list) -> list:
    """`--scale -1e-3` as `--scale=-1e-3`: argparse reads a negative number
    in exponent form (or inf, nan) as an option, and would say the option
    has no value; F.sdpa's own check then words what is wrong with it."""
    out = []
    for arg in argv:
        if out and out[-1] in _NUMBER_OPTIONS and arg.startswith("-"):
            try:
                float(arg)
            except ValueError:
                pass
            else:
                out[-1] = f"{out[-1]}={arg}"
                continue
        out.append(arg)
    return out


def main(argv=None):
    parser = build_parser()
    argv = _joined_numbers(sys.argv[1:] if argv is None else list(argv))
    args, unknown = parser.parse_known_args(argv)  # exits EXIT_USAGE on a bad command line
    if unknown:
        # `--json doctor`: the command's options go after it.
        ahead = argv[:argv.index(args.command)] if args.command in argv else []
        misplaced = [a for a in unknown if a in ahead]
        if misplaced:
            parser.error(f"{' '.join(misplaced)} goes after the command: "
                         f"{args.command} {' '.join(misplaced)}")
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command in ("doctor", "explain"):
        # Both read the settings; a bad OPENWAM_SDPA_* value raises there, and
        # every call of the op that reads it would raise the same. One line,
        # the usage code. explain describes a dense call, which never reads
        # OPENWAM_SDPA_VARLEN (review: it refused a dense call for it); the
        # doctor checks the stack's every setting.
        try:
            ops.settings()
            if args.command == "doctor":
                varlen_settings()
        except RuntimeError as e:
            print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    if args.command == "doctor":
        return run_doctor(as_json=args.json)
    if args.command == "explain":
        return run_explain(args)
    return run_guards(args)
