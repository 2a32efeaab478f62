"""`pretrain prepare`: placeholder until its issue lands."""

from ..errors import fail


def prepare() -> None:
    """Not available yet."""
    raise fail("pretrain prepare is not implemented yet")
