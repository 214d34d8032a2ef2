"""How every benchmark here times things (bench_sdpa, bench_block, bench_model,
bench_varlen_model): the clocks, paired rounds and their statistics.

The clocks, each for one question:
  * device_ms: every repeat enqueued behind a spin kernel that holds the GPU,
    so each event pair brackets only that call's kernels, not the host's time
    to launch them (the warm-up's host time sizes the spin).
  * call_host_us: the host time of single calls while a spin holds the GPU
    (no call waits for it), their results kept.
  * once_ms: one call, synchronised before and after (a first call's cost).
  * host_ms: the host time of one whole training step while a spin holds the
    GPU.
  * busy_ms: the GPU's kernel, memcpy and memset time of one call, from the
    profiler: the device time of a whole training step, whose thousands of
    launches no spin can hold.
  * wall_ms: back-to-back calls, synchronised once at the end.
  * synced_steps_ms: whole training steps timed one by one, synchronised
    before and after each, for a median of many.
  * peak_mib: the peak memory a call's tensors request (exact, unlike the allocated peak).

Drift of clocks and temperature over a run moves separate timings minutes
apart by a few percent (an A/A control read up to 1.04x unpaired), so
comparisons are paired: paired_rounds() measures every contender once per
round, the order rotating every second round and reversed every other one
(paired_order), and a ratio is the median of the per-round ratios. The
A/A control (again()) is the baseline measured a second time under another
name: its distance from 1 is the run's noise floor.

On a machine without CUDA every clock falls back to the host clock, which
lets the --selftest runs exercise this code on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Callable

import torch

# The spin must outlast the host's enqueueing of every repeat. It is sized
# from the host time of the warm-up calls (SPIN_FACTOR times the enqueueing
# it must cover), within these bounds; device_ms reports whether it did.
SPIN_MIN_MS = 10.0
SPIN_MAX_MS = 200.0
SPIN_FACTOR = 3.0


def cuda():
    return torch.cuda.is_available()


# ------------------------------------------------------------------ statistics


def percentile(xs, p):
    xs = sorted(xs)
    pos = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(samples):
    """Median, p10, p90 and min of a list of timings in ms."""
    return {"median_ms": percentile(samples, 50), "p10_ms": percentile(samples, 10),
            "p90_ms": percentile(samples, 90), "min_ms": min(samples), "n": len(samples)}


def over_rounds(values):
    """Median, min and max of one number per round."""
    return {"median": percentile(values, 50), "min": min(values), "max": max(values)}


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


# ---------------------------------------------------------------------- clocks


_cycles_per_ms = None


def spin(ms):
    """Hold the current stream for about `ms` milliseconds (torch.cuda._sleep, calibrated once)."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        torch.cuda._sleep(1_000_000)  # first launch pays the module load
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(ms * _cycles_per_ms))


def hold_gpu(warm_ms, repeats):
    """Synchronise, then spin long enough that `repeats` calls of warm_ms host time each are
    enqueued before the GPU gets to them (SPIN_FACTOR over, within the bounds; the longest
    spin when there is no warm-up figure)."""
    torch.cuda.synchronize()
    need_ms = SPIN_MAX_MS if warm_ms is None else SPIN_FACTOR * warm_ms * repeats
    spin(min(SPIN_MAX_MS, max(SPIN_MIN_MS, need_ms)))


def device_ms(steps, warmup, repeats):
    """Device time of each call, with the host kept ahead of the GPU.

    steps: a callable, or a tuple of callables run as a chain (the first gets
    None, each next one the previous one's result). A spin kernel holds the
    stream while every repeat is enqueued, so each event pair brackets only
    the chain's kernels, no host launch gap. Returns stats() of the device
    time, and covered: the spin still ran when the last repeat was enqueued
    (False: the figures may hold host time; None without CUDA).
    """
    steps = steps if isinstance(steps, tuple) else (steps,)

    def call():
        x = None
        for step in steps:
            x = step(x)

    t0 = time.perf_counter()
    for _ in range(warmup):
        call()
    warm_ms = (time.perf_counter() - t0) * 1e3 / warmup if warmup else None
    if not cuda():  # the host clock
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        return {**stats(times), "covered": None}
    hold_gpu(warm_ms, repeats)
    marks = []
    for _ in range(repeats):
        marks.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        marks[-1][0].record()
        call()
        marks[-1][1].record()
    covered = not marks[0][0].query()
    torch.cuda.synchronize()
    return {**stats([s.elapsed_time(e) for s, e in marks]), "covered": covered}


