"""`rlfeed serve`: run the sidecar (gRPC server + Ray-hosted scheduler) until stopped.

    rlfeed serve                                  # defaults, embedded local Ray, port 50051
    rlfeed serve --config deploy/rlfeed.example.toml --port 0
    rlfeed serve --ray-address auto               # join the Ray cluster of this machine
    RAY_ADDRESS=head:6379 rlfeed serve            # join that cluster (--ray-address wins)
    rlfeed serve --metrics-port 9400 --replicas 4 # metrics; 4 front-ends on one port
    rlfeed serve --journal-dir /data/rlfeed       # nothing acknowledged is lost in a crash
    rlfeed serve --world-size 2                   # beside `torchrun --nproc_per_node 2`
    rlfeed serve --config my.toml --print-config  # print the resolved config, start nothing

Prints the resolved config (`--config-format`), then one line

    rlfeed serve: listening on 127.0.0.1:50051 (embedded Ray; TLS on, mTLS off, tokens on)

SIGTERM or Ctrl-C stops it gracefully within seconds, exit status 0: serving until told to
stop is its whole job, so a stop asked for is a success (a Kubernetes Job or `restart:
on-failure` must not count it as a crash), unlike `rlfeed demo`, whose steps a signal
leaves undone (143). Exit 2 for a bad config, `[security]` files included (missing, a
certificate and key that are no pair, an expired certificate), and for a sidecar (`[ray]
namespace` and `actor_name`) that another live `rlfeed serve` owns on the cluster of
`--ray-address`; with `--frontends` there, SIGKILL leaves the front-ends serving and the
next `rlfeed serve` with the same config adopts them (`service/scaleout/driver.py`). Exit 1
when it cannot start (a port in use) or a replica dies without `--journal-dir` (with one,
the replica is restarted on its journal slot and the sidecar runs on). A bad config and a
port in use are found before Ray starts. A replica whose first process is killed exits
within a second, so no orphan holds the port.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from rlfeed.service.cli.argtypes import non_negative_int, positive_int

RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray's variable: `ray.init()` joins the cluster it names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config (default: built-ins)")
    parser.add_argument("--host", help="interface to bind (overrides [server] host)")
    parser.add_argument("--port", type=int, help="gRPC port, 0 = any free port ([server] port)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="Prometheus /metrics port on [server] metrics_host; 0 = none "
        "(overrides [server] metrics_port, default 0)",
    )
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="join this Ray cluster ('auto' or host:port); 'local' starts an embedded one. "
        "Default: $RAY_ADDRESS when set (Ray's convention), else an embedded local Ray",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        metavar="N",
        help="front-end processes sharing the port and the scheduler ([server] replicas)",
    )
    parser.add_argument(
        "--frontends",
        type=non_negative_int,
        metavar="N",
        help="run N front-ends as Ray actors placed across the cluster, each serving the "
        "port on its node ([frontends] count; 0 = in this process)",
    )
    parser.add_argument(
        "--frontend-resource",
        metavar="NAME",
        help="place front-ends only on nodes offering this custom Ray resource, one unit "
        "each ([frontends] resource; default: spread over every node)",
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="be another front-end of the sidecar whose Ray cluster --ray-address names",
    )
    parser.add_argument(
        "--journal-dir",
        metavar="DIR",
        help="journal everything acknowledged here; a restart on it resumes the run "
        "([journal] dir; default: none, a crash loses the buffer and the curriculum)",
    )
    parser.add_argument("--journal-slot", help=argparse.SUPPRESS)  # a replica's, set by serve
    # A replica's: the first process's pid; the replica exits once it is no longer its parent.
    parser.add_argument("--first-pid", type=int, help=argparse.SUPPRESS)
    for flag, what in (
        ("--tls-cert", "PEM certificate chain of the gRPC port: TLS ([security] tls_cert)"),
        ("--tls-key", "PEM private key of --tls-cert ([security] tls_key)"),
        ("--tls-client-ca", "CA that clients' certificates must chain to: mutual TLS"),
        (
            "--auth-token-file",
            "'TOKEN ROLE' lines; every call then needs a token (SIGHUP re-reads)",
        ),
    ):
        parser.add_argument(flag, metavar="FILE", help=what)
    parser.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="trainer ranks each step is cut for, e.g. torchrun's --nproc_per_node "
        "([batching] world_size, default 1)",
    )
    parser.add_argument(
        "--print-config",
        nargs="?",
        const="toml",
        choices=("toml", "json"),
        metavar="toml|json",
        help="print the resolved config (default toml) and exit, starting nothing",
    )
    parser.add_argument(
        "--config-format",
        choices=("toml", "json"),
        default="toml",
        help="format of the resolved config printed at start-up (default toml)",
    )


def _install_stop_handlers(stop: threading.Event) -> None:
    def request_stop(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


class _Exit(Exception):
    """Leave `run` with this exit status; the reason is already on stderr."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _fail(code: int, reason: object) -> _Exit:
    print(f"rlfeed serve: {reason}", file=sys.stderr)
    return _Exit(code)


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    _install_stop_handlers(stop)  # a signal during the slow Ray start-up is honoured too
    from rlfeed.service.config import dump_config

    _resolve_ray_address(args)
    try:
        config = _resolved_config(args)
        if args.print_config:
            print(dump_config(config, args.print_config), flush=True)
            return 0
        _check_files(config)
        print(dump_config(config, args.config_format), flush=True)
        _retain_freed_memory(config)
        if config.frontends.count:
            from rlfeed.service.scaleout.driver import serve_frontend_actors

            code = serve_frontend_actors(config, args.ray_address, _describe_ray(args), stop)
            if code != 2:  # 2: refused, it never served
                print("rlfeed serve: stopped", flush=True)
            return code
        exporter = _bound_exporter(config)
        sidecar = _started_sidecar(config, args, exporter)
        code = _serve(config, args, stop, sidecar, exporter)
    except _Exit as exc:
        return exc.code
    if args.join and not sidecar.handed_over:  # the first process stops the sidecar
        print("rlfeed serve: this replica could not hand its data over", file=sys.stderr)
        return 1
    print("rlfeed serve: stopped", flush=True)
    return code


