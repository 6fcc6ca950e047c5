"""`rlfeed demo`: a small Hugging Face policy learning through the sidecar.

    rlfeed demo                          # embedded local Ray + sidecar, 2 producer processes
                                         # sampling the policy, 2 trainer ranks training it
    rlfeed demo --summary-json out.json  # also the summary and per-step figures as JSON
    rlfeed demo --train-tasks 20         # the chapter's 20 training tasks (default 200)
    rlfeed demo --synthetic              # the synthetic fleet instead (load, fake learning)
    rlfeed demo --address HOST:PORT      # drive a running sidecar with the synthetic fleet
    RLFEED_ADDRESS=HOST:PORT rlfeed demo # the same (--address wins; empty: start one)
    rlfeed demo --steps 50 --metrics-port 9400   # watch it in Grafana (deploy/grafana)

Prints one line per step (training reward, every few steps the held-out pass rate), then a
summary (padding share, zero-advantage share, rollouts saved by the filter, predicted
GPU-hours; for the policy also the held-out pass rate before -> after, the step-0 ratio
check and where a step's time goes). Exit status 0 when every step trained, 1 when nothing
answers at the address or a part failed, 130 / 143 on Ctrl-C / SIGTERM (after stopping
what it started).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from rlfeed.service.cli.argtypes import ADDRESS_ENV, env_address, sidecar_address, unreachable

DEFAULT_STEPS = 60  # the policy: enough for the held-out pass rate to move
DEFAULT_SYNTHETIC_STEPS = 4


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
        "--steps",
        type=int,
        default=None,
        help=f"steps to train (default {DEFAULT_STEPS}; {DEFAULT_SYNTHETIC_STEPS} with the "
        "synthetic fleet)",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="run the synthetic fleet (load generation, fake learning) instead of the "
        "policy; implied by --address",
    )
    parser.add_argument(
        "--train-tasks",
        type=int,
        default=None,
        metavar="N",
        help="training tasks of the policy's gym, 1-200 (default 200; the chapter's setting is 20)",
    )
    parser.add_argument(
        "--summary-json",
        metavar="PATH",
        help="also write the summary and the per-step figures there as JSON",
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
    synthetic = args.synthetic or bool(args.address)
    if args.steps is None:
        args.steps = DEFAULT_SYNTHETIC_STEPS if synthetic else DEFAULT_STEPS
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
    if args.train_tasks is not None and (synthetic or not 1 <= args.train_tasks <= 200):
        print(
            "rlfeed demo: --train-tasks must be in [1, 200], and only with the policy (not "
            "with --synthetic or --address)",
            file=sys.stderr,
        )
        return 2
    if not synthetic and importlib.util.find_spec("transformers") is None:
        print(
            "rlfeed demo: the policy is a Hugging Face model: pip install 'rlfeed[demo]' "
            "(or run the synthetic fleet: rlfeed demo --synthetic)",
            file=sys.stderr,
        )
        return 1
    from rlfeed.client.transport import SidecarError, TLSHandshakeError
    from rlfeed.service.demo import run as demo_run

    try:
        return demo_run.run_demo(
            address=args.address,
            steps=args.steps,
            config_path=args.config,
            seed=args.seed,
            metrics_port=args.metrics_port,
            synthetic=synthetic,
            train_tasks=args.train_tasks,
            summary_json=args.summary_json,
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
