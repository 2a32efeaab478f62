"""The `pretrain` command line: one typer app, each subcommand in its own module."""

from __future__ import annotations

import typer

from .commands import convert, groups, plan, prepare, schedule, topo, train

app = typer.Typer(
    name="pretrain",
    help="Train transformers with any mix of tensor, pipeline, context, expert and data parallelism.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Train transformers with any mix of tensor, pipeline, context, expert and data parallelism."""


app.command("train")(train.train)
app.command("plan")(plan.plan)
app.command("prepare")(prepare.prepare)
app.command("convert")(convert.convert)
app.command("groups")(groups.groups)
app.command("schedule")(schedule.schedule)
app.command("topo")(topo.topo)


def main() -> None:
    app()
