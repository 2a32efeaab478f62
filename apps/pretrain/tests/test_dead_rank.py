"""Naming a dead rank from the heartbeats (pretrain.runtime.dead_rank), in process: which peer is gone and
why, the survivor's line, its verdict for `pretrain hang`, and torchrun's console filtered. The same under
two real torchrun agents with a SIGKILLed worker: tests/test_torchrun_dead_rank.py (extended)."""

import io
import json
import socket
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.runtime import dead_rank
from pretrain.runtime.console_filter import ConsoleFilter
from pretrain.runtime.hang import record_path


def _beat(log_dir, rank, pid, host=None, t=None, doing="computing after all_reduce #4 on dp", **extra):
    path = dead_rank.alive_path(log_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "world": 6, "host": host or socket.gethostname(), "pid": pid,
                                "time": time.time() if t is None else t, "doing": doing} | extra))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_the_peers_gone_are_told_apart_and_the_culprit_comes_first(tmp_path):
    failed_at = time.time()
    _beat(tmp_path, 0, 1)  # this rank: never its own verdict
    _beat(tmp_path, 1, _dead_pid(), t=failed_at - 0.5)  # killed on this host
    _beat(tmp_path, 2, 4242, host="node-b", t=failed_at - 3)  # another host, heartbeat stopped
    _beat(tmp_path, 3, 4243, host="node-b", t=failed_at + 0.5)  # another host, alive
    _beat(tmp_path, 4, _dead_pid(), ended=dead_rank.LOST)  # a survivor that named its peer and ended
    _beat(tmp_path, 5, 4244, host="node-c", t=failed_at - 1, ended="raised RuntimeError: boom")
    dead = dead_rank.dead_peers(tmp_path, 0, failed_at, wait_s=0.2)
    assert [(d.rank, d.host) for d in dead] == [(5, "node-c"), (1, socket.gethostname()), (2, "node-b")]
    assert dead[0].how == "its process 4244 raised RuntimeError: boom"
    assert "died without exiting (killed" in dead[1].how and "stopped its heartbeat at" in dead[2].how


@pytest.mark.parametrize("error", [
    "[../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:16525: Connection reset by peer. GLHF!",
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 ms"])
def test_a_survivor_names_its_dead_peer_records_it_and_pretrain_hang_names_it(tmp_path, monkeypatch, error):
    from par_groups.watch import Entry

    held = []
    monkeypatch.setattr(dead_rank, "hold_stop_signals", lambda: held.append(1))
    waiting = Entry(5, "all_reduce", "dp", (0, 1), 4, time.time())
    beat = dead_rank.Heartbeat(tmp_path, 0, 2, type("Watch", (), {"entries": [waiting]})())
    monkeypatch.setattr(dead_rank, "_beat", beat)
    (tmp_path / "flight").mkdir()
    beat.beat()
    pid = _dead_pid()
    _beat(tmp_path, 1, pid, doing="in all_gather #7 on world")
    line = dead_rank.name_dead_peer(tmp_path, 0, error, failed_at=time.time())
    host = socket.gethostname()
    assert line.startswith(f"rank 1 failed on host {host}: its process {pid} died without exiting")
    assert "in all_gather #7 on world" in line and "rank 0 lost it in all_reduce #5 on dp" in line and held
    assert json.loads(dead_rank.alive_path(tmp_path, 0).read_text())["ended"] == dead_rank.LOST
    call = {"seq": 5, "op": "all_reduce", "group": "dp", "ranks": [0, 1], "bytes": 4, "peer": None}
    record = {"rank": 0, "time": time.time(), "where": "", "entries": [call], "in_flight": call}
    record_path(tmp_path, 0).write_text(json.dumps(record))
    res = CliRunner().invoke(app, ["hang", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("hang: rank 0 waits in all_reduce #5 on dp") and "not arrived: rank 1 (dead on host" \
        f" {host}: its process {pid} died without exiting" in res.output


def test_a_rank_that_raises_its_own_error_says_so_in_its_last_beat(tmp_path, monkeypatch):
    beat = dead_rank.Heartbeat(tmp_path, 1, 2)
    monkeypatch.setattr(dead_rank, "_beat", beat)
    (tmp_path / "flight").mkdir()
    assert dead_rank.name_dead_peer(tmp_path, 1, "RuntimeError: boom\nmore") is None
    assert json.loads(dead_rank.alive_path(tmp_path, 1).read_text())["ended"] == "raised RuntimeError: boom"


def test_torchruns_console_keeps_cpp_frames_and_its_own_report_in_the_log_and_the_error_last(tmp_path):
    out = io.BytesIO()
    filt = ConsoleFilter(out)
    err = f"error: rank 1 failed on host h: its process 9 died (traceback in {tmp_path}/error.log)\n".encode()
    lines = [b"step 1 loss 4.1\n", b"[W1205 TCPStore.cpp:138] recv failed\n",
             b"Exception raised from recvBytes at Utils.hpp:786 (most recent call first):\n",
             b"frame #0: c10::Error::Error() + 0x9d\n", b"<omitting python frames>\n", b"\n", b"progress 10%\r", err,
             b"Traceback (most recent call last):\n", b"torch...RendezvousConnectionError: failed\n"]
    for line in lines:
        filt.line(line)
    filt.finish()
    console = out.getvalue().decode().splitlines()
    assert console[-1] == err.decode().strip() and not any(l.startswith("frame #") for l in console)
    assert "step 1 loss 4.1" in console[0] and "progress 10%" in out.getvalue().decode()
    [log] = tmp_path.glob("torchrun_*.log")
    assert "frame #0" in log.read_text() and "RendezvousConnectionError" in log.read_text()
