"""F.sdpa's argument contract to the type, and where the op is safer than F.sdpa.

- Scalar arguments: F.sdpa's signature has dropout_p and scale as float,
  is_causal and enable_gqa as bool. Its argument parser takes some other
  types (an int or a NumPy number or a 0-dim tensor for a float) and rejects
  the rest with a TypeError. openwam_sdpa.sdpa, the patched F.sdpa and
  explain() accept and reject the same values, with F.sdpa's own message.
  torch.ops.openwam.sdpa is reached through torch.ops' own binding, which
  parses the arguments as it does for every op: the same as it does for
  torch.ops.aten.scaled_dot_product_attention.
- No error message of the Python entry points prints a tensor's data.
- torch.func.vmap: the same result and the same warnings as F.sdpa, and no
  warning about the op lacking a batching rule.
- Key and value of different lengths: F.sdpa's fused CPU kernel reads past
  value's end and returns garbage (torch 2.13). The op raises a RuntimeError
  naming both lengths. Other shape mismatches are left to PyTorch, which
  serves them correctly: the op returns what PyTorch's math backend returns.
- A mask on another device than the query's: F.sdpa's fused CPU kernel reads
  a meta mask's missing memory and returns garbage (torch 2.13). The op
  raises a RuntimeError worded as PyTorch's own device check, naming both
  devices; a mask F.sdpa refuses for its shape keeps F.sdpa's error.
"""

from __future__ import annotations

import enum
import re
import warnings
from fractions import Fraction

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from support import F_SDPA, make_mask, randn

B, H, L, S, E = 2, 3, 4, 6, 8
F64 = torch.float64


def q_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, L, E)), dtype=dtype, seed=1, **kw)


def k_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, S, E)), dtype=dtype, seed=2, **kw)


def v_(*shape, dtype=F64, **kw):
    return randn(*(shape or (B, H, S, E)), dtype=dtype, seed=3, **kw)


class Flag(enum.IntEnum):
    ONE = 1


def _numpy_values():
    try:
        import numpy as np
    except ImportError:  # NumPy numbers are one more kind F.sdpa takes
        return {}
    return {"numpy_float32": lambda: np.float32(0.25), "numpy_int64": lambda: np.int64(0),
            "numpy_bool": lambda: np.bool_(True), "numpy_complex": lambda: np.complex128(0.25),
            "numpy_0d_array": lambda: np.array(0.25)}


# Values for each scalar argument; built per call (tensors are fresh).
VALUES = {
    "none": lambda: None,
    "true": lambda: True,
    "false": lambda: False,
    "int_0": lambda: 0,
    "int_1": lambda: 1,
    "int_enum": lambda: Flag.ONE,
    "float": lambda: 0.25,
    "huge_int": lambda: 10**400,
    "str": lambda: "1",
    "list": lambda: [0.25],
    "complex": lambda: 0.25j,
    "fraction": lambda: Fraction(1, 4),
    "tensor_0d": lambda: torch.tensor(0.25),
    "tensor_0d_bool": lambda: torch.tensor(True),
    "tensor_0d_int": lambda: torch.tensor(1),
    "tensor_0d_complex": lambda: torch.tensor(0.25 + 1j),
    "tensor_1d": lambda: torch.tensor([0.25]),
    "tensor_2": lambda: torch.tensor([0.25, 0.5]),
    "tensor_requires_grad": lambda: torch.tensor(0.25, requires_grad=True),
    **_numpy_values(),
}
ARGS = ("dropout_p", "is_causal", "scale", "enable_gqa")
SCALAR_CASES = [(a, v) for a in ARGS for v in VALUES]


def outcome(fn, *args, **kwargs):
    """('ok', output) or (exception type, message) of one call; warnings
    (e.g. NumPy's about a complex cast) are not the point here."""
    torch.manual_seed(5)  # dropout
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ("ok", fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - any exception is compared
        return (type(e), str(e))


def assert_same(got, expected, what):
    assert got[0] == expected[0], f"{what}: {got[0]} ({got[1]!r:.300}) where F.sdpa gives " \
                                  f"{expected[0]} ({expected[1]!r:.300})"
    if got[0] == "ok":
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0, equal_nan=True)
    else:
        assert got[1] == expected[1], f"{what}: {got[1]!r} where F.sdpa says {expected[1]!r}"