def once_ms(fn):
    """Wall ms of one fn() call, synchronised before and after."""
    if cuda():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def call_host_us(call, warmup, repeats):
    """Median host µs of call() while a spin holds the GPU (so no call waits for it), every
    result kept until the timing ends (so no call pays for freeing the previous one's output
    and autograd graph), and whether the spin outlasted the calls (None without CUDA)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        call()
    warm_ms = (time.perf_counter() - t0) * 1e3 / warmup if warmup else None
    kept, times = [], []
    if cuda():
        hold_gpu(warm_ms, repeats)
        mark = torch.cuda.Event()
        mark.record()
    for _ in range(repeats):
        t0 = time.perf_counter()
        kept.append(call())
        times.append((time.perf_counter() - t0) * 1e6)
    covered = None
    if cuda():
        covered = not mark.query()
        torch.cuda.synchronize()
    del kept
    return {"us": percentile(times, 50), "covered": covered}


def host_ms(step, spin_ms):
    """Host time of one step() while a spin of spin_ms holds the GPU, and whether the spin
    still ran when the step returned (None without CUDA). For whole training steps, whose
    launches may fill the GPU's queue: the host then waits, and covered is False."""
    if not cuda():
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3, None
    torch.cuda.synchronize()
    spin(spin_ms)
    mark = torch.cuda.Event()
    mark.record()
    t0 = time.perf_counter()
    step()
    ms = (time.perf_counter() - t0) * 1e3
    covered = not mark.query()
    torch.cuda.synchronize()
    return ms, covered


# Device activities of the profiler that are GPU work (not annotations or runtime calls).
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_ms(step):
    """GPU busy time of one step(): the sum of its kernels, copies and fills (None without CUDA)."""
    if not cuda():
        step()
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    cuda_type = torch._C._autograd.DeviceType.CUDA

    def device_work(e):
        if hasattr(e, "activity_type"):  # torch >= 2.12 names the activity
            return e.activity_type() in _DEVICE_WORK
        # torch 2.11: every event on the GPU but user annotations
        return e.device_type() == cuda_type and not getattr(e, "is_user_annotation", lambda: False)()

    work = [e for e in events if device_work(e)]
    return sum(e.duration_ns() for e in work) / 1e6 if work else None


def wall_ms(step, n):
    """Mean wall time of n back-to-back step() calls, synchronised once at the end."""
    if cuda():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if cuda():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def step_figures(step, wall_steps, host_steps=1):
    """The figures of a training step: wall_ms (mean of wall_steps back-to-back steps), host_ms
    (the median over host_steps steps, each with the GPU held by a spin longer than a whole
    step; one step's host time can swing by 20% from the next) with its covered flag (all
    of them covered), and gpu_ms (busy_ms of one step). One untimed step first: the round's
    first step after another contender's is not timed (the warm-up the docs promise)."""
    step()
    wall = wall_ms(step, wall_steps)
    held = [host_ms(step, spin_ms=max(SPIN_MIN_MS, 1.5 * wall)) for _ in range(host_steps)]
    covered = [c for _, c in held]
    return {"wall_ms": wall, "host_ms": percentile([ms for ms, _ in held], 50),
            "covered": None if None in covered else all(covered), "gpu_ms": busy_ms(step)}


