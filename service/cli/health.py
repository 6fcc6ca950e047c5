"""`rlfeed health`: the probe for orchestrators (the compose healthcheck, a Kubernetes
readiness probe), one gRPC health check and nothing else.

    rlfeed health                                   # $RLFEED_ADDRESS, else 127.0.0.1:50051
    rlfeed health --address 127.0.0.1:50051 --timeout 3

It asks only `grpc.health.v1.Health/Check`, which the sidecar leaves open when `[security]
auth_token_file` is on (probes carry no token), so it needs no token where `rlfeed status`
needs an admin one. With TLS on the port it reads RLFEED_TLS_CA, RLFEED_TLS_SERVER_NAME (and
RLFEED_TLS_CERT / RLFEED_TLS_KEY for mutual TLS) like every client command. Prints one
line; exit status 0 while SERVING, 1 otherwise (NOT_SERVING, nothing answers, no answer
within --timeout seconds), 2 for bad arguments or unreadable TLS files.
"""

from __future__ import annotations

import argparse
import sys

from rlfeed.service.cli.argtypes import (
    ADDRESS_HELP,
    default_address,
    positive_float,
    sidecar_address,
    unreachable,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", type=sidecar_address, default=default_address(), help=ADDRESS_HELP
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=3.0,
        help="seconds to wait for the answer, connecting included (3)",
    )


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from rlfeed.client.auth import ChannelSecurity, open_channel

    try:
        channel = open_channel(args.address, ChannelSecurity.resolve())
    except ValueError as exc:  # an unreadable RLFEED_TLS_* file, TLS without a server name
        print(f"rlfeed health: {exc}", file=sys.stderr)
        return 2
    with channel:
        try:
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                message = unreachable(args.address, exc.details() or "")
            else:
                message = f"{args.address} answered {exc.code().name}: {exc.details()}"
            print(f"rlfeed health: {message}", file=sys.stderr)
            return 1
    health = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
    print(f"rlfeed sidecar at {args.address}: {health}")
    return 0 if health == "SERVING" else 1