def patched_f_sdpa(ow):
    def call(*args, **kwargs):
        with ow.patch():
            return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    return call


PYTHON_ENTRIES = {"openwam_sdpa.sdpa": lambda ow: ow.sdpa, "patched F.sdpa": patched_f_sdpa}


# --------------------------------------------------------------------------
# Scalar arguments: the Python entry points take and refuse what F.sdpa does
# --------------------------------------------------------------------------


@pytest.mark.parametrize("entry", PYTHON_ENTRIES)
@pytest.mark.parametrize("arg,value", SCALAR_CASES, ids=[f"{a}-{v}" for a, v in SCALAR_CASES])
def test_scalar_argument_as_f_sdpa(ow, entry, arg, value):
    fn = PYTHON_ENTRIES[entry](ow)
    expected = outcome(F_SDPA, q_(), k_(), v_(), **{arg: VALUES[value]()})
    assert_same(outcome(fn, q_(), k_(), v_(), **{arg: VALUES[value]()}), expected, entry)


def test_scalar_catalogue_has_both_outcomes():
    """F.sdpa takes some of these values and refuses others, for each of the
    four arguments, with TypeError among other errors: the comparison above
    tests both sides."""
    for arg in ARGS:
        kinds = [outcome(F_SDPA, q_(), k_(), v_(), **{arg: make()})[0] for make in VALUES.values()]
        assert kinds.count("ok") >= 2 and kinds.count(TypeError) >= 5, (arg, kinds)


@pytest.mark.parametrize("arg,position", [("dropout_p", 5), ("is_causal", 6)])
@pytest.mark.parametrize("value", ["none", "str", "tensor_2"])
def test_scalar_argument_by_position(ow, arg, position, value):
    """By position, F.sdpa's message adds ' (position N)'. The Python entry
    points cannot tell how their caller passed the value and give the
    keyword form's message: the same type, the same text without the note."""
    args = [q_(), k_(), v_(), None, 0.0, False]
    args[position - 1] = VALUES[value]()
    kind, message = outcome(F_SDPA, *args)
    assert kind is TypeError and f" (position {position})" in message
    for entry, make in PYTHON_ENTRIES.items():
        got = outcome(make(ow), *args)
        assert got == (TypeError, message.replace(f" (position {position})", "")), entry


@pytest.mark.parametrize("arg,value", SCALAR_CASES, ids=[f"{a}-{v}" for a, v in SCALAR_CASES])
def test_explain_refuses_as_f_sdpa(ow, arg, value):
    expected = outcome(F_SDPA, q_(), k_(), v_(), **{arg: VALUES[value]()})
    got = outcome(ow.explain, q_(), k_(), v_(), **{arg: VALUES[value]()})
    if expected[0] == "ok":
        assert got[0] == "ok" and got[1]["backend"] in ("pytorch", "cudnn"), got
    else:
        assert got == expected


@pytest.mark.parametrize("arg,value", SCALAR_CASES, ids=[f"{a}-{v}" for a, v in SCALAR_CASES])
def test_op_parses_as_torch_ops_aten_sdpa(arg, value):
    """torch.ops.openwam.sdpa through torch.ops' binding: the same outcome
    as PyTorch's own op through it (first line of the message, op names
    swapped; the rest quotes each op's schema)."""
    def first_line(o):
        return o if o[0] == "ok" else (o[0], o[1].splitlines()[0])

    aten = outcome(torch.ops.aten.scaled_dot_product_attention, q_(), k_(), v_(),
                   **{arg: VALUES[value]()})
    if aten[0] != "ok":
        aten = (aten[0], aten[1].replace("aten::scaled_dot_product_attention", "openwam::sdpa"))
    got = outcome(torch.ops.openwam.sdpa, q_(), k_(), v_(), **{arg: VALUES[value]()})
    assert_same(first_line(got), first_line(aten), "torch.ops.openwam.sdpa")


