"""F.sdpa's arguments, read as PyTorch's argument parser reads them.

F.sdpa's parser (torch/csrc/utils/python_arg_parser.cpp) takes for a `float`
(dropout_p, scale) a Python float or int (bool included), a NumPy number, a
0-dim tensor that does not require grad, or a SymFloat/SymInt, and converts
it as float() does; for a `bool` (is_causal, enable_gqa) only a bool or a
SymBool. The bindings below the op are looser (pybind's and torch.ops' take
None as False and a tensor as its truth value) and their errors print the
arguments, tensors' contents included. So the Python entry points pass the op
only what F.sdpa would take, and hand anything else to F.sdpa itself, which
raises its own TypeError.

The same for the call as a whole: Python's binding words a missing argument,
a surplus one and an unknown keyword its own way and names the Python
function, so the entry points take them (REQUIRED, *extra, **unknown) and
pass the call on to F.sdpa (call_misbound), keeping F.sdpa's SIGNATURE for
inspect.
"""

import inspect
import sys
from typing import Optional

import torch

_SYMBOLIC_NUMBER = (torch.SymFloat, torch.SymInt)
_Tensor = torch.Tensor


def _takes_float(value) -> bool:
    if isinstance(value, (float, int)) or isinstance(value, _SYMBOLIC_NUMBER):
        return True
    if isinstance(value, _Tensor):
        return value.dim() == 0 and not value.requires_grad
    numpy = sys.modules.get("numpy")  # a NumPy number exists only once NumPy is imported
    return numpy is not None and isinstance(value, (numpy.number, numpy.bool_))


def _as_float(value):
    # float() converts as the parser does (__float__, then __index__), and
    # fails as it does (OverflowError, a complex tensor's RuntimeError);
    # symbolic numbers stay symbolic for the tracer.
    return value if isinstance(value, _SYMBOLIC_NUMBER) else float(value)


def _takes_bool(value) -> bool:
    return type(value) is bool or isinstance(value, torch.SymBool)


def _takes_int(value) -> bool:
    # An int (not a bool), a NumPy integer, a 0-dim integer tensor, a SymInt.
    if isinstance(value, int):
        return not isinstance(value, bool)
    if isinstance(value, torch.SymInt):
        return True
    if isinstance(value, _Tensor):
        return (value.dim() == 0 and not value.requires_grad and not value.is_floating_point()
                and not value.is_complex() and value.dtype is not torch.bool)
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.integer)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE


def _type_name(value) -> str:
    """The name the parser prints for value's type (CPython's tp_name): a
    class defined in Python by its name, a C type by its dotted name
    (numpy.float64)."""
    cls = type(value)
    if cls.__flags__ & _HEAP_TYPE or cls.__module__ == "builtins":
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


# The values an int64 argument takes.
INT64 = range(-(2**63), 2**63)


def _as_int(value):
    if isinstance(value, torch.SymInt):
        return value
    value = int(value)
    if torch.compiler.is_compiling():
        # Symbolic while traced (an int, a NumPy int or a 0-dim tensor): its
        # range is the tracer's; a range test of it would not trace
        # (InternalTorchDynamoError; found in review).
        return value
    if value not in INT64:
        torch.tensor(value)  # raises the parser's ValueError (its unpacking of an int64)
    return value


# kind -> (what it takes, its conversion, its name in the parser's messages)
_KINDS = {
    "Tensor": (lambda v: isinstance(v, _Tensor), lambda v: v, "Tensor"),
    "int": (_takes_int, _as_int, "int"),
    "float": (_takes_float, _as_float, "float"),
    "float?": (lambda v: v is None or _takes_float(v),
               lambda v: None if v is None else _as_float(v), "float"),
    "bool": (_takes_bool, lambda v: v, "bool"),
}


def parse(function: str, arguments) -> list:
    """(name, value, kind) triples read as PyTorch's parser reads an op's
    arguments of these kinds: the values converted, or for the first it
    refuses a TypeError in its words, naming `function` (as passed by
    keyword: no position note)."""
    values = []
    for name, value, kind in arguments:
        takes, convert, type_name = _KINDS[kind]
        if not takes(value):
            raise TypeError(f"{function}(): argument '{name}' must be {type_name}, "
                            f"not {_type_name(value)}")
        values.append(convert(value))
    return values


def scalars(dropout_p, is_causal, scale, enable_gqa):
    """(dropout_p, scale) as the op's float arguments, or None where F.sdpa
    rejects one of the four: the caller then calls F.sdpa for its error."""
    if not (_takes_float(dropout_p) and _takes_bool(is_causal)
            and (scale is None or _takes_float(scale)) and _takes_bool(enable_gqa)):
        return None
    return _as_float(dropout_p), (None if scale is None else _as_float(scale))


def keywords(dropout_p, is_causal, scale, enable_gqa) -> dict:
    """The four as keywords, for the call to F.sdpa that raises its error.

    F.sdpa's message adds " (position N)" for an argument passed by position.
    Which way the caller passed dropout_p or is_causal cannot be seen from
    here; by keyword, the message matches the common call (Hugging Face's),
    and says nothing untrue for the other."""
    return {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
            "enable_gqa": enable_gqa}


def _signature(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
               is_causal: bool = False, *, scale: Optional[float] = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """F.sdpa's signature (its builtin has none that inspect can read)."""


SIGNATURE = inspect.signature(_signature)


class _Required:
    """The default of an argument F.sdpa requires: the call left it out."""

    def __repr__(self):
        return "<required>"


REQUIRED = _Required()


def call_misbound(pytorch_sdpa, query, key, value, attn_mask, dropout_p, is_causal, extra,
                  scale, enable_gqa, unknown):
    """F.sdpa called as the caller called the entry point, for a call that
    misses query, key or value, passes more than six arguments by position
    or an unknown keyword: F.sdpa's parser raises the TypeError, worded as
    this torch release words it."""
    if extra:  # all six were passed by position
        return pytorch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, *extra,
                            scale=scale, enable_gqa=enable_gqa, **unknown)
    present = {name: t for name, t in (("query", query), ("key", key), ("value", value))
               if t is not REQUIRED}
    return pytorch_sdpa(**present, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **unknown)
