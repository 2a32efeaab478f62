"""A Trainer dropped at the end of a job frees its model and its process groups: the reused rank
workers start every job with the same threads. (Each gloo group runs threads until it is freed; a
reference cycle through a tensor's C++ hooks once kept every test's groups alive, and a suite's
worth of them loaded the CPU.)"""

import pytest

from layout_runs import COMMON

LAYOUTS = {
    "tp2-optim_grads": ["parallel.tp=2", "parallel.zero=optim_grads"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.microbatches=2"],
    "dp2-optim_grads_params": ["parallel.zero=optim_grads_params"],
}


def one_step_then_threads(overrides):
    """This worker's thread count at the start of the job, then one training step."""
    import os

    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    threads = len(os.listdir("/proc/self/task"))
    Trainer(load_config(None, list(COMMON) + ["model.layers=2"] + list(overrides))).train_step(0)
    return threads


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_dropped_trainer_leaves_no_threads_in_the_worker(dist_run, name):
    counts = [dist_run(2, one_step_then_threads, LAYOUTS[name])[0] for _ in range(3)]
    assert counts == [counts[0]] * 3, f"{name}: worker threads at the start of each job: {counts}"