def test_scalar_arguments_under_compile(ow):
    """torch.compile traces the Python entry: accepted values convert as in
    eager, refused ones raise F.sdpa's TypeError as F.sdpa does compiled."""
    def ours(q, k, v, **kw):
        return ow.sdpa(q, k, v, **kw)

    def stock(q, k, v, **kw):
        return F_SDPA(q, k, v, **kw)

    q, k, v = q_(), k_(), v_()
    accepted = {"dropout_p": 0, "is_causal": True, "scale": 1}
    got = torch.compile(ours, backend="aot_eager", fullgraph=True)(q, k, v, **accepted)
    torch.testing.assert_close(got, F_SDPA(q, k, v, **accepted), atol=0, rtol=0)
    for refused in ({"is_causal": None}, {"dropout_p": "1"}):
        expected = outcome(torch.compile(stock, backend="aot_eager"), q, k, v, **refused)
        assert expected[0] is TypeError
        assert outcome(torch.compile(ours, backend="aot_eager"), q, k, v, **refused) == expected


# --------------------------------------------------------------------------
# No error message prints a tensor's data
# --------------------------------------------------------------------------

MARK = 7351.0  # in every input, so that a message printing them shows it


def marked(t):
    return torch.full_like(t, MARK)


# The scalar values F.sdpa refuses (the rest of SCALAR_CASES it takes: no
# message to read there).
BAD_CALLS = {
    **{f"{a}-{v}": (lambda a=a, v=v: {a: VALUES[v]()}) for a, v in SCALAR_CASES
       if outcome(F_SDPA, q_(), k_(), v_(), **{a: VALUES[v]()})[0] != "ok"},
    "query_list": lambda: {"query": [[1.0]]},
    "mask_list": lambda: {"attn_mask": [[True]]},
    "unknown_keyword": lambda: {"window": 3},
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_no_message_prints_tensor_data(ow, case):
    entries = {**{n: make(ow) for n, make in PYTHON_ENTRIES.items()}, "explain": ow.explain}
    refused = []
    for name, fn in entries.items():
        kwargs = {"query": marked(q_()), "key": marked(k_()), "value": marked(v_()),
                  **BAD_CALLS[case]()}
        if name == "explain" and "window" in kwargs:
            continue  # not F.sdpa's signature: Python's own TypeError
        kind, message = outcome(fn, **kwargs)
        if kind != "ok":
            refused.append(name)
            assert "7351" not in message and "tensor(" not in message, (name, message)
    # Only calls F.sdpa refuses are cases here (BAD_CALLS), so some entry refused.
    assert refused, f"{case}: every entry took the call; it is no bad call"


def test_no_message_prints_tensor_data_through_the_op():
    """The op's message quotes the offending value (torch.ops' binding), never
    the query, key or value."""
    kind, message = outcome(torch.ops.openwam.sdpa, marked(q_()), marked(k_()), marked(v_()),
                            dropout_p="1")
    assert kind is RuntimeError and "7351" not in message


# --------------------------------------------------------------------------
# torch.func.vmap: as F.sdpa, with no warning of a missing batching rule
# --------------------------------------------------------------------------

VMAP_ENTRIES = {**PYTHON_ENTRIES, "torch.ops.openwam.sdpa": lambda ow: torch.ops.openwam.sdpa}
N = 3  # the vmapped dimension


def vmap_outcome(fn, args, capfd, **kwargs):
    """(output, warnings): Python warnings and what C++ printed to stderr
    (torch.ops' binding leaves C++ warnings there)."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.func.vmap(lambda *a: fn(*a, **kwargs))(*args)
    printed = capfd.readouterr().err
    return out, sorted({str(w.message) for w in caught}), printed


VMAP_SHAPES = {
    # 3-D: up to torch 2.14 F.sdpa's math backend, which batches silently
    # (2.15 takes its fused CPU kernel there too, and warns as in 4-D)
    "3d": ((N, B * H, L, E), (N, B * H, S, E)),
    # 4-D: on CPU F.sdpa's fused kernel, which has no batching rule and warns
    "4d": ((N, B, H, L, E), (N, B, H, S, E)),
}


@pytest.mark.parametrize("entry", VMAP_ENTRIES)
@pytest.mark.parametrize("shape", VMAP_SHAPES)
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"scale": 0.5}], ids=str)
def test_vmap_as_f_sdpa(ow, capfd, entry, shape, kwargs):
    qs, ks = VMAP_SHAPES[shape]
    args = (randn(*qs, seed=1), randn(*ks, seed=2), randn(*ks, seed=3))
    ours, ours_warned, ours_printed = vmap_outcome(VMAP_ENTRIES[entry](ow), args, capfd, **kwargs)
    stock, stock_warned, stock_printed = vmap_outcome(F_SDPA, args, capfd, **kwargs)
    torch.testing.assert_close(ours, stock, atol=0, rtol=0)
    torch.testing.assert_close(ours, F_SDPA(*args, **kwargs), atol=1e-12, rtol=0)
    assert "openwam" not in " ".join(ours_warned) + ours_printed
    if entry != "torch.ops.openwam.sdpa":  # F.sdpa's Python binding turns C++ warnings into Python's
        assert ours_warned == stock_warned
    if not stock_warned and "batching rule" not in stock_printed:  # where stock is silent, so is the op
        assert ours_warned == [] and "batching rule" not in ours_printed


def test_vmap_with_batched_mask_and_gqa(ow, capfd):
    q = randn(N, B, 4, L, E, seed=1)
    k, v = randn(N, B, 2, S, E, seed=2), randn(N, B, 2, S, E, seed=3)
    mask = torch.stack([make_mask("bool", B, 4, L, S, seed=s) for s in range(N)])
    ours, ours_warned, printed = vmap_outcome(ow.sdpa, (q, k, v, mask), capfd, enable_gqa=True)
    stock, stock_warned, _ = vmap_outcome(F_SDPA, (q, k, v, mask), capfd, enable_gqa=True)
    torch.testing.assert_close(ours, stock, atol=0, rtol=0)
    assert ours_warned == stock_warned and "openwam" not in printed


# PyTorch's warning for a vmapped fused CPU kernel without a batching rule:
# stock F.sdpa gives it as the op does (test_vmap_as_f_sdpa checks that they
# agree), so the tests below, which compare values, leave it out of the report.
STOCK_VMAP_WARNING = "ignore:There is a performance drop because we have not yet implemented the batching rule"


@pytest.mark.filterwarnings(STOCK_VMAP_WARNING)
@pytest.mark.parametrize("entry", VMAP_ENTRIES)
def test_vmap_of_grad_as_f_sdpa(ow, capfd, entry):
    """Per-sample gradients (vmap over torch.func.grad): the op runs at the
    grad level with the vmap below it."""
    fn = VMAP_ENTRIES[entry](ow)
    q, k, v = randn(N, B, H, L, E, seed=1), randn(N, B, H, S, E, seed=2), randn(N, B, H, S, E, seed=3)

    def per_sample(f):
        return torch.func.vmap(torch.func.grad(lambda q, k, v: f(q, k, v, is_causal=True).sum(),
                                               argnums=(0, 1, 2)))

    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = per_sample(fn)(q, k, v)
    assert "openwam" not in " ".join(str(w.message) for w in caught) + capfd.readouterr().err
    for a, b in zip(ours, per_sample(F_SDPA)(q, k, v)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.filterwarnings(STOCK_VMAP_WARNING)
def test_autograd_through_vmap(ow):
    q = randn(N, B, H, L, E, seed=1, requires_grad=True)
    k, v = randn(N, B, H, S, E, seed=2), randn(N, B, H, S, E, seed=3, requires_grad=True)
    grads = []
    for fn in (ow.sdpa, F_SDPA):
        out = torch.func.vmap(fn)(q, k, v)
        grads.append(torch.autograd.grad(out.square().sum(), (q, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# --------------------------------------------------------------------------
# Safer than F.sdpa: key and value of different lengths
# --------------------------------------------------------------------------

ALL_ENTRIES = {**VMAP_ENTRIES, "explain": lambda ow: ow.explain}
LENGTH_CASES = {
    "4d_shorter": (lambda: (q_(), k_(), v_(B, H, S - 1, E)), {}),
    "4d_longer": (lambda: (q_(), k_(), v_(B, H, S + 3, E)), {}),
    "4d_causal": (lambda: (q_(), k_(), v_(B, H, S - 2, E)), {"is_causal": True}),
    "4d_mask": (lambda: (q_(), k_(), v_(B, H, S - 1, E), make_mask("bool", B, H, L, S)), {}),
    "4d_gqa": (lambda: (q_(B, 4, L, E), k_(B, 2, S, E), v_(B, 2, S - 1, E)), {"enable_gqa": True}),
    "4d_float32": (lambda: (q_(dtype=torch.float32), k_(dtype=torch.float32),
                            v_(B, H, S - 1, E, dtype=torch.float32)), {}),
    "4d_grad": (lambda: (q_(requires_grad=True), k_(requires_grad=True),
                         v_(B, H, S - 1, E, requires_grad=True)), {}),
    "3d": (lambda: (q_(B, L, E), k_(B, S, E), v_(B, S - 1, E)), {}),
    "2d": (lambda: (q_(L, E), k_(S, E), v_(S + 1, E)), {}),
}


@pytest.mark.parametrize("entry", ALL_ENTRIES)
@pytest.mark.parametrize("case", LENGTH_CASES)
def test_key_value_length_mismatch_raises(ow, entry, case):
    make, kwargs = LENGTH_CASES[case]
    args = make()
    s_kv, s_v = args[1].shape[-2], args[2].shape[-2]
    with pytest.raises(RuntimeError) as info:
        ALL_ENTRIES[entry](ow)(*args, **kwargs)
    message = str(info.value)
    if args[0].dim() == 4:
        assert message == (f"openwam::sdpa: value must have the same sequence length as key "
                           f"({s_kv}), got {s_v}"), message  # one line: no C++ backtrace
    else:
        stock = outcome(F_SDPA, *args, **kwargs)
        if stock[0] == "ok":
            # The CPU flash kernel of torch 2.14.1 and 2.15 takes 3-D calls and
            # does not check value's length (it reads past value's rows; the
            # math backend refuses the call, below): the op keeps its own error.
            assert message == (f"openwam::sdpa: value must have the same sequence length as "
                               f"key ({s_kv}), got {s_v}"), message
        else:
            # F.sdpa raises below 4-D (its math backend's matmuls): its error,
            # type and words (the op's own had replaced it; found in review).
            assert stock == (type(info.value), message)
    # PyTorch's math backend refuses the call too, with the same type.
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError):
        F_SDPA(*args, **kwargs)


# Invalid in another way as well: F.sdpa's error for that comes first, type and
# words (the op's length check had replaced them, an IndexError included;
# found in review). Meta masks on CPU inputs too, whose device the op checks.
OTHER_ERROR_FIRST = {
    "2d_gqa": (lambda: (q_(3, 4), k_(1, 4), v_(3, 4)), {"enable_gqa": True}),
    "3d_mask_with_causal": (lambda: (q_(2, 3, 4), k_(2, 5, 4), v_(2, 1, 4),
                                     torch.ones(3, 5, dtype=torch.bool)), {"is_causal": True}),
    "heads_not_dividing": (lambda: (q_(1, 4, 3, 8), k_(1, 3, 5, 8), v_(1, 3, 4, 8)),
                           {"enable_gqa": True}),
    "mask_not_broadcasting": (lambda: (q_(1, 2, 3, 8), k_(1, 2, 5, 8), v_(1, 2, 4, 8),
                                       torch.ones(3, 6, dtype=torch.bool)), {}),
    "heads_unequal": (lambda: (q_(1, 4, 3, 8), k_(1, 2, 5, 8), v_(1, 2, 4, 8)), {}),
    "head_dims_unequal": (lambda: (q_(1, 2, 3, 8), k_(1, 2, 5, 4), v_(1, 2, 4, 8)), {}),
    "meta_mask_heads_unequal": (lambda: (q_(2, 3, 4, 8), k_(2, 2, 6, 8), v_(2, 2, 6, 8),
                                         torch.ones(4, 6, dtype=torch.bool, device="meta")), {}),
    "meta_mask_2d_gqa": (lambda: (q_(4, 8), k_(6, 8), v_(6, 8),
                                  torch.ones(4, 6, dtype=torch.bool, device="meta")),
                         {"enable_gqa": True}),
    "meta_mask_empty_batch": (lambda: (q_(0, 3, 4, 8), k_(0, 3, 6, 8), v_(0, 3, 6, 8),
                                       torch.ones(4, 6, dtype=torch.bool, device="meta")), {}),
    # F.sdpa's math backend serves these 4-D calls and raises for the lengths
    # itself (found in review).
    "lengths_with_dropout": (lambda: (q_(1, 2, 4, 8), k_(1, 2, 6, 8), v_(1, 2, 5, 8)),
                             {"dropout_p": 0.5}),
    "lengths_strided_query": (lambda: (q_(1, 2, 4, 16)[..., ::2], k_(1, 2, 6, 8),
                                       v_(1, 2, 5, 8)), {}),
    "3d_meta_mask": (lambda: (q_(2, 4, 8), k_(2, 6, 8), v_(2, 6, 8),
                              torch.ones(4, 6, dtype=torch.bool, device="meta")), {}),
    "5d_meta_mask": (lambda: (q_(1, 2, 2, 4, 8), k_(1, 2, 2, 6, 8), v_(1, 2, 2, 6, 8),
                              torch.ones(4, 6, dtype=torch.bool, device="meta")), {}),
    "meta_inputs_cpu_mask": (lambda: (torch.randn(2, 3, 4, 8, device="meta"),
                                      torch.randn(2, 3, 6, 8, device="meta"),
                                      torch.randn(2, 3, 6, 8, device="meta"),
                                      torch.ones(4, 6, dtype=torch.bool)), {}),
}


@pytest.mark.parametrize("case", OTHER_ERROR_FIRST)
def test_f_sdpas_own_error_comes_first(ow, case):
    make, kwargs = OTHER_ERROR_FIRST[case]
    args = make()
    stock = outcome(F_SDPA, *args, **kwargs)
    ours = outcome(ow.sdpa, *args, **kwargs)
    if stock[0] == "ok" and case.endswith("_meta_mask"):
        # torch 2.14.1 and 2.15's math backend runs a CPU call with a meta
        # mask, which holds no values (its output is not an all-True mask's):
        # a silent answer the op does not give. It refuses, as F.sdpa on 2.13
        # does.
        assert ours[0] is RuntimeError and "attn_mask is on meta" in ours[1], ours
    elif stock[0] == "ok":
        assert ours[0] == "ok" and ours[1].shape == stock[1].shape
    else:
        assert ours == stock


def test_key_value_length_mismatch_is_what_f_sdpa_misreads():
    """The premise: on CPU F.sdpa's fused kernel serves these 4-D calls, where
    its math backend refuses them; on a torch that refuses them itself the
    op's check is only redundant, and this test says so by skipping."""
    q, k = q_(dtype=torch.float32), k_(dtype=torch.float32)
    for s_v in (S - 1, S + 3):
        v = v_(B, H, s_v, E, dtype=torch.float32)
        kind, message = outcome(F_SDPA, q, k, v)
        if kind != "ok":
            pytest.skip(f"this torch's F.sdpa refuses the call itself: {message}")
        with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError):
            F_SDPA(q, k, v)


