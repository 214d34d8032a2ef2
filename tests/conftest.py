"""Fixtures of both suites (tests/ and tests/gpu): every test starts from
the default settings, `settings` changes them for one test, `ow` is the
package under test and `unpatched` keeps F.sdpa unpatched around a test.

The helpers (inputs, masks, the float64 reference, the error rule) live in
support.py; tests/gpu/conftest.py adds what only the GPU suite needs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from support import ENV_VARS, F_SDPA


def _reload_settings():
    import openwam_sdpa

    openwam_sdpa.reload_settings()


@pytest.fixture(autouse=True)
def _clean_settings(monkeypatch):
    """Every test starts from the default settings, whatever the shell set,
    and from a fixed seed. The package caches its settings: they are re-read
    here, and again after the test has restored the environment."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    _reload_settings()
    torch.manual_seed(0)
    yield
    monkeypatch.undo()
    for name in ENV_VARS:
        os.environ.pop(name, None)
    _reload_settings()


@pytest.fixture
def settings(monkeypatch):
    """settings(cudnn=None, pad="always", check_finite=None, frontend=None): set the
    openwam_sdpa environment for this test and reload the cached settings;
    None unsets a variable."""

    def apply(cudnn=None, pad=None, check_finite=None, frontend=None):
        for name, value in zip(ENV_VARS, (cudnn, pad, check_finite, frontend)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))
        _reload_settings()

    return apply


@pytest.fixture(scope="session")
def ow():
    """The package under test (from PYTHONPATH or the installed package)."""
    import openwam_sdpa

    return openwam_sdpa


@pytest.fixture
def unpatched(ow):
    """F.sdpa unpatched when the test starts, and again (asserted) when it
    ends, whatever the test left behind."""
    ow.unpatch()
    yield
    ow.unpatch()
    assert F.scaled_dot_product_attention is F_SDPA
