"""Lets the tests here import their shared helpers (``layout_runs``), also under --import-mode=importlib."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