def nested_key_value_calls():
    """Nested key and value (ragged sequence lengths) with a dense or a nested
    query, as PyTorch's test_fused_kernels_nested_broadcasting_* build them."""
    seq = (3, 5, 2)

    def nested(lengths, heads=H):
        return torch.nested.nested_tensor([torch.randn(n, heads, E) for n in lengths]).transpose(1, 2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype feature"
        return {"dense query": (torch.randn(1, 1, H, E).transpose(1, 2), nested(seq), nested(seq)),
                "nested query": (nested((2, 2, 2)), nested(seq), nested(seq))}


@pytest.mark.parametrize("case", ("dense query", "nested query"))
def test_nested_key_value_as_f_sdpa(ow, case):
    """The op's key/value length check reads no size of a nested tensor (its
    ragged dimension has none): F.sdpa's outcome, its error included."""
    args = nested_key_value_calls()[case]
    expected = outcome(F_SDPA, *args)
    for fn in (ow.sdpa, torch.ops.openwam.sdpa):
        got = outcome(fn, *args)
        assert got[0] == expected[0] and (got[0] == "ok" or got[1] == expected[1]), (got, expected)


def jagged_beside_dense_calls():
    """A jagged (torch.jagged layout) key/value or mask beside a dense query:
    F.sdpa's nested-tensor handler raises its ValueError for them."""
    def jagged(*shapes):
        return torch.nested.nested_tensor([torch.randn(*s) for s in shapes], layout=torch.jagged)

    q, dense = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8)
    return {"jagged key and value": (q, jagged((3, 5, 8), (3, 6, 8)), jagged((3, 5, 8), (3, 6, 8))),
            "jagged key": (q, jagged((3, 5, 8), (3, 6, 8)), dense),
            "jagged mask": (q, dense, dense, jagged((4, 5), (4, 5)))}


