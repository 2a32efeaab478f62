"""Every collective in the project's sources goes through par_groups.comm (counted and watched).

A direct ``dist.all_reduce(...)`` (or ``torch.distributed.barrier()``, or a collective imported from
``torch.distributed``) anywhere in ``apps/*/src`` or ``packages/*/src`` outside ``comm.py`` fails
here: CommRecorder would not count it and a hang in it would leave no flight record. torch's
own internals (DCP's save/load, fully_shard's and DTensor's collectives) are not our calls and are
not seen by this scan.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = {ROOT / "packages/par-groups/src/par_groups/comm.py"}  # the counted layer itself
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
    "send_object_list", "recv_object_list",
}


def _is_torch_distributed(node: ast.expr, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (isinstance(node, ast.Attribute) and node.attr in ("distributed", "distributed_c10d")
            and (isinstance(node.value, ast.Name) and node.value.id == "torch" or _is_torch_distributed(node.value, aliases)))


def direct_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of each collective called on torch.distributed (any alias) or imported from it."""
    tree = ast.parse(source)
    aliases, imported = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name.startswith("torch.distributed") and a.asname}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            imported |= {a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES}
            aliases |= {a.asname or a.name for a in node.names if a.name in ("distributed_c10d",)}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and _is_torch_distributed(f.value, aliases):
            found.append((node.lineno, ast.unparse(f)))
        elif isinstance(f, ast.Name) and f.id in imported:
            found.append((node.lineno, f.id))
    return found


def test_the_names_are_torch_collectives():  # a misspelt name would make the scan blind to it
    assert all(callable(getattr(dist, name, None)) for name in COLLECTIVES)


def test_the_scan_sees_each_spelling():
    src = ("import torch\nimport torch.distributed as dist\nimport torch.distributed as td\n"
           "from torch.distributed import barrier as b\nfrom torch import distributed\n"
           "dist.all_reduce(x)\ntorch.distributed.barrier()\ntd.gather_object(o, l)\nb()\n"
           "distributed.broadcast(x, 0)\ndist.get_rank()\ncomm.all_reduce(x, None)\n")
    assert [line for line, _ in direct_calls(src)] == [6, 7, 8, 9, 10]


def test_no_collective_bypasses_par_groups_comm():
    files = sorted(ROOT.glob("apps/*/src/**/*.py")) + sorted(ROOT.glob("packages/*/src/**/*.py"))
    assert len(files) > 50  # the scan found the sources
    bypass = [f"{f.relative_to(ROOT)}:{line}: {call}" for f in files if f not in ALLOWED
              for line, call in direct_calls(f.read_text())]
    assert not bypass, "collectives outside par_groups.comm:\n" + "\n".join(bypass)
