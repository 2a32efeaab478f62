"""What ``trainer_state.json`` may hold: every field a load, a resume, ``verify`` or an export reads
back, checked once where the file is read (:func:`.retention.read_state`). A hand-edited value of the
wrong type, out of range, NaN or nested garbage is one line naming the field, never a traceback later."""

from __future__ import annotations

import math

from ..errors import UsageError, shown

MAX_COUNT = 2**62  # steps and optimizer steps: any real run is far below
MAX_SIZE = 2**31  # ranks, parallel sizes, vocabularies, expert slots


def _int(lo: int, hi: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _table_of(check):
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())


def _of_type(kind):
    return lambda v: isinstance(v, kind)


def _placed_layer(v) -> bool:
    return isinstance(v, dict) and _list_of(_int(0, MAX_SIZE))(v.get("expert_at")) and _list_of(_number)(v.get("load"))


def _expert_placement(v) -> bool:
    layers = v.get("layers") if isinstance(v, dict) else None
    return (isinstance(v, dict) and _int(1, MAX_SIZE)(v.get("ep"))
            and (_table_of(_placed_layer)(layers) or _list_of(_placed_layer)(layers)))


# field: (check, what it must be); "step" and "config" are required
FIELDS = {
    "step": (_int(0, MAX_COUNT), "an integer from 0 to 2**62"),
    "config": (_table_of(_of_type(dict)), "a table of config sections"),
    "optimizer_steps": (_int(0, MAX_COUNT), "an integer from 0 to 2**62"),
    "world_size": (_int(1, MAX_SIZE), "a positive integer"),
    "layout": (_table_of(_int(0, MAX_SIZE)), "a table of sizes (integers >= 0)"),
    "zero": (_of_type(str), "a string"),
    "optimizer": (_of_type(bool), "true or false"),
    "optimizer_name": (_of_type(str), "a string"),
    "optimizer_kinds": (_list_of(_of_type(str)), "a list of strings"),
    "optimizer_scalars": (_table_of(_number), "a table of finite numbers"),
    "expert_placement": (_expert_placement, "a table {ep, layers} of each layer's expert_at and load"),
    "run_id": (_of_type(str), "a string"),
    "source": (_of_type(str), "a string"),
    "tokenizer": (_of_type(str), "a string"),
    "tokenizer_vocab": (_int(1, MAX_SIZE), "a positive integer"),
}
REQUIRED = ("step", "config")


def check_state(where: str, state: dict) -> dict:
    """``state`` (a parsed trainer_state.json, ``where``: the file, for the message), or a UsageError naming
    the first field that is missing or not what a save writes."""
    for key in REQUIRED:
        if key not in state:
            raise UsageError(f"{where} has no {key!r} ({FIELDS[key][1]}); it is not a checkpoint's state as "
                             f"saved: restore it, or use another checkpoint")
    for key, (check, want) in FIELDS.items():
        if key in state and not check(state[key]):
            raise UsageError(f"{where} has {key} = {shown(state[key])}, which must be {want}; it is not a "
                             f"checkpoint's state as saved: restore it, or use another checkpoint")
    return state