@pytest.mark.parametrize("case", ("jagged key and value", "jagged key", "jagged mask"))
def test_jagged_beside_dense_query_as_f_sdpa(ow, case):
    """openwam_sdpa.sdpa hands any call with a nested tensor to PyTorch: its
    error, not the op's decomposition's (NotImplementedError _safe_softmax)."""
    args = jagged_beside_dense_calls()[case]
    expected = outcome(F_SDPA, *args)
    assert expected[0] is ValueError, expected
    assert outcome(ow.sdpa, *args) == expected


PRECEDENCE_CASES = {
    "dtype": lambda: (q_(), k_(dtype=torch.float32), v_(B, H, S - 1, E)),
    "device": lambda: (q_(), k_(), v_(B, H, S - 1, E).to("meta")),
    "mask_dtype": lambda: (q_(), k_(), v_(B, H, S - 1, E), torch.ones(L, S, dtype=torch.long)),
}


@pytest.mark.parametrize("case", PRECEDENCE_CASES)
def test_pytorch_errors_come_first(ow, case):
    """A call F.sdpa refuses on its own checks keeps F.sdpa's error."""
    make = PRECEDENCE_CASES[case]
    expected = outcome(F_SDPA, *make())
    assert expected[0] is RuntimeError
    for fn in (ow.sdpa, torch.ops.openwam.sdpa):
        assert outcome(fn, *make()) == expected


