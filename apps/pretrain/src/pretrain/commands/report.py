"""`pretrain report LOG_DIR`: a run's loss, tokens/s, MFU and time breakdown as one PNG (and HTML)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError, fail


TIMING = ("step_time_s", "time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_exposed_comm_s",
          "time_busy_max_s", "straggler_rank")  # the breakdown is drawn only when every step has all of them


def _number(value) -> bool:
    return type(value) in (int, float)


def read_log(log_dir: Path) -> tuple[list[dict], list[dict]]:
    """The train and eval records of ``<log_dir>/log.jsonl`` (a line that is not JSON is skipped; a record
    whose loss or step is no number is one error line). Optional figures that are not numbers are dropped."""
    path = log_dir / "log.jsonl"
    if not path.is_file():
        raise UsageError(f"{str(log_dir)!r} has no log.jsonl; give the [log].dir of a run")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text (byte {e.start}): not a log.jsonl pretrain wrote") from None
    train, evals = [], []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        kind = "loss" if isinstance(record, dict) and "loss" in record else "eval_loss"
        if not isinstance(record, dict) or kind not in record:
            continue
        if not (_number(record[kind]) and type(record.get("step")) is int):
            raise UsageError(f"{path}:{number} has {kind}={record[kind]!r}, step={record.get('step')!r}; a record's "
                             f"{kind} is a number and its step an integer (not a log.jsonl pretrain wrote?)")
        (train if kind == "loss" else evals).append(record)
    if not train:
        raise UsageError(f"{path} has no training steps yet")
    timed = all(_number(r.get(k)) for r in train for k in TIMING)
    return [_numbers_only(r, timed) for r in train], evals


def _numbers_only(record: dict, timed: bool) -> dict:
    """``record`` with tokens/s and MFU kept only as numbers, and the timing keys only if ``timed``."""
    out = {k: v for k, v in record.items() if timed or k not in TIMING}
    out |= {k: out[k] if _number(out.get(k)) else None for k in ("tokens_per_s", "mfu")}
    out["step_time_s"] = record["step_time_s"] if _number(record.get("step_time_s")) else float("nan")
    return out


def summary(train: list[dict]) -> list[str]:
    last = train[-1]
    lines = [f"{len(train)} steps, loss {train[0]['loss']:.4f} -> {last['loss']:.4f}"]
    speeds = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    if speeds:
        lines.append(f"median {statistics.median(speeds):,.0f} tokens/s")
    if all("time_fwd_bwd_s" in r for r in train):
        step = statistics.median(r["step_time_s"] for r in train)
        parts = {k: statistics.median(r[k] for r in train) for k in
                 ("time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_exposed_comm_s")}
        lines.append("median step {:.0f} ms: data {:.0%}, forward-backward {:.0%}, optimizer {:.0%}; waiting in "
                     "comm {:.0%}".format(1e3 * step, *(v / step for v in parts.values())))
        stragglers = statistics.multimode(r["straggler_rank"] for r in train)
        lines.append(f"slowest rank most often: {', '.join(map(str, stragglers))}")
    return lines


def report(
    log_dir: Path = typer.Argument(..., help="A run's [log].dir (holding log.jsonl)."),
    out: Optional[Path] = typer.Option(None, "--out", help="The PNG to write (default <log_dir>/report.png)."),
    html: bool = typer.Option(True, "--html/--no-html", help="Also write the page report.html beside the PNG."),
) -> None:
    """Draw a run's loss, tokens/s, MFU and where each step's time went, to one PNG (and HTML page)."""
    from ..observe.plots import report_html, report_png
    from ..observe.rank_report import rank_lines
    from ..observe.replica_events import describe, replica_events

    try:
        train, evals = read_log(log_dir)
        png = out or log_dir / "report.png"
        if not png.parent.is_dir():
            raise UsageError(f"--out {str(png)!r}: the directory {str(png.parent)!r} does not exist")
        title = f"{log_dir} (run {train[-1].get('run_id', '?')})"
        events = replica_events(log_dir)  # fault tolerance: marked on the loss curve and listed
        report_png(train, evals, title, png, events)
        lines = summary(train) + rank_lines(log_dir, train) + [describe(e) for e in events]
        if html:
            report_html(png, png.with_suffix(".html"), title, lines)
    except UsageError as e:
        raise fail(str(e))
    for line in lines:
        typer.echo(line)
    typer.echo(f"wrote {png}" + (f" and {png.with_suffix('.html')}" if html else ""))
