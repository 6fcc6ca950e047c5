"""`rlfeed serve`: run the sidecar (gRPC server + Ray-hosted scheduler) until stopped.

    rlfeed serve                                  # defaults, embedded local Ray, port 50051
    rlfeed serve --config deploy/rlfeed.example.toml --port 0
    rlfeed serve --ray-address auto               # join the Ray cluster of this machine
    rlfeed serve --ray-address 10.0.0.5:6379      # join a cluster by its head's address
    rlfeed serve --metrics-port 9400              # Prometheus /metrics on 127.0.0.1:9400
    rlfeed serve --replicas 4                     # 4 front-end processes on one port

Prints the resolved configuration (TOML) and then one line `rlfeed serve: listening on
HOST:PORT` (with --port 0 the port picked). With a metrics port (`--metrics-port`, else
`[server] metrics_port`; 0, the default, means none) it also serves Prometheus metrics,
the newest step's layout picture and a health check on `[server] metrics_host` (127.0.0.1
unless configured, whatever `host` gRPC binds) and prints `rlfeed serve: metrics on
http://HOST:PORT/metrics`. SIGTERM or Ctrl-C stops it within seconds: the metrics endpoint
closes, health goes NOT_SERVING, in-flight calls get a short grace period, the scheduler
actor is killed and an embedded Ray is shut down (a joined cluster keeps running). Joining
a cluster with token authentication (Ray 2.59+) needs its token, as for any Ray driver:
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in the environment. A bad config exits 2 with the key and
section; a port in use exits 1.

With `--replicas N` (`[server] replicas`) this process starts N-1 more front-ends,
`rlfeed serve --join` processes on the same port and scheduler actor (see
`rlfeed.service.replicas.processes`), waits for them before printing the listening line, and stops
them when it stops. A replica told to stop (SIGTERM) hands its data over and leaves (exit
0; the sidecar runs on); if one exits otherwise, the whole sidecar stops (exit 1): the
front-ends hold each other's data. `--join` is that replica mode, for `--replicas` to
start: it needs `--ray-address` and leaves the actor running when it stops.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from rlfeed.service.cli.argtypes import positive_int


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
        help="join this Ray cluster ('auto' or host:port); default: start an embedded one",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        metavar="N",
        help="front-end processes sharing the port and the scheduler ([server] replicas)",
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="be another front-end of the sidecar whose Ray cluster --ray-address names",
    )
    parser.add_argument(
        "--print-config",
        choices=("toml", "json"),
        default="toml",
        help="format of the resolved config printed at start-up (default toml)",
    )


def _install_stop_handlers(stop: threading.Event) -> None:
    def request_stop(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    _install_stop_handlers(stop)  # a signal during the slow Ray start-up is honoured too

    from rlfeed.service.config import dump_config, load_config, with_overrides

    try:
        config = load_config(args.config)
        server_overrides = {
            key: value
            for key, value in (
                ("host", args.host),
                ("port", args.port),
                ("metrics_port", args.metrics_port),
                ("replicas", args.replicas),
            )
            if value is not None
        }
        config = with_overrides(config, server=server_overrides)
    except (OSError, ValueError) as exc:
        print(f"rlfeed serve: {exc}", file=sys.stderr)
        return 2
    if args.join and args.ray_address is None:
        print("rlfeed serve: --join needs --ray-address", file=sys.stderr)
        return 2
    print(dump_config(config, args.print_config), flush=True)

    from rlfeed.client.allocator import retain_freed_memory

    # Before numpy, Ray or gRPC start threads (glibc fixes its heaps then); start_server
    # applies it again, and says so if it cannot.
    retain_freed_memory(config.server.retained_free_mib * 2**20, single_arena=True)

    from rlfeed.service.frontend.server import start_server
    from rlfeed.service.metrics.exporter import SidecarExporter
    from rlfeed.service.replicas.processes import start_replicas

    exporter = SidecarExporter(config) if config.server.metrics_port else None
    if exporter is not None:
        # Bound before anything starts: a taken port fails at once, and a replica fails
        # before it registers with the actor, so the first process's start reports it.
        try:
            exporter.start(actor=None)
        except OSError as exc:  # names the address
            print(f"rlfeed serve: {exc}", file=sys.stderr)
            return 1
    try:
        sidecar = start_server(
            config,
            ray_address=args.ray_address,
            events=exporter.events if exporter is not None else None,
            join=args.join,
        )
    except BaseException as exc:
        if exporter is not None:
            exporter.stop()
        if not isinstance(exc, (RuntimeError, ValueError)):  # ValueError: --join, no actor
            raise
        print(f"rlfeed serve: {exc}", file=sys.stderr)
        return 1
    replicas = None
    try:
        if exporter is not None:
            exporter.attach(sidecar.actor)
        if config.server.replicas > 1 and not args.join:
            try:
                replicas = start_replicas(config, sidecar.port, sidecar.actor)
            except RuntimeError as exc:
                print(f"rlfeed serve: {exc}", file=sys.stderr)
                return 1
        _install_stop_handlers(stop)  # Ray installs its own handlers during ray.init
        if exporter is not None:
            print(f"rlfeed serve: metrics on {exporter.url}/metrics", flush=True)
        where = "embedded Ray" if args.ray_address is None else f"Ray at {args.ray_address}"
        fronts = f", {config.server.replicas} front-ends" if replicas is not None else ""
        print(f"rlfeed serve: listening on {sidecar.address} ({where}{fronts})", flush=True)
        code = 0
        while not stop.wait(0.5):
            if replicas is None:
                continue
            for left in replicas.newly_left():
                print(f"rlfeed serve: {left}, its data handed over", flush=True)
            problem = replicas.exited()
            if problem is not None:
                print(f"rlfeed serve: {problem}; stopping the sidecar", file=sys.stderr)
                code = 1
                break
        print("rlfeed serve: stopping", flush=True)
    finally:
        try:
            if replicas is not None:
                replicas.stop()
            if exporter is not None:
                exporter.stop()
        finally:
            sidecar.stop(grace=2.0)
    if args.join and not sidecar.handed_over:  # the first process stops the sidecar
        print("rlfeed serve: this replica could not hand its data over", file=sys.stderr)
        return 1
    print("rlfeed serve: stopped", flush=True)
    return code
