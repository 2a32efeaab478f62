"""Which checkpoints a run owns, and which it may delete.

A run's checkpoint directory holds ``manifest.json``: ``{"run_id": ..., "saves": ["step_10", ...]}``,
the names this run published, in the order it saved them. Retention keeps the last ``keep`` saves
*by that order* (a re-run that saves step_10 after an older step_40 keeps step_10), and deletes
only a ``step_<int>`` directory that is in the manifest and whose ``trainer_state.json`` carries the
run's id: a user's ``step_5_backup/`` or ``step_best/`` is never touched. ``latest`` is replaced
only after the new checkpoint is complete and before anything is deleted. The deleting itself
(:func:`prune_in_background`) runs on rank 0 in a thread started after the save's final barrier: no
rank waits for it (on a parallel file system an ``rmtree`` can take minutes); the next save, and
the end of the run, wait for it (:func:`wait_pruned`) before touching the manifest again.

A new run (no resume) refuses a directory that holds another run's checkpoints unless forced.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import uuid
from pathlib import Path

from ..runtime import safe_files
from ..runtime.strict_json import loads
from ..errors import UsageError, shown
from .state_file import check_state

MANIFEST = "manifest.json"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
FORMAT = "pretrain-checkpoint-v1"  # trainer_state.json's "format"
STEP_DIR = re.compile(r"step_\d+")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a new temporary sibling, fsync, then rename over ``path`` (never through a symlink)."""
    safe_files.write_atomic(path, text)


def read_manifest(root: Path) -> dict | None:
    try:
        manifest = loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(f"{root / MANIFEST} is unreadable ({e}); move it away to start a new run there") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("run_id"), str) \
            or not isinstance(manifest.get("saves"), list):
        raise UsageError(f"{root / MANIFEST} is not a pretrain checkpoint manifest; move it away")
    for name in manifest["saves"]:  # names we delete: each must be a step_N directly inside root
        if not (isinstance(name, str) and STEP_DIR.fullmatch(name)):
            raise UsageError(f"{root / MANIFEST} lists {shown(name)}, not a step_<N> checkpoint inside {root}; "
                             f"move it away")
    return manifest


def inside(root: Path, name: str, what: str) -> Path:
    """``root / name`` for a name read from a file, refused unless it is one entry inside ``root``."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UsageError(f"{what} names {shown(name)}, which is not a checkpoint inside {root}; move it away")
    return root / name


def foreign_checkpoints(root: Path) -> list[str]:
    """Names in ``root`` that belong to some run's checkpoints (manifest, latest, complete step_N)."""
    if not root.is_dir():
        return []
    found = [LATEST] if (root / LATEST).exists() else []
    found += [MANIFEST] if (read_manifest(root) or {}).get("saves") else []
    found += sorted(p.name for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / STATE_FILE).is_file())
    return found


def start_run(root: Path, resuming: bool, force: bool) -> str:
    """Claim ``root`` for this run (rank 0, before training); returns the run id.

    Resuming continues the manifest's run; a new run refuses a directory holding another run's
    checkpoints unless ``force`` (their files stay, but this run's retention never deletes them)."""
    manifest = read_manifest(root)
    if resuming and manifest is not None:
        return manifest["run_id"]
    if not resuming and not force:
        check_unclaimed(root)
    run_id = uuid.uuid4().hex[:12]
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / MANIFEST, json.dumps({"run_id": run_id, "saves": []}) + "\n")
    return run_id


def check_unclaimed(root: Path) -> None:
    """UsageError when ``root`` already holds checkpoints (a new run would mix with them)."""
    found = foreign_checkpoints(root)
    if found:
        raise UsageError(f"{root} holds another run's checkpoints ({', '.join(found[:3])}); resume it with --set "
                         f"checkpoint.resume=true, choose another --set log.dir / checkpoint.dir, or pass --force")


def run_id_of(root: Path) -> str:
    """The id of the run that owns ``root``; a manifest is started if there is none (direct saves)."""
    manifest = read_manifest(root)
    if manifest is None:
        manifest = {"run_id": uuid.uuid4().hex[:12], "saves": []}
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(root / MANIFEST, json.dumps(manifest) + "\n")
    return manifest["run_id"]


def publish(root: Path, final: Path, keep: int) -> list[str]:
    """Rank 0, once ``final`` is complete: record it, point ``latest`` at it; returns the saves to
    prune, by save order (:func:`prune` deletes them, :func:`prune_in_background` off this thread)."""
    wait_pruned()  # the previous save's pruning writes the manifest too
    manifest = read_manifest(root) or {"run_id": run_id_of(root), "saves": []}
    saves = [s for s in manifest["saves"] if s != final.name] + [final.name]
    manifest["saves"] = saves
    write_atomic(root / MANIFEST, json.dumps(manifest) + "\n")
    write_atomic(root / LATEST, final.name + "\n")
    return saves[:-keep]


def prune(root: Path, names: list[str]) -> None:
    """Delete the saves ``names`` this run owns (``publish``'s answer), then drop what is gone from the manifest."""
    manifest = read_manifest(root)
    if manifest is None or not names:
        return
    for name in names:
        if name in manifest["saves"] and _owned(root / name, manifest["run_id"]):
            shutil.rmtree(root / name, ignore_errors=True)
    manifest["saves"] = [s for s in manifest["saves"] if (root / s).is_dir()]
    write_atomic(root / MANIFEST, json.dumps(manifest) + "\n")


_pruning: dict = {"thread": None, "error": None}  # rank 0's one pruning in flight, and its failure


def prune_in_background(root: Path, names: list[str]) -> None:
    """:func:`prune` in a thread (rank 0, after the save's final barrier); one at a time."""
    wait_pruned()
    if not names:
        return

    def run() -> None:
        try:
            prune(root, names)
        except BaseException as e:  # noqa: BLE001 -- raised by the next wait_pruned
            _pruning["error"] = e

    # not a daemon: an interpreter that exits mid-prune waits for it rather than leaving half a directory
    _pruning["thread"] = threading.Thread(target=run, name="checkpoint-prune")
    _pruning["thread"].start()


def wait_pruned() -> None:
    """Wait for the pruning in flight, if any; its error, if it failed, is raised here."""
    thread, _pruning["thread"] = _pruning["thread"], None
    if thread is not None:
        thread.join()
    error, _pruning["error"] = _pruning["error"], None
    if error is not None:
        raise error


def _owned(path: Path, run_id: str) -> bool:
    if not STEP_DIR.fullmatch(path.name) or not path.is_dir():
        return False
    try:
        return loads((path / STATE_FILE).read_text()).get("run_id") == run_id
    except (OSError, ValueError, AttributeError):
        return False


def read_state(path: Path) -> dict:
    """The checkpoint's ``trainer_state.json``, every field it may hold checked (:mod:`.state_file`)."""
    try:
        state = loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"checkpoint {path}: cannot read {STATE_FILE}: {e}") from None
    found = state.get("format") if isinstance(state, dict) else f"a JSON {type(state).__name__}"
    if found != FORMAT:
        raise UsageError(f"checkpoint {path}: {STATE_FILE} has format {shown(found)}, not {FORMAT!r}")
    return check_state(f"checkpoint {path}: {STATE_FILE}", state)
