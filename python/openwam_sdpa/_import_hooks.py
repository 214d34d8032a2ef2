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
    the callback runs right after the module's code, once. The hook stays on
    sys.meta_path until then: importlib.util.find_spec alone (an
    is-it-installed check, as many libraries make for transformers) asks the
    finders too, and a hook that left at the first question lost the import
    that followed (the integration stayed unregistered; found in testing)."""

    def __init__(self, name: str, callback: Callable[[], Any]):
        self.name = name
        self.callback = callback
        self._searching = False
        self._done = False

    def find_spec(self, name: str, path: Any, target: Optional[Any] = None):
        if name != self.name or self._searching or self._done:
            return None
        self._searching = True  # importlib.util.find_spec below asks this finder again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        if getattr(exec_module, "_after_import", None) is self:
            return spec  # a loader shared between specs (zipimport) is wrapped once

        def exec_then_callback(module):
            exec_module(module)
            # A shared loader runs other modules too: only this one counts.
            if module.__name__ == self.name and not self._done:
                self._done = True
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                self.callback()

        exec_then_callback._after_import = self
        spec.loader.exec_module = exec_then_callback
        return spec


def after_import(name: str, callback: Callable[[], Any]) -> None:
    if name in sys.modules:
        callback()
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
