"""The command line starts without what only training and checkpoints need: `pretrain --help`, `plan`,
`verify` and the launcher of `train` import neither torch.distributed.checkpoint nor FSDP2 (sympy with
them, seconds of CPU per process); the ranks import them where they are used."""

import subprocess
import sys


def test_the_cli_imports_no_checkpoint_or_fsdp2_machinery():
    probe = ("import sys, pretrain.cli; heavy = ('sympy', 'torch.distributed.checkpoint', 'torch.distributed.fsdp', "
             "'torch.distributed.tensor'); print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_par_zero_names_resolve_to_their_objects():
    """par_zero's names are imported on first use; ``data_parallel`` is the function, not its module."""
    import inspect

    import par_zero

    for name in par_zero.__all__:
        assert not inspect.ismodule(getattr(par_zero, name)), name
    assert callable(par_zero.data_parallel) and par_zero.data_parallel.__name__ == "data_parallel"
