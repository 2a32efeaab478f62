"""The config files: the shipped ones inside the package and reading a TOML config (shared by the
config itself and ``[model].flavor``, which starts from a shipped config's model section)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

try:
    import tomllib as tomli
except ImportError:  # Python < 3.11
    import tomli

from ..errors import UsageError
from ..models import FOLDERS

DEFAULT_CONFIG = "tiny.toml"


def _shipped() -> dict[str, tuple[str, object]]:
    """Every shipped config by file name, with its folder: ``configs/`` and each family's ``models/<family>/configs/``."""
    found: dict[str, tuple[str, object]] = {}
    for where in ["configs", *(f"models/{folder}/configs" for folder in FOLDERS)]:
        folder = resources.files("pretrain").joinpath(*where.split("/"))
        for ref in sorted(folder.iterdir() if folder.is_dir() else (), key=lambda r: r.name):
            if ref.name.endswith(".toml"):
                if ref.name in found:
                    raise UsageError(f"shipped config {ref.name} is in both pretrain/{found[ref.name][0]}/ and "
                                     f"pretrain/{where}/: shipped config names must be unique; rename one")
                found[ref.name] = (where, ref)
    return found


def builtin_config_path(name: str):
    """A config shipped inside the package (``tiny.toml``, ``tiny-moe.toml``, ``llama3-8b.toml`` ...)."""
    return _shipped()[name][1]


def builtin_configs() -> list[str]:
    return sorted(_shipped())


MAX_CONFIG_BYTES = 4 << 20  # far above any real config; a larger file is not one (and would take long to parse)


def read_toml(path: str | None) -> tuple[dict, str]:
    """The parsed TOML of ``path`` (None = the embedded default; a bare shipped name also works)."""
    if path is None:
        ref, source = builtin_config_path(DEFAULT_CONFIG), f"<builtin>/{DEFAULT_CONFIG}"
    elif not Path(path).exists() and path in builtin_configs() + [n[:-5] for n in builtin_configs()]:
        name = path if path.endswith(".toml") else path + ".toml"
        ref, source = builtin_config_path(name), f"<builtin>/{name}"
    else:
        ref, source = Path(path), path
        if not ref.is_file():
            raise UsageError(f"config file {path!r} does not exist; shipped configs: {', '.join(builtin_configs())}")
        if ref.stat().st_size > MAX_CONFIG_BYTES:
            raise UsageError(f"config {source} is {ref.stat().st_size:,} bytes, more than a config's "
                             f"{MAX_CONFIG_BYTES:,}: give the run's TOML config")
    try:
        return tomli.loads(ref.read_text()), source
    except tomli.TOMLDecodeError as e:
        raise UsageError(f"config {source} is not valid TOML: {e}") from None
    except RecursionError:
        raise UsageError(f"config {source} is nested too deeply to read") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read config {source}: {e}") from None
