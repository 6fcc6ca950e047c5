"""`rlfeed status`: ask a running sidecar for its health and progress.

    rlfeed status                          # $RLFEED_ADDRESS, else 127.0.0.1:50051
    rlfeed status --address host:7000 --json

Shows health (grpc.health.v1), the next step, the gRPC front-ends serving (more than one
with `rlfeed serve --replicas`), buffered rollouts and bytes, tasks inside and outside the
pass-rate filter, steps still waiting for ranks, and the counters. Exits 1 with
a clear message when nothing answers at the address or the TLS handshake fails (naming
what to check: RLFEED_TLS_CA, RLFEED_TLS_SERVER_NAME, a client certificate, the sidecar's
TLS); 2 when the client's own TLS or token settings cannot be read. `--json` is strict
JSON: a figure that is not finite (a trainer's NaN) is null.
"""

from __future__ import annotations

import argparse
import sys

from rlfeed.service.cli.argtypes import (
    ADDRESS_HELP,
    default_address,
    positive_float,
    sidecar_address,
    strict_json,
    unreachable,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", type=sidecar_address, default=default_address(), help=ADDRESS_HELP
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (non-finite figures: null)"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=3.0, help="seconds to wait for an answer (3)"
    )


def message_to_plain(message) -> dict:
    """Every field of a protobuf message as plain JSON-able values (64-bit ints stay ints,
    unlike protobuf's JSON mapping, which writes them as strings; unset messages and unset
    `optional` scalars -> None)."""
    plain = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.is_repeated:
            plain[field.name] = [message_to_plain(item) for item in value]
        elif field.message_type is not None:
            plain[field.name] = message_to_plain(value) if message.HasField(field.name) else None
        elif field.is_repeated:
            plain[field.name] = list(value)
        elif field.has_presence and not message.HasField(field.name):
            plain[field.name] = None  # an `optional` left unset: not measured, not 0
        else:
            plain[field.name] = value
    return plain


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def status_text(address: str, health: str, status) -> str:
    """What `rlfeed status` prints for a `StatusResponse`."""
    counters = status.counters
    lines = [
        f"rlfeed sidecar at {address}: {health} (rlfeed {status.version})",
        f"  next step        {status.next_step}  (world size {status.world_size}, "
        f"{status.prompts_per_step} groups x {status.group_size} rollouts per step, "
        f"token budget {status.token_budget})",
        f"  front-ends       {status.front_ends}",
        *(
            f"    {f.slot or f.id:<14} {f.address:<21} {f.state:<12} node {f.node_id[:12]}"
            for f in status.front_end_list
        ),
        f"  buffered         {status.buffered_rollouts} rollouts, {_mib(status.buffered_bytes)} "
        f"({status.open_groups} open groups, {status.complete_groups} complete)",
        f"  memory held      {_mib(status.held_bytes)} of max_buffered_bytes "
        f"{_mib(status.max_buffered_bytes)} (batches buffered rollouts read, unfetched steps)",
        f"  tasks            {status.tasks_total}: {status.tasks_inside_filter} inside the "
        f"filter, {status.tasks_outside_filter} outside",
        f"  policy version   newest in a rollout {status.newest_policy_version}, trainer "
        + (
            str(status.trainer_policy_version)
            if status.HasField("trainer_policy_version")
            else "none published"
        ),
    ]
    if status.notes_refused:
        lines.append(
            f"  NOTES REFUSED    {status.notes_refused}: a bug in rlfeed (steps may never be "
            "served); see the scheduler actor's log"
        )
    if status.steps_waiting:
        waiting = "; ".join(
            f"step {w.step} for rank{'s' if len(w.ranks_missing) > 1 else ''} "
            f"{','.join(map(str, w.ranks_missing))}"
            for w in status.steps_waiting
        )
        lines.append(f"  steps waiting    {waiting}")
    else:
        lines.append("  steps waiting    none (every assembled step was fetched by every rank)")
    lines.append(
        f"  rollouts         received {counters.rollouts_received}, accepted "
        f"{counters.rollouts_accepted}, duplicate {counters.rollouts_duplicate}, stale "
        f"{counters.rollouts_stale}, expired {counters.rollouts_expired}, trained "
        f"{counters.rollouts_trained}; rejected batches "
        f"{counters.batches_rejected}"
    )
    lines.append(
        f"  zero advantage   {counters.zero_advantage_groups} groups "
        f"({counters.zero_advantage_rollouts_dropped} rollouts dropped); rollouts saved by "
        f"the filter {counters.rollouts_saved_by_filter}"
    )
    if status.HasField("last_step"):
        last = status.last_step
        lines.append(
            f"  last step        {last.step}: {last.num_rollouts} rollouts, "
            f"{last.policy_token_count} policy tokens, {last.computed_positions} positions "
            f"computed vs {last.padded_positions} padded, rank imbalance "
            f"{last.rank_imbalance:.3f} in tokens, {last.compute_rank_imbalance:.3f} in "
            f"compute, lockstep {last.lockstep_efficiency:.1%} / "
            f"{last.compute_lockstep_efficiency:.1%}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from rlfeed.client.auth import ChannelSecurity, open_channel
    from rlfeed.client.handshake import Handshake, diagnose
    from rlfeed.client.handshake import message as handshake_message
    from rlfeed.proto import rlfeed_pb2, rlfeed_pb2_grpc

    # Token and TLS material from RLFEED_TOKEN, RLFEED_TLS_CA, ... (an admin token for status).
    try:
        security = ChannelSecurity.resolve()
    except ValueError as exc:  # e.g. RLFEED_TLS_CA names a file that is not there
        print(f"rlfeed status: {exc}", file=sys.stderr)
        return 2
    with open_channel(args.address, security) as channel:
        try:
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout
            )
            status = rlfeed_pb2_grpc.SidecarStatusStub(channel).GetStatus(
                rlfeed_pb2.GetStatusRequest(), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            details = exc.details() or ""
            # One connection attempt: a "Socket closed" at connect counts as a handshake
            # failure here (the clients, which retry, wait to be sure: client/retry.py).
            diagnosis = diagnose(details, Handshake.of(security))
            if exc.code() == grpc.StatusCode.UNAVAILABLE and diagnosis is not None:
                message = handshake_message(args.address, diagnosis, details)
            elif exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                message = unreachable(args.address, details)
            else:
                message = f"{args.address} answered {exc.code().name}: {details}"
            print(f"rlfeed status: {message}", file=sys.stderr)
            return 1
    health = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
    if args.json:
        body = message_to_plain(status)
        print(strict_json({"address": args.address, "health": health, **body}, indent=2))
    else:
        print(status_text(args.address, health, status))
    return 0 if health == "SERVING" else 1
