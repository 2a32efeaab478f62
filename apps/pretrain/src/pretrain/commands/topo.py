"""`pretrain topo`: placeholder until its issue lands."""

from ..errors import fail


def topo() -> None:
    """Not available yet."""
    raise fail("pretrain topo is not implemented yet")
