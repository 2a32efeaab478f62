"""One `pretrain train` launcher of a multi-node run, as its own process (a "node" on 127.0.0.1), whose ranks run
``replica_kills.sigkill_at``: ``python node_launcher.py JSON TRAIN_ARGS...``, JSON holding its ``args`` and
``kwargs``. The ranks import ``replica_kills`` by name: this folder must be on PYTHONPATH. Under torchrun (one
per "node") each worker runs it as its script, a rank in this process, its TRAIN_ARGS in JSON's ``train`` (torchrun
would read them as its own options)."""

import functools
import json
import os
import sys

if __name__ == "__main__":  # the forkserver imports this file again as __mp_main__: no second launcher there
    import replica_kills

    import pretrain.training.run
    from pretrain.training.run import run_rank
    from pretrain.cli import app

    spec = json.loads(sys.argv[1])
    kwargs = spec["kwargs"] | {"also": tuple(map(tuple, spec["kwargs"].get("also", ())))}
    pretrain.training.run.run_rank = functools.partial(replica_kills.sigkill_at, *spec["args"], **kwargs)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # the rank runs here: sigkill_at must find the real run_rank again
        original, patched = run_rank, pretrain.training.run.run_rank

        def entry(*run_args):
            pretrain.training.run.run_rank = original
            return patched(*run_args)

        pretrain.training.run.run_rank = entry
    app(["train", *spec.get("train", sys.argv[2:])], prog_name="pretrain")
