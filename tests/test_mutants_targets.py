"""tools/mutants.py stays runnable: every mutant's text occurs exactly once in its file, changes it,
and names tests that exist (a rename that removes the text makes the mutant an error, not a catch)."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("tools_mutants", ROOT / "tools/mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tools_mutants", module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module.MUTANTS


def test_every_mutant_targets_text_present_exactly_once():
    mutants = _mutants()
    assert len({m.name for m in mutants}) == len(mutants), "mutant names repeat"
    wrong = {m.name: (ROOT / m.path).read_text().count(m.old) for m in mutants
             if not (ROOT / m.path).is_file() or (ROOT / m.path).read_text().count(m.old) != 1}
    assert not wrong, f"mutants whose text does not occur exactly once (name: occurrences): {wrong}"
    assert all(m.old != m.new for m in mutants)


def test_every_mutant_names_tests_that_exist():
    missing = []
    for m in _mutants():
        assert m.tests, m.name
        for test in m.tests:
            path, _, rest = test.partition("::")
            func = rest.split("[")[0]
            file = ROOT / path
            if not file.is_file() or (func and not re.search(rf"^def {re.escape(func)}\(", file.read_text(), re.M)):
                missing.append(f"{m.name}: {test}")
    assert not missing, "mutants naming tests that do not exist:\n" + "\n".join(missing)