def test_key_value_length_mismatch_raises_under_compile(ow):
    compiled = torch.compile(ow.sdpa, backend="aot_eager", fullgraph=True, dynamic=True)
    q, k, v = q_(), k_(), v_()
    torch.testing.assert_close(compiled(q, k, v), F_SDPA(q, k, v))
    with pytest.raises(RuntimeError, match=re.escape("value must have the same sequence length")):
        compiled(q, k, v_(B, H, S - 1, E))


SHAPE_CASES = {
    # Served by PyTorch (its math backend broadcasts them); the op must give
    # what that backend gives, as F.sdpa does.
    "value_batch_1": lambda: (q_(), k_(), v_(1, H, S, E)),
    "key_value_batch_1": lambda: (q_(), k_(1, H, S, E), v_(1, H, S, E)),
    "query_batch_1": lambda: (q_(1, H, L, E), k_(), v_()),
    "value_heads_1": lambda: (q_(), k_(), v_(B, 1, S, E)),
    "key_value_heads_1": lambda: (q_(), k_(B, 1, S, E), v_(B, 1, S, E)),
    "key_value_3d_for_4d": lambda: (q_(), k_(H, S, E), v_(H, S, E)),
    "value_head_dim": lambda: (q_(), k_(), v_(B, H, S, 4)),
    "gqa_value_heads_1": lambda: (q_(B, 4, L, E), k_(B, 2, S, E), v_(B, 1, S, E)),
    "gqa_value_batch_1": lambda: (q_(B, 4, L, E), k_(B, 2, S, E), v_(1, 2, S, E)),
}


