"""`pretrain schedule`: placeholder until its issue lands."""

from ..errors import fail


def schedule() -> None:
    """Not available yet."""
    raise fail("pretrain schedule is not implemented yet")