def _retain_freed_memory(config) -> None:
    from rlfeed.client.allocator import retain_freed_memory

    # NOTE: before numpy, Ray or gRPC start threads: glibc fixes its heaps then.
    # start_server applies it again, and says so if it cannot.
    retain_freed_memory(config.server.retained_free_mib * 2**20, single_arena=True)


def _resolved_config(args: argparse.Namespace):
    """The config file with the flags' [server] overrides; exit 2 on a bad one."""
    from rlfeed.service.config import load_config, with_overrides

    flags = (
        ("host", args.host),
        ("port", args.port),
        ("metrics_port", args.metrics_port),
        ("replicas", args.replicas),
    )
    security = {
        name: getattr(args, name)
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")
        if getattr(args, name) is not None
    }
    journal = {"dir": args.journal_dir} if args.journal_dir is not None else {}
    batching = {"world_size": args.world_size} if args.world_size is not None else {}
    frontends = {
        name: value
        for name, value in (("count", args.frontends), ("resource", args.frontend_resource))
        if value is not None
    }
    try:
        config = load_config(args.config)
        config = with_overrides(
            config,
            server={k: v for k, v in flags if v is not None},
            security=security,
            journal=journal,
            frontends=frontends,
            batching=batching,
        )
    except (OSError, ValueError) as exc:
        raise _fail(2, exc) from None
    if args.join and args.ray_address is None:
        raise _fail(2, "--join needs --ray-address")
    if args.join and config.frontends.count:
        raise _fail(2, "--join and --frontends exclude each other (Ray places the front-ends)")
    return config


def _check_files(config) -> None:
    """The `[security]` files, read before Ray starts (a missing file, a certificate and
    key that are no pair, an expired certificate): exit 2, as for any bad config."""
    from rlfeed.service.security.files import check_files

    try:
        check_files(config.security)
    except (OSError, ValueError) as exc:
        raise _fail(2, exc) from None


def _describe_ray(args: argparse.Namespace) -> str:
    """Which Ray this sidecar runs on, for the "listening on" line."""
    if args.ray_address is None:
        return "embedded Ray"
    source = f" from {RAY_ADDRESS_ENV}" if args.ray_address_from_env else ""
    return f"Ray at {args.ray_address}{source}"


def _resolve_ray_address(args: argparse.Namespace) -> None:
    """`args.ray_address`: the flag, else $RAY_ADDRESS, else None (an embedded local Ray);
    `--ray-address local` asks for the embedded one whatever the environment says."""
    env = os.environ.get(RAY_ADDRESS_ENV, "").strip()
    args.ray_address_from_env = args.ray_address is None and bool(env)
    if args.ray_address_from_env:
        args.ray_address = env
    if args.ray_address == "local":
        args.ray_address = None


def _bound_exporter(config):
    """The metrics exporter, its port bound, or None without a metrics port. Bound before
    anything starts: a taken port fails at once, and a replica fails before it registers
    with the actor, so the first process's start reports it."""
    from rlfeed.service.metrics.exporter import SidecarExporter

    if not config.server.metrics_port:
        return None
    exporter = SidecarExporter(config)
    try:
        exporter.start(actor=None)
    except OSError as exc:  # names the address
        raise _fail(1, exc) from None
    return exporter


