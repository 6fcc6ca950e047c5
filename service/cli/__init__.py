"""The `rlfeed` command line: a thin dispatcher.

Each subcommand lives in `rlfeed.service.cli.<name>` and exposes
`add_arguments(parser)` and `run(args) -> int`. Command modules import only the standard
library at module level, so `rlfeed --help` answers instantly; numpy, torch, Ray and gRPC
are imported inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys

from rlfeed import __version__
from rlfeed.service.interrupts import EXIT_STATUS, Terminated, stop_signals_raise

# name -> one-line help. Order is the order shown by `rlfeed --help`.
COMMANDS: dict[str, str] = {
    "plan": "plan token-budgeted, rank-balanced microbatches for a file of sequence lengths",
    "estimate": "throughput and GPU-hour arithmetic for a model, a GPU and an episode shape",
    "serve": "run the sidecar: gRPC server + Ray-hosted scheduler (+ metrics)",
    "demo": "run the sidecar with a synthetic inference fleet and two trainer ranks",
    "status": "ask a running sidecar for its health and progress",
    "health": "one gRPC health check, no token needed (exit 0 while SERVING): for probes",
    "layout": "render the padded vs packed layout of a served step as a PNG",
}


# A module only an extra brings -> that extra: `pip install rlfeed` is the producer's core
# (no Ray, no torch), so a command that needs more says which extra, in one line.
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(
        ("ray", "grpc_health", "grpc_reflection", "prometheus_client", "msgpack", "crc32c",
         "tomli"),
        "serve",
    ),
    "torch": "train",
    "matplotlib": "plot",
    "transformers": "demo",
}  # fmt: skip
EXTRA_OF_COMMAND: dict[str, str] = {"demo": "all"}  # it runs a sidecar and trainer ranks


def _missing_extra(command: str, error: ModuleNotFoundError) -> str | None:
    """The one line for a module an extra brings (naming every module of that extra this
    install lacks), None for any other missing module."""
    extra = EXTRA_OF_MODULE.get((error.name or "").partition(".")[0])
    if extra is None:
        return None
    missing = sorted(
        name
        for name, of in EXTRA_OF_MODULE.items()
        if of == extra and name != "tomli" and importlib.util.find_spec(name) is None
    )
    extra = EXTRA_OF_COMMAND.get(command, extra)
    return (
        f"rlfeed {command}: this install lacks {', '.join(missing) or error.name}: "
        f"pip install 'rlfeed[{extra}]'"
    )


def _command_module(name: str):
    return importlib.import_module(f"rlfeed.service.cli.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlfeed",
        description="rlfeed: packed, token-budgeted, rank-balanced RL training batches.",
    )
    parser.add_argument("--version", action="version", version=f"rlfeed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        module = _command_module(name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; Ctrl-C and SIGTERM end it with one line on stderr and exit status
    130 / 143 once its cleanup (`finally` blocks) has run. `rlfeed serve` installs its own
    handlers: for it a signal is the normal way to stop, answered with exit status 0."""
    args = build_parser().parse_args(argv)
    # Each command reports a failure in its own one line; gRPC's C core would otherwise
    # write INFO notes of its own first (a failed TLS handshake). GRPC_VERBOSITY=debug, or
    # any value set, still wins. Before `import grpc`, which reads it once.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        with stop_signals_raise():
            return int(args._run(args) or 0)
    except BrokenPipeError:
        # `rlfeed plan --json | head` closed our stdout: not an error of ours.
        sys.stderr.close()
        return 0
    except ModuleNotFoundError as exc:
        message = _missing_extra(args.command, exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rlfeed {args.command}: interrupted", file=sys.stderr)
        return EXIT_STATUS[signal.SIGINT]
    except Terminated:
        pass
    except SystemExit as exc:
        # Ray's own SIGTERM handler, in force while `ray.init` runs, exits this way.
        if exc.code != signal.SIGTERM:
            raise
    print(f"rlfeed {args.command}: terminated (SIGTERM)", file=sys.stderr)
    return EXIT_STATUS[signal.SIGTERM]


if __name__ == "__main__":
    sys.exit(main())
