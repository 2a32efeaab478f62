"""Rank entries for the certify tests: the layout's ranks with a planted bug (patched in the rank
processes only, undone after: the harness reuses its workers)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def planted(bug: str | None):
    if bug is None:
        yield
        return
    raise ValueError(bug)


def layout_with_bug(bug, config, overrides, steps, work, margin):
    from pretrain.certify.ranks import run_layout

    with planted(bug):
        return run_layout(config, overrides, steps, work, margin)
