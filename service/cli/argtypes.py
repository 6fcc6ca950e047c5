"""What the subcommands share: argparse `type=` converters, the usage error, the sidecar
address (flag > $RLFEED_ADDRESS > 127.0.0.1:50051; one front-end, a list of them or a gRPC
target, as `client/addressing.py` reads it) and what to say when nothing answers
there, and the strict JSON every `--json` prints. A bad value is a usage error (exit
status 2) that says what was expected, never a traceback."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEFAULT_ADDRESS = "127.0.0.1:50051"  # `rlfeed serve`'s default [server] host and port
# The variable the README's producer and trainer read; the client commands read it too.
ADDRESS_ENV = "RLFEED_ADDRESS"
ADDRESS_HELP = (
    f"sidecar HOST:PORT; several front-ends as IP:PORT,IP:PORT,... or one name for them "
    f"all, dns:///NAME:PORT (calls spread round-robin); default: ${ADDRESS_ENV} when set, "
    f"else {DEFAULT_ADDRESS}"
)


def env_address() -> str | None:
    """$RLFEED_ADDRESS, or None when unset or empty."""
    return os.environ.get(ADDRESS_ENV, "").strip() or None


def default_address() -> str:
    """What `--address` means when not given: $RLFEED_ADDRESS, else DEFAULT_ADDRESS."""
    return env_address() or DEFAULT_ADDRESS


def sidecar_address(text: str) -> str:
    """HOST:PORT, a list of front-ends IP:PORT,IP:PORT,... or a gRPC target (dns:///NAME:PORT,
    ipv4:..., unix:/run/rlfeed.sock): what `client.addressing.parse_address` takes, checked
    here so a bad one is a usage error naming the bad entry. Without a port gRPC would
    dial 443, so a missing port is refused."""
    from rlfeed.client.addressing import parse_address  # the standard library only

    try:
        return parse_address(text).address
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def unreachable(address: str, details: str) -> str:
    """The one line for an address where no sidecar answers (gRPC UNAVAILABLE or a missed
    deadline, with its `details`): a host name that does not resolve says so."""
    if "resolv" in details or "Domain name not found" in details:
        return f"cannot resolve the host name of {address} (gRPC: {details})"
    return f"nothing answers at {address} (is `rlfeed serve` running?)"


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def strict_json(value, indent: int | None = None) -> str:
    """RFC 8259 JSON: NaN and infinities (which `json.dumps` writes as the non-JSON tokens
    NaN / Infinity) become null."""
    return json.dumps(_finite_or_none(value), indent=indent, allow_nan=False)


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


class _RenamedFlag(argparse.Action):
    """An old spelling of a store_true flag: sets the new flag's dest and says, on stderr,
    what it is called now. Hidden from --help."""

    def __init__(self, option_strings, dest, *, new_flag: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: {option_string} is now {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, True)


def add_renamed_flag(group, old_flag: str, new_flag: str, dest: str) -> None:
    """Keep accepting `old_flag` (hidden, with a note on stderr) for `new_flag`."""
    group.add_argument(old_flag, dest=dest, action=_RenamedFlag, new_flag=new_flag)
