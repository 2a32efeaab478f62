"""`pretrain convert`: placeholder until its issue lands."""

from ..errors import fail


def convert() -> None:
    """Not available yet."""
    raise fail("pretrain convert is not implemented yet")
