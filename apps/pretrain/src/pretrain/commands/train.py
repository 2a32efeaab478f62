"""`pretrain train`: placeholder until its issue lands."""

from ..errors import fail


def train() -> None:
    """Not available yet."""
    raise fail("pretrain train is not implemented yet")
