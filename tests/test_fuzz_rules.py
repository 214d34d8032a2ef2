"""The GPU fuzzes' rules, as pure functions of measured errors
(support.contract_clause for the dense fuzz, support.packed_yardstick for the
varlen one, support.within_key_padded for both): which clause admits what, and
that an error none admits fails; and the varlen fuzz's floor for a gradient
that is exactly 0 (support.zero_gradient_floor)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from support import (contract_clause, floor_for, packed_yardstick, replayed_cases,
                     tensor_core_attention, within_key_padded, zero_gradient_floor)

NAN, INF = math.nan, math.inf


def clause(err, best=1.0, as_called=1.0, flash_efficient=-INF, key_padded=INF, floor=0.0):
    calls = []

    def padded():
        calls.append(1)
        return key_padded

    got = contract_clause(err, floor, best=best, as_called=as_called,
                          flash_efficient=flash_efficient, key_padded=padded)
    return got, len(calls)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(err=1.9), ("best stock", 0)),
    (dict(err=2.1, floor=0.2), ("best stock", 0)),
    (dict(err=3.0, best=1.0, as_called=2.0), ("as called", 0)),
    # stock as called finite: neither flash/efficient nor key-padded cuDNN may admit
    (dict(err=5.0, as_called=2.0, flash_efficient=9.0, key_padded=9.0), (None, 0)),
    # stock as called NaN or refused: the worse of flash and efficient, at 1x
    (dict(err=3.0, as_called=NAN, flash_efficient=3.0), ("flash or efficient", 0)),
    (dict(err=3.0, as_called=INF, flash_efficient=3.0), ("flash or efficient", 0)),
    # then key-padded stock cuDNN, at 2x, run only then
    (dict(err=6.0, as_called=NAN, flash_efficient=3.0, key_padded=3.0), ("key-padded cuDNN", 1)),
    (dict(err=6.1, as_called=NAN, flash_efficient=3.0, key_padded=3.0), (None, 1)),
    # key-padded cuDNN that could not run, or NaN, admits nothing
    (dict(err=6.0, as_called=NAN, flash_efficient=3.0, key_padded=INF), (None, 1)),
    (dict(err=6.0, as_called=NAN, flash_efficient=3.0, key_padded=NAN), (None, 1)),
    # a NaN error passes no clause
    (dict(err=NAN, as_called=NAN, flash_efficient=3.0, key_padded=3.0), (None, 1)),
])
def test_contract_clause(kwargs, expected):
    assert clause(**kwargs) == expected


@pytest.mark.parametrize("args, expected", [
    ((1.0, 3.0, 5.0, 7.0), 3.0),  # stock as called finite: as called or stock varlen
    ((1.0, INF, 5.0, 7.0), 1.0),  # stock varlen not applicable
    ((NAN, 3.0, 5.0, 7.0), 7.0),  # as called NaN: flash and efficient join
    ((NAN, INF, 5.0, NAN), 5.0),
    ((INF, INF, INF, INF), INF),  # no finite stock: finite is the bar
])
def test_packed_yardstick(args, expected):
    assert packed_yardstick(*args) == expected


def test_a_refused_stock_call_admits_nothing_by_itself():
    """Stock F.sdpa as called raising (error inf) is not a yardstick of inf."""
    assert clause(1e9, as_called=INF) == (None, 1)
    assert clause(1e9, best=INF, as_called=INF, flash_efficient=-INF) == (None, 1)


@pytest.mark.parametrize("err, key_padded, floor, expected", [
    (6.0, 3.0, 0.0, True),
    (6.1, 3.0, 0.0, False),
    (6.1, 3.0, 0.2, True),    # the floor counts
    (1.0, INF, 0.0, False),   # key-padded stock cuDNN could not run
    (1.0, NAN, 0.0, False),   # nor was finite
    (NAN, 3.0, 0.0, False),   # a NaN error passes nothing
])
def test_within_key_padded(err, key_padded, floor, expected):
    assert within_key_padded(err, key_padded, floor) is expected


def sequence_sdpa(q, k, v, go, is_causal, cast):
    """F.sdpa on one sequence in the packed layout, inputs through `cast`:
    out, dQ, dK, dV in float64."""
    rep = q.shape[1] // k.shape[1]
    heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    leaves = [cast(t).clone().requires_grad_() for t in (q, k, v)]
    qs, ks, vs = leaves
    out = F.scaled_dot_product_attention(
        heads_first(qs), heads_first(ks).repeat_interleave(rep, 1),
        heads_first(vs).repeat_interleave(rep, 1), is_causal=is_causal)[0].transpose(0, 1)
    grads = torch.autograd.grad(out, leaves, cast(go))
    return [out.detach().double()] + [g.double() for g in grads]


def zero_key_noise(q, k, v, go, is_causal):
    """PyTorch's fused CPU kernel's dQ and dK where every query sees key 0
    alone (their exact value 0), with the head_dim's summation order permuted
    eight times: the largest magnitude of each."""
    g = torch.Generator().manual_seed(q.shape[0])
    noise = {"dq": 0.0, "dk": 0.0}
    for _ in range(8):
        idx = torch.randperm(q.shape[-1], generator=g)
        _, dq, dk, _ = sequence_sdpa(*(t[..., idx] for t in (q, k, v, go)), is_causal,
                                     lambda t: t)
        for n, grad in zip(("dq", "dk"), (dq, dk)):
            noise[n] = max(noise[n], float(grad.abs().max()))
    return noise


@pytest.mark.parametrize("s_q, s_k, heads, kv_heads, head_dim, is_causal", [
    (1, 1, 1, 1, 64, True), (1, 1, 2, 1, 192, True), (1, 1, 4, 2, 256, True),
    # one causal query among many keys: keys past the first count for nothing
    (1, 300, 4, 1, 128, True),
    # one key under many queries and query heads: dK sums all their noise
    (512, 1, 4, 1, 128, False), (1024, 1, 8, 2, 256, False)])
@pytest.mark.parametrize("size_q", [1.0, 10.0])
def test_zero_gradient_floor_holds_fp32_rounding_and_no_real_error(s_q, s_k, heads, kv_heads,
                                                                   head_dim, is_causal, size_q):
    # The exact dQ and dK are 0. fp32 arithmetic leaves rounding noise there,
    # which the floor must hold; the error of a delta (dO . O) 1% off must lie
    # far above it.
    g = torch.Generator().manual_seed(head_dim + s_q)
    q, go = (size_q * torch.randn(s_q, heads, head_dim, generator=g) for _ in range(2))
    k, v = (torch.randn(s_k, kv_heads, head_dim, generator=g) for _ in range(2))
    floors = {n: zero_gradient_floor(n, q, k, v, go) for n in ("dq", "dk")}
    noise = zero_key_noise(q, k, v, go, is_causal)
    assert noise["dq"] <= floors["dq"] and noise["dk"] <= floors["dk"], (noise, floors)
    # dQ with delta 1% off: scale * P * (dP - 1.01 dP) * K_0.
    rep = heads // kv_heads
    dp = (go * v[:1].repeat_interleave(rep, 1)).sum(-1, keepdim=True)
    wrong_dq = head_dim ** -0.5 * 0.01 * dp * k[:1].repeat_interleave(rep, 1)
    assert float(wrong_dq.abs().max()) > 100 * floors["dq"]


def test_zero_gradient_floor_of_an_empty_sequence_is_zero():
    for name in ("dq", "dk"):
        assert zero_gradient_floor(name, torch.empty(0, 2, 64), torch.empty(0, 1, 64),
                                   torch.empty(0, 1, 64), torch.empty(0, 2, 64)) == 0.0


def keys_sharing(common, s_q, s_k, heads, kv_heads, head_dim, seed=0):
    """q, k, v, go with a component of size `common` shared by every key."""
    g = torch.Generator().manual_seed(seed)
    q, go = (torch.randn(s_q, heads, head_dim, generator=g) for _ in range(2))
    k, v = (torch.randn(s_k, kv_heads, head_dim, generator=g) for _ in range(2))
    return q, k + common * torch.randn(1, kv_heads, head_dim, generator=g), v, go


@pytest.mark.parametrize("s_q, s_k, heads, kv_heads, is_causal", [
    (64, 64, 2, 1, False), (37, 90, 4, 2, True), (90, 37, 2, 2, True), (1, 5, 4, 1, True)])
def test_tensor_core_attention_in_float64_is_sdpa(s_q, s_k, heads, kv_heads, is_causal):
    # Rounding to float64 rounds nothing: the layouts, the top-left causal
    # alignment and the key heads' sums must be F.sdpa's.
    q, k, v, go = (t.double() for t in keys_sharing(3.0, s_q, s_k, heads, kv_heads, 64))
    got = tensor_core_attention(q, k, v, go, torch.float64, is_causal)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got,
                            sequence_sdpa(q, k, v, go, is_causal, lambda t: t)):
        assert x.shape == ref.shape and float((x - ref).abs().max()) < 1e-12, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_rounding_is_a_kernels_error_and_grows_with_shared_keys(dtype):
    # The floor of varlen's per-sequence comparison: the error of rounding
    # P and dS to the input dtype. With keys that share a large component dQ's
    # products cancel and its error grows far past an ulp of dQ (the contract's
    # quarter-ulp floor), out's and dV's do not; PyTorch's fused CPU kernel
    # makes errors of the same size; on ordinary keys it stays below 2^-6 of
    # the result, and on shared keys a delta 5% off lies ten floors above it
    # (1% off, three: the size of dS's rounding, 2^-9 in bf16).
    def errors(common):
        q, k, v, go = (t.to(dtype) for t in keys_sharing(common, 64, 64, 2, 1, 64))
        ref = sequence_sdpa(q, k, v, go, False, lambda t: t.double())
        floor = [float((x - r).abs().max())
                 for x, r in zip(tensor_core_attention(q, k, v, go, dtype), ref)]
        cpu = [float((x - r).abs().max())
               for x, r in zip(sequence_sdpa(q, k, v, go, False, lambda t: t), ref)]
        return floor, cpu, ref

    (floor, cpu, ref), (floor20, cpu20, ref20) = errors(0.0), errors(20.0)
    assert all(0 < f < 2 ** -6 * float(r.abs().max()) for f, r in zip(floor, ref))
    assert floor20[1] > 10 * floor[1] and floor20[1] > 10 * floor_for(ref20[1], dtype)
    for grown, plain in ((floor20[0], floor[0]), (floor20[3], floor[3])):
        assert grown < 3 * plain
    for f, c in zip(floor + floor20, cpu + cpu20):
        assert f / 4 < c < 4 * f, (floor, cpu, floor20, cpu20)
    # Shared keys: dQ with delta 5% off, scale * P * (-0.05 delta) * K.
    q, k, v, go = (t.double().transpose(0, 1).repeat_interleave(2 // t.shape[1], 0)
                   for t in keys_sharing(20.0, 64, 64, 2, 1, 64))
    p = torch.softmax(64 ** -0.5 * q @ k.transpose(-1, -2), -1)
    delta = (p * (go @ v.transpose(-1, -2))).sum(-1, keepdim=True)
    wrong = 64 ** -0.5 * (p * 0.05 * delta) @ k
    assert float(wrong.abs().max()) > 10 * floor20[1]


def test_replayed_cases(monkeypatch):
    monkeypatch.delenv("OPENWAM_TEST_CASE", raising=False)
    assert replayed_cases("OPENWAM_TEST_CASE", 500) == (set(), 500)
    monkeypatch.setenv("OPENWAM_TEST_CASE", "45, 123,")
    assert replayed_cases("OPENWAM_TEST_CASE", 500) == ({45, 123}, 500)
    # a case past the count is still drawn
    assert replayed_cases("OPENWAM_TEST_CASE", 100) == ({45, 123}, 124)
