"""Pre-emption inside a rank: SIGTERM, SIGINT or SIGHUP asks for a checkpoint and a clean exit at the
next step boundary, agreed by every rank. After a SIGHUP a stdout or stderr on the closed terminal
is pointed at /dev/null (:func:`~.rank_env.off_a_closed_terminal`): the log files still say everything.

Repeated signals are one request: under SLURM or Kubernetes a rank gets SIGTERM from the process
group and again from its launcher. Escalation is the launcher's (pretrain's kills the ranks on a
second Ctrl-C or after ``[train].preempt_timeout_s``; torchrun kills after its own timeout); only a
rank that is its own launcher (``--nproc 1``) aborts on a Ctrl-C that follows the first signal.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from par_groups import comm

from .rank_env import LAUNCHER_ENV, STOP_SIGNALS, Aborted, off_a_closed_terminal

SIGNALS = STOP_SIGNALS


class StopRequests:
    """Installs the handlers; :meth:`agreed` (every rank, once per step) says whether to save and stop.

    The ranks agree over a group with a short timeout, so a rank whose peer died does not wait long.
    """

    def __init__(self, timeout_s: float) -> None:
        self.signal: str | None = None  # the first signal's name
        self.own_launcher = os.environ.get(LAUNCHER_ENV) == str(os.getpid())
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=min(timeout_s, 30.0)))
        self.previous = {}
        try:
            self.previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        except ValueError:  # not the main thread: no handler, no pre-emption checkpoint
            return
        # pretrain's launcher starts ranks with SIGTERM and SIGHUP held pending until now: one sent
        # during start-up is delivered here and stops the run after its first step
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGHUP})

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            off_a_closed_terminal()
        if self.signal is not None and self.own_launcher and signum == signal.SIGINT:
            raise Aborted("interrupted again (SIGINT): stopped without saving", 130)
        self.signal = self.signal or signal.Signals(signum).name

    def agreed(self) -> bool:
        flag = torch.tensor([0.0 if self.signal is None else 1.0])
        comm.all_reduce(flag, self.group, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