def synced_steps_ms(step, steps, warmup=1):
    """Wall time of each of `steps` step() calls, each bracketed by torch.cuda.synchronize(),
    after `warmup` untimed calls; Python's garbage collector runs once before the first timed
    call and is then held off until the last has returned.

    For whole training steps, compared by the median of these samples. Why a sync around
    every step rather than one around a window of back-to-back steps: a host-bound step (the
    GPU waiting for launches, as small models are) leaves only its last few kernels to wait
    for at the sync, so the sync adds little to what is measured, and every step becomes a
    sample of its own: the median drops the steps that an OS hiccup, an allocator growth or
    a page fault hit, where a window's mean spreads them over the ratio (windows of 3 steps
    read an A/A ratio from 0.82x to 1.18x). Back to back, a step's host work would overlap
    the previous step's GPU tail and hide host overhead behind device time; synchronised,
    extra host time shows in full, the conservative reading for an op that adds host work. (Training loops
    that log loss.item() every step synchronise every step too.) The warm-up call absorbs
    what the code timed before left behind (caches, allocator blocks cut for other tensors,
    a profiler's teardown); the collector held off keeps a collection of someone else's
    garbage out of the samples (inside frozen_heap() that collect is cheap).
    """
    for _ in range(warmup):
        step()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    samples = []
    try:
        for _ in range(steps):
            if cuda():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if cuda():
                torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e3)
    finally:
        if was_enabled:
            gc.enable()
    return samples


@contextlib.contextmanager
def frozen_heap():
    """Collect, then gc.freeze() every object alive (models, optimizers, imported modules)
    until exit: a full gc.collect() then visits only what was made since, milliseconds
    instead of the 0.1-0.3 s that a heap of some 400k objects takes."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def peak_mib(fn):
    """Peak memory that fn()'s tensors request above what was requested before it (None without
    CUDA). Requested bytes, not torch.cuda.max_memory_allocated(): the caching allocator counts
    a whole block as allocated when the rest of it is too small to split off, so the allocated
    peak of one and the same step moves by about 1 MiB with the allocator's history (H200: the
    same varlen step twice, 25,343.7 and 25,344.7 MiB)."""
    if not cuda():
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats()["requested_bytes.all.peak"] - before) / 2.0**20


# -------------------------------------------------------------- paired rounds


@dataclasses.dataclass
class Contender:
    """What paired_rounds takes: a name, and a context entered around each
    of its measurements (contextlib.nullcontext for none)."""

    name: str
    context: Callable = contextlib.nullcontext


def again(contender):
    """The A/A control: the same contender (a dataclass) under the name '<name>-again'."""
    return dataclasses.replace(contender, name=f"{contender.name}-again")


def paired_order(contenders, r):
    """The order of round r: rotated by r // 2, and reversed in odd rounds.

    Over each two rounds every pair of contenders runs in both orders, at the
    same distance, so drift within a round (and what one contender leaves the
    next) cancels in the median of the per-round ratios. Rotation alone does
    not: with three contenders the one after the baseline ran after it in two
    rounds of three, and the A/A control, the other way round, drifted the
    other way, so it could not show that."""
    shift = (r // 2) % len(contenders)
    order = list(contenders[shift:]) + list(contenders[:shift])
    return order[::-1] if r % 2 else order


def paired_rounds(contenders, measure, rounds):
    """Measure every contender once per round, in paired_order().

    contenders: objects with .name and .context() (entered around each of
    its measurements); measure(contender) -> {key: number}. Returns
    {name: {key: [one number per round]}}. An even number of rounds balances
    every pair's order.
    """
    runs = {c.name: {} for c in contenders}
    for r in range(rounds):
        for c in paired_order(contenders, r):
            with c.context():
                for key, value in measure(c).items():
                    runs[c.name].setdefault(key, []).append(value)
    return runs


def round_ratios(runs, name, base, key):
    """over_rounds() of contender `name`'s per-round ratio to `base` on `key` (None if missing)."""
    pairs = list(zip(runs[name].get(key, []), runs[base].get(key, [])))
    if not pairs or any(a is None or b is None or b == 0 for a, b in pairs):
        return None
    return over_rounds([a / b for a, b in pairs])


def round_deltas(runs, name, base, key):
    """over_rounds() of contender `name`'s per-round difference from `base` on `key` (None if missing)."""
    pairs = list(zip(runs[name].get(key, []), runs[base].get(key, [])))
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    return over_rounds([a - b for a, b in pairs])
