"""`pretrain train [CONFIG]`: train standalone (`--nproc N` local ranks) or as one rank under torchrun."""

from __future__ import annotations

from typing import List, Optional

import typer

from ..errors import UsageError, fail


def train(
    config: Optional[str] = typer.Argument(None, help="TOML config (default: the embedded tiny.toml) or a shipped name."),
    overrides: List[str] = typer.Option([], "--set", help="Override a key: --set section.key=value (repeatable)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Local ranks to start (default [train].nproc); ignored under torchrun."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
) -> None:
    """Train a model. Without arguments: the embedded default on generated data, on the CPU."""
    from ..config import load_config
    from ..launch import Aborted, RankFailed, check_nproc, launch, under_torchrun
    from ..run import run_rank

    try:
        cfg = load_config(config, overrides)
        n = nproc if nproc is not None else cfg.train.nproc
        if not under_torchrun():
            check_nproc(n, device)
            cfg.validate_world(n)
            from ..data import load_dataset

            load_dataset(cfg.data, cfg.model.vocab_size)  # a missing or malformed file fails here, once
        launch(run_rank, (config, list(overrides), device), nproc=n, device=device,
               join_timeout_s=cfg.train.timeout_s, preempt_timeout_s=cfg.train.preempt_timeout_s)
    except UsageError as e:
        raise fail(str(e))
    except Aborted as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=e.exit_code)
    except RankFailed as e:
        typer.echo(f"error: rank {e.rank} failed: {e.error}", err=True)
        if e.traceback:
            typer.echo(e.traceback, err=True)
        raise typer.Exit(code=1)
