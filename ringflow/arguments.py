"""Command-line argument helpers shared by ringflow's commands (``ringflow``, ``python -m
ringflow.bench.dcp``): a parser whose mistakes are one line, and integer types with a floor."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and exit status 2."""

    def error(self, message: str) -> None:  # argparse would print the whole usage too
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def at_least(lowest: int):
    """An argparse type: an integer >= ``lowest``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {text!r}") \
                from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {value}")
        return value
    return parse


positive = at_least(1)
non_negative = at_least(0)
