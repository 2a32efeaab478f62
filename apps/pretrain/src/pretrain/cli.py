"""The `pretrain` command line: one typer app, each subcommand in its own module."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from .commands import certify, cluster, convert, groups, hang, keys, plan, prepare, report, schedule, store, topo, train, verify


# typer vendors click; its ClickException is public only as the base of typer.BadParameter
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _OneLineErrors(TyperGroup):
    """A bad option or argument is one line (``error: ...``) and exit 2, like every other user error."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _ClickException as e:
            no_args = type(e).__name__ == "NoArgsIsHelpError"  # `pretrain` alone: the help, as before
            typer.echo(e.format_message() if no_args else f"error: {e.format_message()}", err=not no_args)
            sys.exit(e.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    rich_markup_mode=None,  # help text shows [train], [data] as written (rich would take them for markup)
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
app.command("verify")(verify.verify)
app.command("report")(report.report)
app.command("hang")(hang.hang)
app.command("certify")(certify.certify)
app.command("keys")(keys.keys)
app.command("cluster")(cluster.cluster)
app.command("store")(store.store)


def main() -> None:
    app()
