"""``fault_ranks``: the rank entries that inject faults, importable by name in the rank processes; this
folder's shared helpers (``one_error_line``) importable by the tests, also under --import-mode=importlib."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def fault_ranks(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the ranks inherit the launcher's sys.path
    import fault_ranks

    return fault_ranks
