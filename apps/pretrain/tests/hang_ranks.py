"""Rank entries for the hang tests: a few counted all-reduces, with one rank that stops (SIGSTOP)
or skips the last one; ranks import this module by name (the ``fault_ranks`` fixture's sys.path)."""

import os
import signal
import time

import torch

CALLS = 3


def all_reduces(fault: str, bad_rank: int, log_dir: str, timeout_s: float) -> None:
    from par_groups import comm

    from pretrain.runtime.hang import flight_recorder
    from pretrain.runtime.launch import init_distributed, shutdown

    rank, world, _, _ = init_distributed(timeout_s, "cpu")
    try:
        with flight_recorder(log_dir, rank, capacity=16):
            x = torch.ones(4)
            for call in range(1, CALLS + 1):
                if rank == bad_rank and call == CALLS:
                    if fault == "stop":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    else:  # skips the call and goes on with other work
                        time.sleep(10 * timeout_s)
                        return
                comm.all_reduce(x, None)
    finally:
        shutdown()