@pytest.mark.parametrize("case", SHAPE_CASES)
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
def test_other_shape_mismatches_as_math_backend(ow, case, dtype):
    args = [t.to(dtype) for t in SHAPE_CASES[case]()]
    kwargs = {"enable_gqa": True} if case.startswith("gqa") else {}
    with sdpa_kernel(SDPBackend.MATH):
        expected = F_SDPA(*args, **kwargs)
    tol = 1e-12 if dtype == F64 else 1e-5
    for fn in (ow.sdpa, torch.ops.openwam.sdpa):
        torch.testing.assert_close(fn(*args, **kwargs), expected, atol=tol, rtol=tol)


# --------------------------------------------------------------------------
# Safer than F.sdpa: a mask on another device than the query's
# --------------------------------------------------------------------------

# A meta mask stands in for one on another device (this machine has only the CPU).
MASK_DEVICE_CASES = {
    "4d_bool": (lambda: (q_(), k_(), v_()), lambda: torch.ones(L, S, dtype=torch.bool)),
    "4d_additive": (lambda: (q_(), k_(), v_()), lambda: torch.zeros(B, 1, L, S, dtype=F64)),
    "4d_float32": (lambda: (q_(dtype=torch.float32), k_(dtype=torch.float32),
                            v_(dtype=torch.float32)), lambda: torch.zeros(B, H, L, S)),
    "4d_key_padding": (lambda: (q_(), k_(), v_()), lambda: torch.ones(B, 1, 1, S, dtype=torch.bool)),
    "4d_grad": (lambda: (q_(requires_grad=True), k_(), v_()),
                lambda: torch.ones(L, S, dtype=torch.bool)),
    "4d_gqa": (lambda: (q_(B, 4, L, E), k_(B, 2, S, E), v_(B, 2, S, E)),
               lambda: torch.ones(B, 4, L, S, dtype=torch.bool)),
    "3d": (lambda: (q_(B, L, E), k_(B, S, E), v_(B, S, E)), lambda: torch.ones(L, S, dtype=torch.bool)),
}


