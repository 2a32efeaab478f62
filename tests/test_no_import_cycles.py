"""No import circles, in any package or the app: the modules of every ``src/`` form a DAG.

Every ``import`` and ``from ... import`` in a module (function-level ones too: a lazy import that
closes a circle is still one) is an edge to the module it names; ``from pkg import sub`` names the
submodule ``pkg.sub`` when there is one. Tarjan's strongly connected components then must all be
single modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("apps/*/src"), *ROOT.glob("packages/*/src")]


def modules() -> dict[str, Path]:
    out = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods}
                edges[name] |= subs
                if target in mods and len(subs) < len(node.names):
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_round_about():
    mods = modules()
    assert len(mods) > 150 and "pretrain.training.train_loop" in mods and "par_zero.bucket" in mods
    assert cycles(import_edges(mods)) == []


# ---- the app's folders ------------------------------------------------------------------------------
APP = "pretrain"

# Folder pairs that still import each other, with why (none: the families' building blocks sit in ``blocks``,
# below both the registry ``models`` and the assembly ``model`` that looks a family up).
KNOWN_FOLDER_CYCLES: set[tuple[str, str]] = set()


def folder_of(module: str, mods: dict[str, Path]) -> str | None:
    """The app folder (``pretrain.<folder>``) a module belongs to; None for the app's top-level modules."""
    parts = module.split(".")
    if parts[0] != APP or len(parts) < 2:
        return None
    return parts[1] if len(parts) > 2 or mods[module].name == "__init__.py" else None


def folder_edges(mods: dict[str, Path], edges: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """``(folder, other folder)``: the module imports that make the first import the second."""
    out: dict[tuple[str, str], list[str]] = {}
    for a, targets in edges.items():
        fa = folder_of(a, mods)
        for b in sorted(targets):
            fb = folder_of(b, mods)
            if fa and fb and fa != fb:
                out.setdefault((fa, fb), []).append(f"{a} -> {b}")
    return out


def two_cycles(pairs: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    """The folder pairs importing each other (each once, sorted), with the imports both ways."""
    return {(a, b): pairs[(a, b)] + pairs[(b, a)] for a, b in pairs if a < b and (b, a) in pairs}


def test_the_folder_finder_sees_a_two_cycle():
    mods = {"pretrain.a.x": Path("x.py"), "pretrain.b.y": Path("y.py"), "pretrain.c.z": Path("z.py"),
            "pretrain.cli": Path("cli.py")}
    edges = {"pretrain.a.x": {"pretrain.b.y"}, "pretrain.b.y": {"pretrain.a.x", "pretrain.c.z"},
             "pretrain.c.z": set(), "pretrain.cli": {"pretrain.a.x"}}
    assert two_cycles(folder_edges(mods, edges)) == {("a", "b"): ["pretrain.a.x -> pretrain.b.y",
                                                                  "pretrain.b.y -> pretrain.a.x"]}


def test_no_two_app_folders_import_each_other():
    mods = modules()
    found = two_cycles(folder_edges(mods, import_edges(mods)))
    new = {pair: found[pair] for pair in found if pair not in KNOWN_FOLDER_CYCLES}
    assert not new, "app folders importing each other: " + "; ".join(
        f"{a} <-> {b} ({', '.join(imports)})" for (a, b), imports in new.items())
    assert set(found) == KNOWN_FOLDER_CYCLES, f"no longer a cycle, drop it from KNOWN_FOLDER_CYCLES: {KNOWN_FOLDER_CYCLES - set(found)}"


IMPORT_EACH_FIRST = """
import importlib, pkgutil, sys
import pretrain

folders = sorted(m.name for m in pkgutil.iter_modules(pretrain.__path__) if m.ispkg)
names = {}
for f in folders:
    pkg = importlib.import_module(f"pretrain.{f}")
    names[f] = [pkg.__name__] + [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for first in folders + ["*"]:  # each folder imported first into a fresh app, then all of them backwards
    for name in [n for n in sys.modules if n == "pretrain" or n.startswith("pretrain.")]:
        del sys.modules[name]
    for f in [first] if first != "*" else folders[::-1]:
        for name in names[f]:
            importlib.import_module(name)
print(len(folders))
"""


def test_every_app_folder_imports_first():
    """Every folder's modules import into a fresh app (no ``pretrain`` module loaded yet; torch and the
    packages stay loaded, so it is cheap) whichever folder comes first: no import order breaks."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", IMPORT_EACH_FIRST], capture_output=True, text=True, timeout=55)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 10, done.stdout
