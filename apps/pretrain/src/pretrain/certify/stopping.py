"""certify and signals: SIGTERM, SIGINT or SIGHUP (a closed terminal) stops it at once (it has nothing
to save): the ranks are stopped, one line, exit 143 (SIGTERM), 130 (SIGINT) or 129 (SIGHUP), as a shell
reports a process the signal ended.

The launcher's side reuses ``pretrain train``'s: while ranks run, pretrain's launcher
(:mod:`pretrain.runtime.local_launcher`) forwards the first signal to every rank as SIGTERM, kills
them on a second Ctrl-C, and hands the signal to the handler installed here once they have stopped;
outside that (the in-process one-rank reference, the checks before it) the handler here raises at
once. Either way the command sees one :class:`~pretrain.runtime.rank_env.Aborted` carrying the exit
code. A certify rank (unlike a training rank, which saves at the next step boundary) takes the
default action of SIGTERM: it ends where it is.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

from ..runtime.rank_env import LAUNCHER_ENV, STOP_SIGNALS, Aborted

SIGNALS = STOP_SIGNALS  # the signals that stop a training run stop a certify run too


@contextmanager
def stopped_by_signals():
    """While inside: the first SIGTERM / SIGINT / SIGHUP raises :class:`Aborted` (exit 128 + the signal's
    number); later ones change nothing. Only the main thread can hold handlers: elsewhere, none."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard: list[int] = []

    def on_signal(signum, frame) -> None:
        if heard:
            return
        heard.append(signum)
        raise Aborted(f"{signal.Signals(signum).name}: certify stopped its ranks before a verdict; "
                      f"nothing was certified", 128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def end_rank_on_sigterm() -> None:
    """In a rank process that pretrain's launcher started (it holds the stop signals pending until its
    entry handles them): SIGTERM or SIGHUP now ends it. Not in the launcher's own process (one rank runs there)."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or launcher == str(os.getpid()):
        return
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGHUP})
