"""What the subcommands share: argparse `type=` converters, the usage error and the default
sidecar address. A bad value is a usage error (exit status 2) that says what was expected,
never a traceback."""

from __future__ import annotations

import argparse
import math

DEFAULT_ADDRESS = "127.0.0.1:50051"  # `rlfeed serve`'s default [server] host and port


class UsageError(Exception):
    """Bad input: reported on stderr, exit status 2 (argparse's convention)."""


def _number(text: str, kind: type, expected: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number > 0")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number >= 0")
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = _number(text, float, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
