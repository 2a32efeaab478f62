"""certify's output directory (``--out``), owned as ``pretrain train`` owns a run directory.

certify writes its report, the reference's record and the reference's checkpoints
(``<out>/checkpoints``, saved and pruned as a run's are). So, before anything is written:

- ``--out`` must be a writable directory (a file, a path through a file or a read-only mount is
  one line, exit 2);
- the launcher holds the run lock (:mod:`pretrain.runtime.run_lock`) of ``<out>`` and of its
  checkpoint directory while certify runs: a live run there, or a second certify, is refused;
- neither may hold another run's checkpoints (a manifest, ``latest``, a complete ``step_N``):
  certify would take that run's id as its own, replace its ``step_N``, prune its other saves and
  point ``latest`` at the narrowed model. Its own earlier output is recognised by the run id it
  gives its checkpoint directory (``certify-...``), and reused.
"""

from __future__ import annotations

import json
import uuid
from contextlib import contextmanager
from pathlib import Path

from ..checkpoint.retention import MANIFEST, foreign_checkpoints, read_manifest, write_atomic
from ..errors import UsageError
from ..training.preflight import check_writable
from ..runtime.run_lock import run_lock
from .ranks import CHECKPOINTS

RUN_ID_PREFIX = "certify-"


def _refuse_foreign(root: Path, what: str) -> None:
    manifest = read_manifest(root)  # unreadable or not ours: one line
    if manifest is not None and manifest["run_id"].startswith(RUN_ID_PREFIX):
        return
    found = foreign_checkpoints(root)
    if manifest is not None and MANIFEST not in found:  # a run that has not saved yet: its id is its own too
        found.append(MANIFEST)
    if found:
        raise UsageError(f"--out {what} {root} holds another run's checkpoints ({', '.join(found[:3])}); certify "
                         f"would overwrite and prune them: choose another --out (default <log.dir>/certify)")


@contextmanager
def owned(work: Path):
    """Hold ``work`` and its checkpoint directory for this certify (see the module doc)."""
    check_writable(work, "--out")
    ck = work / CHECKPOINTS
    if ck.is_symlink() or (ck.exists() and not ck.is_dir()):
        raise UsageError(f"--out: {ck} is not a directory (certify keeps the reference's checkpoints there); "
                         f"move it away or choose another --out")
    with run_lock(work):  # a live run in ``work`` is named before anything is created in it
        _refuse_foreign(work, "directory")
        _refuse_foreign(ck, "checkpoint directory")
        with run_lock(ck):
            if read_manifest(ck) is None:
                write_atomic(ck / MANIFEST, json.dumps({"run_id": RUN_ID_PREFIX + uuid.uuid4().hex[:12],
                                                        "saves": []}) + "\n")
            yield