def _started_sidecar(config, args: argparse.Namespace, exporter):
    """`start_server`; on failure the exporter is stopped (exit 1 for a start-up error)."""
    from rlfeed.service.frontend.server import start_server

    try:
        return start_server(
            config,
            ray_address=args.ray_address,
            events=exporter.events if exporter is not None else None,
            join=args.join,
            **({"slot": args.journal_slot} if args.journal_slot else {}),
        )
    except BaseException as exc:
        if exporter is not None:
            exporter.stop()
        if not isinstance(exc, (RuntimeError, ValueError)):  # ValueError: --join, no actor
            raise
        raise _fail(1, exc) from None


def _serve(config, args: argparse.Namespace, stop: threading.Event, sidecar, exporter) -> int:
    """Start the other front-ends, announce, serve until stopped (the exit status); the
    replicas, the exporter and the sidecar are stopped on every path."""
    from rlfeed.service.scaleout.processes import start_replicas

    replicas = None
    try:
        if exporter is not None:
            exporter.attach(sidecar.actor)
        if config.server.replicas > 1 and not args.join:
            try:
                replicas = start_replicas(config, sidecar.port, sidecar.actor)
            except RuntimeError as exc:
                raise _fail(1, exc) from None
        _install_token_reload(sidecar, replicas)
        if exporter is not None:
            print(f"rlfeed serve: metrics on {exporter.url}/metrics", flush=True)
        where = _describe_ray(args)
        fronts = f", {config.server.replicas} front-ends" if replicas is not None else ""
        print(
            f"rlfeed serve: listening on {sidecar.address} ({where}{fronts}; "
            f"{config.security.summary()})",
            flush=True,
        )
        code = _wait_for_stop(stop, replicas, sidecar, args.first_pid)
        print("rlfeed serve: stopping", flush=True)
        return code
    finally:
        try:
            if replicas is not None:
                replicas.stop()
            if exporter is not None:
                exporter.stop()
        finally:
            sidecar.stop(grace=2.0)


def _install_token_reload(sidecar, replicas) -> None:
    """SIGHUP re-reads the token file here and in every replica (rotation, no restart)."""
    tokens = sidecar.security.tokens
    if tokens is None or not hasattr(signal, "SIGHUP"):
        return

    def reload(signum, frame) -> None:
        tokens.reload()
        for process in replicas.processes if replicas is not None else ():
            if process.poll() is None:
                process.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGHUP, reload)


def _wait_for_stop(stop: threading.Event, replicas, sidecar, first_pid: int | None) -> int:
    """0 once asked to stop; 1 as soon as the scheduler actor is gone for good (no zombie
    front-end answering UNAVAILABLE), or a replica exits other than by handing over and
    there is no journal to restart it from. A replica whose first process is gone exits
    at once (`_leave_orphaned`)."""
    journaled = bool(sidecar.config.journal.dir)
    while not stop.wait(0.5):
        if first_pid is not None and os.getppid() != first_pid:
            _leave_orphaned(sidecar, first_pid)
        if sidecar.lost.is_set():
            print(f"rlfeed serve: {sidecar.lost_reason}; stopping", file=sys.stderr)
            return 1
        if replicas is None:
            continue
        for left in replicas.newly_left():
            print(f"rlfeed serve: {left}, its data handed over", flush=True)
        for index in replicas.died():
            if not journaled:
                print(
                    f"rlfeed serve: {replicas.exited()}; without [journal] dir what it held "
                    "is lost: stopping the sidecar",
                    file=sys.stderr,
                )
                return 1
            if not _restarted(replicas, index):
                return 1
    return 0


def _restarted(replicas, index: int) -> bool:
    """Restart replica `index` on its journal slot and say so; False (said why) if it
    cannot be, or keeps dying: the sidecar then stops."""
    if replicas.crash_looping(index):
        print(
            f"rlfeed serve: {replicas.exited()}, restarted too often; stopping the sidecar",
            file=sys.stderr,
        )
        return False
    try:
        line = replicas.restart(index)
    except Exception as exc:  # the actor is gone too
        print(f"rlfeed serve: cannot restart replica {index}: {exc}; stopping", file=sys.stderr)
        return False
    print(f"rlfeed serve: {line}", file=sys.stderr, flush=True)
    return True


def _leave_orphaned(sidecar, first_pid: int) -> None:
    """This replica's first process died (SIGKILL: it could not stop us), and Ray and the
    scheduler actor with it: free the port now instead of holding it as an orphan, and
    exit without waiting for the dead cluster."""
    print(
        f"rlfeed serve: the first process (pid {first_pid}) is gone; this replica exits",
        file=sys.stderr,
        flush=True,
    )
    sidecar.abandon()
    os._exit(1)
