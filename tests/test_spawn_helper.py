"""support.spawn_gloo_workers, which the distributed tests spawn through: it
tolerates a worker killed by a signal only after every rank wrote its results
(the gloo teardown abort), and fails on anything else."""

from __future__ import annotations

import os
import time

import pytest
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from support import spawn_gloo_workers


def _worker(rank, out_dir, write, how):
    if write:
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write("ok")
        # As after the distributed tests' last barrier: every rank has written.
        while not os.path.exists(os.path.join(out_dir, f"rank{1 - rank}")):
            time.sleep(0.01)
    if rank == 1 and how == "abort":
        os.abort()  # SIGABRT, as std::terminate in gloo's teardown
    if rank == 1 and how == "raise":
        raise RuntimeError("a failed check")


def _spawn(tmp_path, write, how):
    results = [str(tmp_path / f"rank{r}") for r in range(2)]
    spawn_gloo_workers(_worker, (str(tmp_path), write, how), 2, results, timeout_s=120)


def test_abort_after_the_results_is_tolerated(tmp_path):
    _spawn(tmp_path, write=True, how="abort")


def test_abort_before_the_results_fails(tmp_path):
    with pytest.raises(ProcessExitedException):
        _spawn(tmp_path, write=False, how="abort")


def test_an_exception_fails_even_after_the_results(tmp_path):
    with pytest.raises(ProcessRaisedException):
        _spawn(tmp_path, write=True, how="raise")
