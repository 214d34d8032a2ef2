"""support.dropout_bias, the fuzzes' unbiasedness check for dropout: one
sample per dropout draw, so that outputs sharing a row's draws do not pass for
independent samples."""

from __future__ import annotations

import math

import torch

from support import dropout_bias


def _dropout_like(offset: float, generator: torch.Generator):
    """A forward whose rows share one keep/drop draw over 3 "keys" (as dropout
    over 3 keys gives): out - ref is correlated within each row."""
    values = torch.randn(3, 64, generator=generator)
    ref = values.mean(0).expand(8, 64)

    def forward():
        keep = (torch.rand(8, 3, 1, generator=generator) > 0.125).double() / 0.875
        return (keep * values.double()).mean(1) + offset

    return forward, ref


def test_unbiased_draws_pass():
    forward, ref = _dropout_like(0.0, torch.Generator().manual_seed(0))
    assert dropout_bias(forward, ref) < 6


def test_a_bias_of_a_tenth_of_the_output_fails():
    forward, ref = _dropout_like(0.05, torch.Generator().manual_seed(0))  # mean |ref| 0.42
    assert dropout_bias(forward, ref) > 6


def test_a_non_finite_output_fails():
    ref = torch.zeros(4, 4)
    assert not dropout_bias(lambda: torch.full((4, 4), float("nan")), ref) <= 6


def test_draws_are_differentiated_calls():
    """The op may plan a call nothing differentiates differently: the draws
    must be the training forward, with grad enabled."""
    ref = torch.zeros(4, 4)

    def forward():
        assert torch.is_grad_enabled()
        return torch.zeros(4, 4)

    assert dropout_bias(forward, ref) == 0.0


def test_constant_outputs():
    ref = torch.zeros(4, 4)
    assert dropout_bias(lambda: torch.zeros(4, 4), ref) == 0.0
    assert dropout_bias(lambda: torch.full((4, 4), 1e-3), ref) == math.inf


def test_an_empty_output_draws_nothing():
    """A packed batch whose only sequence has no query: nothing to be biased
    (its mean would be NaN and fail as a non-finite output)."""
    empty = torch.zeros(0, 4, 64)
    assert dropout_bias(lambda: torch.zeros(0, 4, 64), empty) == 0.0
