"""Byte and count arithmetic every room shares (no torch): MiB, ceiling division."""

from __future__ import annotations

MIB = 1 << 20


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (tensors too: ``-(-a // b)`` works on both)."""
    return -(-a // b)


def mib(nbytes: float) -> str:
    """``nbytes`` as a log line states it: ``'436.00 MiB'``."""
    return f"{nbytes / MIB:.2f} MiB"
