"""``pretrain report`` marks a fault-tolerant run's ``replica_lost`` / ``replica_joined`` events (a log written
here, no ranks)."""

import json

from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()


def test_report_lists_and_marks_the_replica_events(tmp_path):
    steps = [{"step": s, "loss": 5.0 - 0.1 * s, "step_time_s": 0.1, "tokens_per_s": 100.0} for s in range(1, 7)]
    events = [{"step": 2, "event": "replica_lost", "ranks": [1], "replica": 1, "stood_still_s": 0.25},
              {"step": 4, "event": "replica_joined", "ranks": [1], "replica": 1, "stood_still_s": 0.5,
               "bytes_moved": 123456}]
    lines = steps[:2] + events[:1] + steps[2:4] + events[1:] + steps[4:]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    res = runner.invoke(app, ["report", str(tmp_path), "--no-html"])
    assert res.exit_code == 0, res.output
    assert "after step 2: replica 1 lost (ranks 1); stood still 0.25 s" in res.stdout
    assert "after step 4: replica 1 rejoined (ranks 1), 123,456 bytes moved to it; stood still 0.50 s" in res.stdout
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
