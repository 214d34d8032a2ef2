"""Run a callback once a module is imported: now if it already is, else right
after its first import. `import openwam_sdpa` then registers with optional
libraries (DTensor, transformers) without importing them itself, which would
cost every user seconds."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable, Optional


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the module with the other finders, then wraps its loader so that
    the callback runs right after the module's code (a one-shot hook)."""

    def __init__(self, name: str, callback: Callable[[], Any]):
        self.name = name
        self.callback = callback

    def find_spec(self, name: str, path: Any, target: Optional[Any] = None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        callback = self.callback

        def exec_then_callback(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_callback
        return spec


def after_import(name: str, callback: Callable[[], Any]) -> None:
    if name in sys.modules:
        callback()
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
