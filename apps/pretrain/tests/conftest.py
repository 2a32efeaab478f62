"""``fault_ranks``: the rank entries that inject faults, importable by name in the rank processes."""

from pathlib import Path

import pytest


@pytest.fixture
def fault_ranks(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the ranks inherit the launcher's sys.path
    import fault_ranks

    return fault_ranks
