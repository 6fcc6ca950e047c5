"""`rlfeed demo`: the sidecar with a synthetic inference fleet and two trainer ranks.

    rlfeed demo                          # embedded local Ray + sidecar, fleet, 2 trainer ranks
    rlfeed demo --steps 20 --config FILE # a longer run with your sidecar config
    rlfeed demo --address HOST:PORT      # drive a running sidecar (smoke test, load generator)
    RLFEED_ADDRESS=HOST:PORT rlfeed demo # the same (--address wins; empty: start one)
    rlfeed demo --steps 50 --metrics-port 9400   # watch it in Grafana (deploy/grafana)

Prints one line per step, then a summary (padding share, zero-advantage share, rollouts
saved by the filter, predicted GPU-hours). Exit status 0 when every step trained, 1 when
nothing answers at the address or a part failed, 130 / 143 on Ctrl-C / SIGTERM (after
stopping what it started).
"""

from __future__ import annotations

import argparse
import sys

from rlfeed.service.cli.argtypes import ADDRESS_ENV, env_address, sidecar_address, unreachable

DEFAULT_STEPS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        type=sidecar_address,
        default=env_address(),
        help=f"drive a running sidecar at HOST:PORT (several front-ends: IP:PORT,IP:PORT,... "
        f"or dns:///NAME:PORT) instead of starting one (default: ${ADDRESS_ENV} when set "
        f"and not empty, else start one)",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"steps to train (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--config",
        help="sidecar TOML config (demo defaults otherwise; with --address only its "
        "[accounting] section is used)",
    )
    parser.add_argument("--seed", type=int, default=0, help="fleet and model seed (default 0)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the embedded sidecar's Prometheus metrics on this port (default: the "
        "config's [server] metrics_port, 0 = none); not with --address",
    )


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print("rlfeed demo: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        print("rlfeed demo: --metrics-port must be in [0, 65535]", file=sys.stderr)
        return 2
    if args.metrics_port and args.address:
        print(
            "rlfeed demo: --metrics-port serves an embedded sidecar's metrics; a running "
            "sidecar serves its own ([server] metrics_port)",
            file=sys.stderr,
        )
        return 2
    from rlfeed.client.transport import SidecarError, TLSHandshakeError
    from rlfeed.service.demo import run as demo_run

    try:
        return demo_run.run_demo(
            address=args.address,
            steps=args.steps,
            config_path=args.config,
            seed=args.seed,
            metrics_port=args.metrics_port,
        )
    except SidecarError as exc:  # the trainers' and the fleet's own failures are theirs
        where = args.address or "the embedded sidecar"
        if isinstance(exc, TLSHandshakeError):
            print(f"rlfeed demo: {exc.message}", file=sys.stderr)
        elif exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            print(f"rlfeed demo: {unreachable(where, exc.message)}", file=sys.stderr)
        else:
            print(f"rlfeed demo: {where} answered {exc}", file=sys.stderr)
        return 1