@pytest.mark.parametrize("entry", ALL_ENTRIES)
@pytest.mark.parametrize("case", MASK_DEVICE_CASES)
def test_mask_on_another_device_raises(ow, entry, case):
    make, mask = MASK_DEVICE_CASES[case]
    args = make()
    kwargs = {"enable_gqa": True} if case.endswith("gqa") else {}
    with pytest.raises(RuntimeError) as info:
        ALL_ENTRIES[entry](ow)(*args, mask().to("meta"), **kwargs)
    stock = outcome(F_SDPA, *args, mask().to("meta"), **kwargs)
    if stock[0] != "ok":
        # F.sdpa's math backend (3-D inputs) raises its own device error: that
        # comes first (found in review).
        assert (type(info.value), str(info.value)) == stock
    else:
        # Worded as PyTorch's own device check (c10's, on CUDA: "Expected all
        # tensors to be on the same device, but got attn_bias is on cpu,
        # different from other tensors on cuda:0 (when checking argument in
        # method ...)").
        assert str(info.value) == (
            "Expected all tensors to be on the same device, but got attn_mask is on meta, "
            "different from other tensors on cpu (when checking argument in method "
            "openwam::sdpa)"), str(info.value)
    # The same call with the mask on the query's device is served: F.sdpa's
    # result, or (explain) the route PyTorch's own.
    served = ALL_ENTRIES[entry](ow)(*args, mask(), **kwargs)
    if entry == "explain":
        assert served["route"] == "pytorch", served
    else:
        torch.testing.assert_close(served, F_SDPA(*args, attn_mask=mask(), **kwargs),
                                   atol=0, rtol=0)


def test_mask_on_another_device_is_what_f_sdpa_misreads():
    """The premise: F.sdpa's fused CPU kernel takes a meta mask and returns
    without an error (reading memory that holds no mask). On a torch that
    refuses it itself the op's check is only redundant: then this skips."""
    args = MASK_DEVICE_CASES["4d_bool"][0]()
    # Half the keys hidden: the right answer differs from attending to all.
    mask = torch.arange(S).expand(B, H, L, S) < S // 2
    kind, got = outcome(F_SDPA, *args, mask.to("meta"))
    if kind != "ok":
        pytest.skip(f"this torch's F.sdpa refuses the call itself: {got}")
    assert not torch.allclose(got, F_SDPA(*args, attn_mask=mask)), \
        "F.sdpa read the meta mask right: the op's device check would only be redundant"


# Masks F.sdpa refuses for their shape keep its error, on any device.
MISSHAPEN_MASKS = {
    "0d": lambda: torch.tensor(True),
    "1d": lambda: torch.ones(S, dtype=torch.bool),
    "5d": lambda: torch.ones(1, B, H, L, S, dtype=torch.bool),
    "key_dim": lambda: torch.ones(B, H, L, S + 1, dtype=torch.bool),
    "query_dim": lambda: torch.ones(L + 2, S, dtype=torch.bool),
    "batch_dim": lambda: torch.zeros(3, 1, 1, S, dtype=F64),
}


@pytest.mark.parametrize("case", MISSHAPEN_MASKS)
def test_misshapen_mask_on_another_device_keeps_f_sdpa_error(ow, case):
    mask = MISSHAPEN_MASKS[case]().to("meta")
    expected = outcome(F_SDPA, q_(), k_(), v_(), mask)
    assert expected[0] != "ok", expected
    for fn in (ow.sdpa, torch.ops.openwam.sdpa):
        assert outcome(fn, q_(), k_(), v_(), mask) == expected
