"""`pretrain plan`: placeholder until its issue lands."""

from ..errors import fail


def plan() -> None:
    """Not available yet."""
    raise fail("pretrain plan is not implemented yet")
