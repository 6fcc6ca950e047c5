"""The public port's asyncio gRPC server, on an event loop thread the front-end owns.

Why asyncio: a threaded `grpc.server` holds one thread per call in flight, so a few dozen
GetBatch long polls (one per trainer rank, each waiting up to `max_wait_seconds`) would
take every handler thread. On `grpc.aio`, a coroutine handler (`BatchServing.GetBatchAsync`)
waits on the event loop and holds no thread; every synchronous handler (ingest, task
sampling, status, acks, reports, health, reflection) runs unchanged in the server's
migration thread pool, which is also the loop's default executor (where GetBatch runs what
blocks: actor and peer calls).

`AioServerThread` gives the rest of the front-end the threaded server's synchronous face
(`add_generic_rpc_handlers`, `add_registered_method_handlers`, the two `add_*_port`,
`start`, `stop(grace).wait(timeout)`, `wait_for_termination`), so the generated
`add_*Servicer_to_server`, `security.bind` and `SidecarServer` use it as they use a
threaded one. `stop` is its one teardown: the server stops on its loop (calls past the
grace cancelled), anything left on the loop is cancelled (a pool thread blocked on a
request read then wakes), the loop is closed and the pool's threads are joined.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent import futures
from typing import Any

import grpc

_log = logging.getLogger(__name__)

# How long `stop` waits for pool threads still running a handler once the server stopped
# (a handler blocked in an actor call past its deadline), seconds; they are left as
# daemons past it, with a warning.
THREAD_JOIN_S = 5.0


class AioServerThread:
    """A `grpc.aio.server` on its own loop thread (module docstring).

    name: prefix of the loop thread's name ("<name>-loop") and the pool's ("<name>_N").
    max_workers: the migration thread pool's size (synchronous handlers, blocking work).
    interceptors: `grpc.aio.ServerInterceptor`s, in order.
    options: channel arguments; maximum_concurrent_rpcs: calls in flight at once, beyond
      which a call answers RESOURCE_EXHAUSTED.
    """

    def __init__(
        self,
        *,
        name: str,
        max_workers: int,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        options: Sequence[tuple[str, Any]] = (),
        maximum_concurrent_rpcs: int | None = None,
    ) -> None:
        self._name = name
        self._pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix=name)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._pool)
        self._terminated = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self._thread.start()

        async def make() -> grpc.aio.Server:  # grpc.aio binds a server to the running loop
            return grpc.aio.server(
                migration_thread_pool=self._pool,
                interceptors=list(interceptors),
                options=list(options),
                maximum_concurrent_rpcs=maximum_concurrent_rpcs,
            )

        try:
            self.server = self.run(make(), timeout_s=30)
        except BaseException:
            self.stop(0)
            raise

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coroutine: Coroutine, timeout_s: float) -> Any:
        """Run `coroutine` on the server's loop and return its result (bounded wait)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    # ---- the threaded server's face -------------------------------------------------

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers) -> None:
        self.server.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self.server.add_insecure_port(address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self.server.add_secure_port(address, credentials)

    def start(self) -> None:
        self.run(self.server.start(), timeout_s=30)

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving (calls in flight get `grace` seconds, then are cancelled), close
        the loop and join the pool; returns the event set once all of it is done.
        Idempotent."""
        with self._stop_lock:
            if self._stopping:
                return self._terminated
            self._stopping = True
        server = getattr(self, "server", None)

        async def shut_down() -> None:
            try:
                if server is not None:
                    await server.stop(grace)
            finally:
                self._loop.stop()

        try:
            asyncio.run_coroutine_threadsafe(shut_down(), self._loop)
        except RuntimeError:  # the loop is closed already
            self._terminated.set()
        return self._terminated

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """As `grpc.Server.wait_for_termination`: True if `timeout` passed first."""
        return not self._terminated.wait(timeout)

    # ---- the loop thread ------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            self._cancel_left_over()
        finally:
            self._loop.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._join_pool()
            self._terminated.set()

    def _cancel_left_over(self) -> None:
        """Cancel every task still on the loop; a pool thread blocked on one of them (a
        handler reading its next request) then gets CancelledError and unwinds."""
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    def _join_pool(self) -> None:
        deadline = time.monotonic() + THREAD_JOIN_S
        prefix = f"{self._name}_"
        for thread in threading.enumerate():
            if thread.name.startswith(prefix):
                thread.join(max(deadline - time.monotonic(), 0.0))
        left = [t.name for t in threading.enumerate() if t.name.startswith(prefix)]
        if left:
            _log.warning("rlfeed: %d gRPC handler threads still run after stop", len(left))


class PoolContext:
    """What a synchronous handler run in the pool sees of a coroutine call's context (as
    grpc.aio's own bridge gives one): `abort` runs on the loop and raises `AbortError`
    here; the rest reads or sets the call's state directly, as that bridge does."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop):
        self._context, self._loop = context, loop

    def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        abort = self._context.abort(code, details, tuple(trailing_metadata))
        asyncio.run_coroutine_threadsafe(abort, self._loop).result()

    def set_trailing_metadata(self, metadata) -> None:
        self._context.set_trailing_metadata(metadata)

    def invocation_metadata(self):
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return self._context.peer()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()
