"""Route existing code's F.scaled_dot_product_attention calls through the op.

`patch()` replaces torch.nn.functional.scaled_dot_product_attention, which is
what custom models, nn.MultiheadAttention and Hugging Face transformers'
"sdpa" attention call. Code that bound the function to a name of its own
before patch() (`from torch.nn.functional import ...`) keeps the original.
The switch is process-wide, like torch's own backend switches. TorchScript
compiles a patched call into openwam::sdpa.
"""

import threading

import torch
import torch.nn.functional as F

from . import _arguments
from .distributed import refuse_context_parallel_wrapper
from .ops import _PYTORCH_SDPA, sdpa

_REQUIRED = _arguments.REQUIRED


# Named as PyTorch's function: the one argument error Python's own binding
# still raises (an argument given twice) reads exactly as F.sdpa's. The rest
# (missing, surplus, unknown) reach F.sdpa through sdpa(), as there.
def scaled_dot_product_attention(query=_REQUIRED, key=_REQUIRED, value=_REQUIRED,
                                 attn_mask=None, dropout_p=0.0, is_causal=False, *extra,
                                 scale=None, enable_gqa=False, **unknown):
    return sdpa(query, key, value, attn_mask, dropout_p, is_causal, *extra,
                scale=scale, enable_gqa=enable_gqa, **unknown)


scaled_dot_product_attention.__doc__ = _PYTORCH_SDPA.__doc__
scaled_dot_product_attention.__signature__ = _arguments.SIGNATURE
_patched_sdpa = scaled_dot_product_attention
# torch.jit.script resolves F.scaled_dot_product_attention by identity: the
# patched function compiles to the op, whose schema is F.sdpa's.
torch.jit._builtins._register_builtin(_patched_sdpa, "openwam::sdpa")


def is_patched() -> bool:
    """Whether torch.nn.functional.scaled_dot_product_attention is openwam_sdpa's now."""
    return F.scaled_dot_product_attention is _patched_sdpa


# What F.sdpa is outside the transformers backend's calls, and the count of
# calls inside (patched_while_inside), under one lock: patch(), its exit and
# unpatch() set the function that holds once the last call leaves, and a call
# leaving restores the latest of them, not what it found on entry (which had
# undone another thread's patch() for good, or left a `with patch()` block's
# patch in place after it).
_lock = threading.Lock()
_inside = 0
_outside = None  # while calls are inside: what F.sdpa is once they leave


def _current():
    return _outside if _inside else F.scaled_dot_product_attention


def _set(fn) -> None:
    global _outside
    if _inside:
        _outside = fn
    else:
        F.scaled_dot_product_attention = fn


def _exchange(fn, refuse_context_parallel=False):
    """Make `fn` what F.sdpa is outside the backend's calls; returns what was.
    Under torch.compile the tracer records a plain swap (a lock would break
    the graph)."""
    if torch.compiler.is_compiling():
        previous = F.scaled_dot_product_attention
        if refuse_context_parallel:
            refuse_context_parallel_wrapper(previous)
        F.scaled_dot_product_attention = fn
        return previous
    with _lock:
        previous = _current()
        if refuse_context_parallel:
            refuse_context_parallel_wrapper(previous)
        _set(fn)
        return previous


class patch:
    """Send torch.nn.functional.scaled_dot_product_attention to openwam_sdpa.

    A plain call patches for good; used as a context manager it restores what
    was there before on exit:

        openwam_sdpa.patch()
        with openwam_sdpa.patch():
            ...
    """

    def __init__(self):
        # What was there before: PyTorch's function, our own, or a wrapper
        # someone else installed.
        self._previous = _exchange(_patched_sdpa, refuse_context_parallel=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _exchange(self._previous)
        return False

    def __repr__(self):
        # A bare patch() in a REPL prints this, not an object address.
        return f"openwam_sdpa.patch() (F.sdpa patched now: {is_patched()})"


class patched_while_inside:
    """F.sdpa patched while any caller is inside, and what was there before
    restored when the last one leaves: the transformers backend's patch per
    attention call. patch() per call would race between threads running
    models at once (nn.DataParallel's replicas, a server's workers): a
    thread leaving restores what it found on entry, which may be another
    thread's patch (F.sdpa then stays patched for good) or PyTorch's own
    while another thread is still inside (its call then runs on stock
    cuDNN, defects and all). Counted under the module's lock; under
    torch.compile the tracer sees a plain patch() instead (it records the
    swap, and a lock would break the graph)."""

    def __init__(self):
        global _inside, _outside
        self._traced = torch.compiler.is_compiling()
        if self._traced:
            self._patch = patch()
            return
        with _lock:
            if _inside == 0:
                previous = F.scaled_dot_product_attention
                refuse_context_parallel_wrapper(previous)
                _outside = previous
                F.scaled_dot_product_attention = _patched_sdpa
            _inside += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _inside, _outside
        if self._traced:
            return self._patch.__exit__(*exc)
        with _lock:
            _inside -= 1
            if _inside == 0:
                F.scaled_dot_product_attention = _outside
                _outside = None
        return False


def unpatch() -> None:
    """Restore PyTorch's own scaled_dot_product_attention (at once, or, while
    the transformers backend's calls are inside, when the last one leaves)."""
    _exchange(_PYTORCH_SDPA)


# The name of earlier releases: `with openwam_sdpa.patched(): ...`.
patched = patch
