"""A hang names itself: the launcher's error names the rank that has not arrived and the collective
the others wait in, within [train].collective_timeout_s + 10 s, from the ranks' flight records."""

import functools
import json
import time

import pytest

from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.runtime.launch import RankFailed, launch

TIMEOUT_S = 4.0


@pytest.mark.parametrize("fault", ["stop", "skip"])
def test_the_launcher_names_the_rank_that_has_not_arrived(fault, tmp_path, fault_ranks):
    import hang_ranks

    entry = functools.partial(hang_ranks.all_reduces, fault, 2, str(tmp_path), TIMEOUT_S)
    with pytest.raises(RankFailed) as failed:
        # the rendezvous bound is start-up on a loaded machine (forkserver, imports), not what is tested here
        launch(entry, nproc=3, device="cpu", join_timeout_s=120, log_dir=str(tmp_path))
    named_at = time.time()
    e = failed.value
    assert e.rank == 2, e.error
    assert f"wait in all_reduce #{hang_ranks.CALLS} on world (ranks 0-2, 16 B)" in e.error, e.error
    assert ("stopped (SIGSTOP)" if fault == "stop" else "rank 2 (in no collective at") in e.error, e.error
    if fault == "skip":
        assert "time.sleep" in e.error, e.error  # where the rank was, from its stack
    assert "ranks 0, 1 wait" in e.error, e.error
    # the waiting ranks' records: the ring's last call in flight, the earlier ones done
    record = json.loads((tmp_path / "flight" / "rank_0.json").read_text())
    assert [(x["seq"], x["state"]) for x in record["entries"]] == [(1, "done"), (2, "done"), (3, "waiting")]
    assert "all_reduces" in record["stack"]
    # from the moment rank 0 began to wait to the launcher's error: within timeout_s + 10 s
    assert named_at - record["in_flight"]["start"] < TIMEOUT_S + 10, named_at - record["in_flight"]["start"]
    # `pretrain hang LOG_DIR` (torchrun's ranks write the same records): the same line from the records alone
    out = CliRunner().invoke(app, ["hang", str(tmp_path)])
    assert out.exit_code == 0, out.output
    summary = e.error.split("s: ", 1)[1]
    if fault == "stop":  # the launcher saw the stopped process in /proc; the records only that rank 2 left none
        summary = summary.replace("process stopped (SIGSTOP), no flight record",
                                  "no flight record: stopped, dead, or stuck outside a collective")
    assert out.output.strip() == f"hang: {summary}", (out.output, e.error)


def test_hang_without_records(tmp_path):
    runner = CliRunner()
    none = runner.invoke(app, ["hang", str(tmp_path)])
    assert (none.exit_code, none.output.strip()) == (0, f"no hang recorded (no flight records in {tmp_path / 'flight'})")
    missing = runner.invoke(app, ["hang", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1, missing.output
    assert missing.output.startswith(f"error: '{tmp_path / 'nope'}' is not a directory"), missing.output
