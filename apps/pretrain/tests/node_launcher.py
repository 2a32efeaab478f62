"""One `pretrain train` launcher of a multi-node run, as its own process (a "node" on 127.0.0.1), whose ranks run
``replica_kills.sigkill_at``: ``python node_launcher.py JSON TRAIN_ARGS...``, JSON holding its ``args`` and
``kwargs``. The ranks import ``replica_kills`` by name: this folder must be on PYTHONPATH."""

import functools
import json
import sys

if __name__ == "__main__":  # the forkserver imports this file again as __mp_main__: no second launcher there
    import replica_kills

    import pretrain.training.run
    from pretrain.cli import app

    spec = json.loads(sys.argv[1])
    kwargs = spec["kwargs"] | {"also": tuple(map(tuple, spec["kwargs"].get("also", ())))}
    pretrain.training.run.run_rank = functools.partial(replica_kills.sigkill_at, *spec["args"], **kwargs)
    app(["train", *sys.argv[2:]], prog_name="pretrain")
