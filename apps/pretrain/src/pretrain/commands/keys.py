"""`pretrain keys`: every config key with its default and meaning (the README's list)."""

from __future__ import annotations

import typer


def keys() -> None:
    """Every config key, section by section, with its default and meaning."""
    from ..config.key_docs import key_list

    typer.echo(key_list())
