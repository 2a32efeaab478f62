"""A model family is one folder under ``pretrain/models`` and one line in its registry: the app asks the
family's declaration instead of comparing family names, and a layout the declaration does not run is one
``error:`` line. (Each family's numbers are checked where they are used: the HF, layout, plan and certify
tests.)"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from one_error_line import assert_one_error_line
from pretrain.cli import app
from pretrain.models import ATTENTIONS, FAMILIES, FOLDERS, family_of
from pretrain.models.family import DIMENSIONS, FEATURES

SRC = Path(__file__).resolve().parents[1] / "src" / "pretrain"


def test_no_family_name_is_compared_outside_its_folder():
    """Every family-specific decision reads a declaration: the attention names appear in their own folders only."""
    for family in FAMILIES:
        if family.attention == "gqa":  # the default: written in the config's defaults and messages
            continue
        own = SRC / "models" / type(family).__module__.split(".")[2]  # pretrain.models.<folder>.family
        found = [f"{p.relative_to(SRC)}" for p in SRC.rglob("*.py") if own not in p.parents
                 and p != SRC / "models" / "__init__.py" and f'"{family.attention}"' in p.read_text()]
        assert not found, (family.attention, found)


# where the families older than the one-folder rule are still named outside it (their [model] keys and
# their docs live in the shared section): this may shrink, never grow, and no newer family has an entry
NAMED_OUTSIDE = {"deepseek": {"config/model_section.py", "config/flavors.py", "sizing/flops.py", "checkpoint/hf.py"},
                 "qwen3_next": {"config/key_docs.py", "config/model_section.py"}}


def test_a_family_is_named_only_in_its_folder_and_its_one_registry_line():
    """No file of the app outside ``models/<family>/`` names the family (its folder, attention value or
    transformers model_type) but its line in ``FOLDERS``; ``gqa`` is the base the others build on."""
    registry = SRC / "models" / "__init__.py"
    files = {p: p.read_text(errors="replace") for p in SRC.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p != registry}
    for folder, family in zip(FOLDERS, FAMILIES):
        if folder == "gqa":  # the default attention, and the declaration others extend
            continue
        names = sorted({folder, folder.replace("_", "-"), family.attention, *family.hf_architectures})
        named = re.compile(r"(?<![\w-])(%s)(?![\w-])" % "|".join(map(re.escape, names)))
        assert [line for line in registry.read_text().splitlines() if named.search(line)] == [f'    "{folder}",']
        found = {str(p.relative_to(SRC)) for p, text in files.items()
                 if SRC / "models" / folder not in p.parents and named.search(text)}
        assert found <= NAMED_OUTSIDE.get(folder, set()), (folder, sorted(found - NAMED_OUTSIDE.get(folder, set())))


def test_a_shipped_config_name_in_two_folders_is_one_error_line(monkeypatch, tmp_path):
    from pretrain.config import config_files

    for shipped in ("configs/tiny.toml", "models/b/configs/b.toml", "models/c/configs/c.toml", "models/c/configs/b.toml"):
        (tmp_path / shipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / shipped).write_text("")
    monkeypatch.setattr(config_files, "FOLDERS", ("b", "c"))
    monkeypatch.setattr(config_files.resources, "files", lambda package: tmp_path)
    res = CliRunner().invoke(app, ["plan", "--world", "1"])
    assert_one_error_line(res, "clash", "shipped config b.toml is in both pretrain/models/b/configs/ and "
                                        "pretrain/models/c/configs/: shipped config names must be unique")


def test_every_family_declares_the_whole_interface():
    assert ATTENTIONS == tuple(f.attention for f in FAMILIES) and len(set(ATTENTIONS)) == len(ATTENTIONS)
    for family in FAMILIES:
        assert family.supports <= set(FEATURES) and set(family.dimensions) <= set(DIMENSIONS), family.attention
        for name in ("check", "qk_head_dim", "value_width", "attention_shapes", "build_attention", "saved_bytes",
                     "ring_widths", "junction_bytes", "narrowing", "model_config_from_hf", "hf_config",
                     "from_hf_names", "to_hf_names"):
            assert getattr(type(family), name) is not getattr(type(family).__mro__[-2], name), (family.attention, name)


@pytest.mark.parametrize("dimension, world", [("tp", 2), ("cp", 2), ("pp", 2)])
def test_a_dimension_the_family_does_not_declare_is_one_error_line(monkeypatch, dimension, world):
    family = family_of(type("M", (), {"attention": "gqa"})())
    monkeypatch.setattr(family, "dimensions", tuple(d for d in DIMENSIONS if d != dimension))
    res = CliRunner().invoke(app, ["plan", "--world", str(world), "--set", f"parallel.{dimension}={world}"])
    assert_one_error_line(res, dimension, f"[model].attention='gqa' does not run with [parallel].{dimension}={world}")


def test_the_declarations_import_without_torch():
    """The config reads the declarations; the modules and the HF mapping they name load only when used."""
    probe = "import sys, pretrain.models; print(sorted(m for m in ('torch', 'pretrain.config') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)
