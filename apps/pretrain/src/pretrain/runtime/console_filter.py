"""torchrun's console, as pretrain's own launcher keeps it: C++ frames to a file, the rank's error line last.

tools/cluster/node.sh passes torchrun's stderr through this filter (``python -m pretrain.runtime.console_filter``).
Once a rank has printed its one ``error: ...`` line (a dead peer named by :mod:`.dead_rank`), what torchrun's
agent prints after it (its C++ store warnings with their frames, its own Python traceback, its failure
table) is noise to the user: it goes to ``torchrun_<host>_<pid>.log`` in the run's log dir (read from the
error line's ``(traceback in DIR/error.log)``), and the error lines are printed again at the end, so the
console's last line names the failure. C++ frame lines (``frame #N: ...``) never reach the console.
Everything else passes through at once, a line at a time (``\\r`` ends one too: progress bars stay live).
Without an error line naming a log dir, nothing is held: held lines are printed at the end as they came.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
from pathlib import Path

FRAME = re.compile(rb"^(Exception raised from .*\(most recent call first\):|frame #\d+: |<omitting python frames>)")
ERROR = re.compile(rb"^error: ")
TRACE_IN = re.compile(rb"\(traceback in (.+)\)\s*$")


class ConsoleFilter:
    def __init__(self, out) -> None:
        self.out = out  # a binary stream
        self.errors: list[bytes] = []  # the ranks' error lines, printed again last
        self.held: list[bytes] = []  # frames, and everything after the first error line
        self.log_dir: Path | None = None
        self._in_frames = False

    def line(self, raw: bytes) -> None:
        text = raw.rstrip(b"\r\n")
        if ERROR.match(text):
            self.errors.append(raw if raw.endswith(b"\n") else raw + b"\n")
            found = TRACE_IN.search(text)
            if found and self.log_dir is None:
                self.log_dir = Path(os.fsdecode(found.group(1))).parent
            self._pass(raw)  # now too: a user watching sees it as soon as it is known
            return
        frame = bool(FRAME.match(text)) or (self._in_frames and not text)  # a frame block ends with a blank line
        self._in_frames = frame and bool(text)
        if frame or self.errors:
            self.held.append(raw)
        else:
            self._pass(raw)

    def _pass(self, raw: bytes) -> None:
        if self.out is None:
            return
        try:
            self.out.write(raw)
            self.out.flush()
        except OSError:  # the console is gone (a closed terminal): keep reading, so torchrun never sees EPIPE
            self.out = None

    def finish(self) -> None:
        if not self.held:
            return
        if self.log_dir is None or not self.errors:  # nowhere to put them: nothing is lost
            self._pass(b"".join(self.held))
            return
        path = self.log_dir / f"torchrun_{socket.gethostname()}_{os.getpid()}.log"
        try:
            from .safe_files import write_atomic

            write_atomic(path, b"".join(self.held), fsync=False)
        except OSError:
            self._pass(b"".join(self.held))
            return
        self._pass(f"torchrun: its messages after the error ({len(self.held)} lines) are in {path}\n".encode())
        self._pass(b"".join(self.errors))


def run(fd: int = 0, out=None) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the scheduler's signal is torchrun's: this
        signal.signal(sig, signal.SIG_IGN)  # ends at its EOF, after the ranks' last words (a save's messages)
    out = out or sys.stdout.buffer
    filt, rest = ConsoleFilter(out), b""
    while chunk := os.read(fd, 65536):
        pieces = re.split(rb"(?<=[\r\n])", rest + chunk)
        rest = pieces.pop()  # the unfinished line (b"" after a terminator)
        for piece in pieces:
            filt.line(piece)
    if rest:
        filt.line(rest)
    filt.finish()


if __name__ == "__main__":
    run()
