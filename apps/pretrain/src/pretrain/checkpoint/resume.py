"""Resuming a run: the checkpoint ``latest`` names, or, when asked, the newest intact one.

``[checkpoint].fallback = true``: when ``latest`` names a checkpoint that is missing or damaged
(:class:`~.integrity.DamagedCheckpoint`), the run's other checkpoints are tried newest first (the
manifest's save order, then any other ``step_N`` by step) and the note says which was taken and why.
Every rank sees the same files and the same DCP failures, so all ranks take the same one. Any other
error (a config that does not match the checkpoint) is not damage and never falls back.
"""

from __future__ import annotations

from pathlib import Path

from .integrity import CHECKSUMS, DamagedCheckpoint
from .retention import STATE_FILE, STEP_DIR, read_manifest
from .store import latest_checkpoint, load_checkpoint
from .subject import Checkpointed


def resume_latest(into: Checkpointed, root: Path, fallback: bool) -> tuple[Path | None, int, str]:
    """Load the run's latest checkpoint into ``into``: (its path or None, the step to continue from, a note)."""
    try:
        latest = latest_checkpoint(root)
        if latest is None:
            return None, 0, ""
        return latest, load_checkpoint(into, latest), unverified_note(latest)
    except DamagedCheckpoint as e:
        if not fallback:
            raise with_fallback_hint(e) from None
        first = e
    tried = []
    for path in _newest_first(root):
        try:
            step = load_checkpoint(into, path)
        except DamagedCheckpoint:
            tried.append(path.name)
            continue
        return path, step, f" ([checkpoint].fallback: took {path.name}, the newest intact one, because {first})" \
            + unverified_note(path)
    also = f" (nor is {', '.join(tried)})" if tried else ""
    raise DamagedCheckpoint(f"{first}; no intact checkpoint in {root} to fall back to{also}") from None


def with_fallback_hint(error: DamagedCheckpoint) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{error}; check it with `pretrain verify`, or set [checkpoint].fallback = true to "
                             f"resume from the newest intact checkpoint")


def _newest_first(root: Path) -> list[Path]:
    """The run's complete checkpoints but the one ``latest`` names: by save order, then other step_N by step."""
    marker = root / "latest"
    named = marker.read_text().strip() if marker.is_file() else None
    saved = list(reversed((read_manifest(root) or {}).get("saves", [])))
    others = sorted((p.name for p in root.iterdir() if STEP_DIR.fullmatch(p.name)), key=lambda n: -int(n[5:]))
    names = dict.fromkeys(n for n in saved + others if n != named and STEP_DIR.fullmatch(n))
    return [root / n for n in names if (root / n / STATE_FILE).is_file()]


def unverified_note(path: Path) -> str:
    """A note for a checkpoint without checksums (written before they existed): it loads, unverified."""
    if (Path(path) / CHECKSUMS).is_file():
        return ""
    return f" ({Path(path).name} has no {CHECKSUMS}: written before checkpoints carried checksums, loaded unverified)"
