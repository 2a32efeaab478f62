"""`python -m pretrain ...` (what torchrun runs on a cluster) is the `pretrain` command."""

from .cli import main

main()
