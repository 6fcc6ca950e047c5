"""The end-to-end benchmark's raw baseline: a trivial gRPC service and a client, each a
process of its own, streaming the same bytes the sidecar moved (see the entry module's
docstring, `bench_e2e_throughput.py`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from concurrent import futures
from typing import TYPE_CHECKING

import numpy as np
from e2e_cases import RANK_RETAINED_FREE_MIB
from e2e_processes import environment, reap

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

_RAW_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def raw_client_main(
    address: str, sink_payloads: list[bytes], source_sizes: list[int], out: Queue
) -> None:
    """Stream the payloads in, then the messages out: once to warm up, once timed. Its
    allocator is set as the ranks' (`retained_free_mib`)."""
    import grpc
    from rlfeed.client.allocator import retain_freed_memory

    retain_freed_memory(RANK_RETAINED_FREE_MIB * 2**20)

    channel = grpc.insecure_channel(address, options=_RAW_OPTIONS)
    sink = channel.stream_unary("/raw.Raw/Sink")
    source = channel.unary_stream("/raw.Raw/Source")
    sizes = np.asarray(source_sizes, np.int64).tobytes()
    for _pass in ("warm-up", "timed"):
        sink(iter([b"start"]))  # the server starts (or stops) counting its CPU here
        cpu_started = time.process_time()
        started = time.perf_counter()
        sink(iter(sink_payloads))
        middle = time.perf_counter()
        received = sum(len(m) for m in source(sizes))
        ended = time.perf_counter()
        cpu = time.process_time() - cpu_started
    sink(iter([b"start"]))
    channel.close()
    out.put((middle - started, ended - middle, received, cpu))


def raw_server_main(largest: int, out: Queue) -> None:
    """A trivial gRPC service in a process of its own (generic handlers, bytes in and out,
    no parsing): Sink counts what it is sent, Source sends messages of the sizes asked for.
    Puts its port, then the CPU seconds between the client's last two "start" marks. Its
    allocator is set as the sidecar's front-end sets its own (`[server] retained_free_mib`)."""
    import grpc
    from rlfeed.client.allocator import retain_freed_memory
    from rlfeed.service.config import ServerConfig

    retain_freed_memory(ServerConfig().retained_free_mib * 2**20, single_arena=True)

    blob = os.urandom(largest)
    marks: list[float] = []

    def sink(request_iterator, context):
        total = 0
        for message in request_iterator:
            if message == b"start":
                marks.append(time.process_time())
            total += len(message)
        return str(total).encode()

    def source(request, context):
        for size in np.frombuffer(request, np.int64).tolist():
            yield blob[:size]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_RAW_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "raw.Raw",
                {
                    "Sink": grpc.stream_unary_rpc_method_handler(sink),
                    "Source": grpc.unary_stream_rpc_method_handler(source),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out.put(port)
    deadline = time.monotonic() + 600  # the client's own limit; the parent kills us anyway
    while len(marks) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    out.put(marks[2] - marks[1] if len(marks) == 3 else float("nan"))
    # A grace period: the call that brought the last mark is still being answered, and
    # stop(0) cancelled it now and then (the client then died UNAVAILABLE, and its parent
    # waited out its 600 s for a result that never came).
    server.stop(5.0).wait()


def run_raw(
    sink_payloads: list[bytes],
    source_sizes: list[int],
    cpu: bool = False,
    client_env: dict[str, str] | None = None,
) -> tuple[float, float, float]:
    """(seconds to stream the payloads in, seconds to stream messages of `source_sizes` out,
    CPU seconds both ends used), the second of two passes (the first warms both ends up);
    with `cpu`, also prints the CPU seconds of each end (the floor e2e is compared to).

    Both ends are fresh processes of their own, so the baseline owes nothing to the state
    of the sidecar's process (its heap, its threads); the server takes the front-end's
    allocator settings and the client a rank's (`raw_server_main`, `raw_client_main`)."""
    ctx = mp.get_context("spawn")
    server_out, client_out = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=raw_server_main, args=(max(source_sizes), server_out))
    server.start()
    client = None
    try:
        port = server_out.get(timeout=120)
        client = ctx.Process(
            target=raw_client_main,
            args=(f"127.0.0.1:{port}", sink_payloads, source_sizes, client_out),
        )
        with environment(client_env or {}):
            client.start()
        sink_seconds, source_seconds, received, client_cpu = client_out.get(timeout=600)
        server_cpu = server_out.get(timeout=60)
        assert received == sum(source_sizes)
        if cpu:
            print(
                f"  CPU of the raw stream: client {client_cpu:.2f} s + server {server_cpu:.2f} s "
                f"= {client_cpu + server_cpu:.2f} s"
            )
    finally:
        reap([process for process in (client, server) if process is not None])
    return sink_seconds, source_seconds, client_cpu + server_cpu
