"""What a call may cost before its handler runs: slots, time waiting for requests, and
requests that are not protobuf.

`CallGuard` is the public server's last interceptor (after `[security]`'s). Every call but
the health service's is wrapped so that, on its handler thread and before a byte of the
request is read:

- it takes a slot of its kind (`CallKind`: an open SubmitRollouts stream, a GetBatch long
  poll, another unary call, GetStatus) in all and for its client address, or answers
  RESOURCE_EXHAUSTED at once naming the `[server]` cap. An idle stream or a stalled long
  poll thus holds one slot of a bounded kind, and the handler threads the caps leave free
  always serve GetStatus and health (`config/server.py`);
- each wait for a request message is timed: past `request_idle_timeout_s` the call is
  cancelled (`IdleWatch`), so a stream that sends nothing or a unary call whose message
  never comes gives its slot and thread back;
- a request that does not deserialize answers INVALID_ARGUMENT naming the method (gRPC
  itself answers INTERNAL, and logs a traceback per call).

Unary-request methods are served as stream-request ones (one message read by the
wrapper): gRPC reads a unary request before its handler runs, which would put the read
outside the slot and the timer. The wire is the same either way.

`CallGuard` is the threaded server's interceptor and holds the decisions and counts;
`AioCallGuard` applies the same ones on the public asyncio server: a synchronous streaming
handler (run in the server's thread pool) gets the very wrapper above; a unary one takes
its slot, reads and times its request on the event loop, then runs there (a coroutine:
GetBatch, AckSteps) or in the pool with the request read (the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import grpc
from rlfeed.service.config.server import STATUS_SLOTS, ServerConfig
from rlfeed.service.frontend.aio_host import PoolContext
from rlfeed.service.security.interceptor import HEALTH_PREFIX

_log = logging.getLogger(__name__)


class CallKind(str, Enum):
    """What a call holds while it runs, and the `[server]` cap on how many may."""

    STREAM = "max_streams"  # a SubmitRollouts stream, open as long as the producer likes
    LONG_POLL = "max_long_polls"  # a GetBatch, waiting up to max_wait_seconds
    UNARY = "max_unary_calls"  # any other rlfeed.v1 call
    STATUS = "status"  # GetStatus: STATUS_SLOTS of its own, no per-client count


_KIND_OF_METHOD = {
    "/rlfeed.v1.RolloutIngest/SubmitRollouts": CallKind.STREAM,
    "/rlfeed.v1.BatchServing/GetBatch": CallKind.LONG_POLL,
    "/rlfeed.v1.SidecarStatus/GetStatus": CallKind.STATUS,
}


def client_address(peer: str) -> str:
    """The client part of `context.peer()`: "ipv4:10.0.0.7:50123" -> "ipv4:10.0.0.7",
    "ipv6:[::1]:5" -> "ipv6:[::1]"; other forms (unix sockets) as they are."""
    family, _, rest = peer.partition(":")
    if family in ("ipv4", "ipv6"):
        host, separator, port = rest.rpartition(":")
        if separator and port.isdigit():
            return f"{family}:{host}"
    return peer


class CallLimits:
    """Calls in flight per kind and per client address, against their caps."""

    def __init__(self, caps: dict[CallKind, int], per_client: int) -> None:
        self._caps = caps
        self._per_client = per_client
        self._lock = threading.Lock()
        self._by_kind: Counter[CallKind] = Counter()
        self._by_client: Counter[str] = Counter()
        self.refused = 0  # calls answered RESOURCE_EXHAUSTED by a cap

    @classmethod
    def of(cls, config: ServerConfig) -> CallLimits:
        caps = {kind: getattr(config, kind.value) for kind in CallKind if kind != CallKind.STATUS}
        return cls({**caps, CallKind.STATUS: STATUS_SLOTS}, config.max_calls_per_client)

    def acquire(self, kind: CallKind, client: str) -> str | None:
        """Take a slot; the refusal's reason (nothing taken) when a cap is reached."""
        counted = kind != CallKind.STATUS and self._per_client > 0
        with self._lock:
            if self._by_kind[kind] >= self._caps[kind]:
                self.refused += 1
                name = "GetStatus calls" if kind == CallKind.STATUS else f"[server] {kind.value}"
                return f"{self._caps[kind]} calls of this kind are in flight ({name}); retry later"
            if counted and self._by_client[client] >= self._per_client:
                self.refused += 1
                return (
                    f"client {client} has {self._per_client} calls in flight "
                    "([server] max_calls_per_client); retry later"
                )
            self._by_kind[kind] += 1
            if counted:
                self._by_client[client] += 1
        return None

    def release(self, kind: CallKind, client: str) -> None:
        with self._lock:
            self._by_kind[kind] -= 1
            if kind != CallKind.STATUS and self._per_client > 0:
                self._by_client[client] -= 1
                if not self._by_client[client]:
                    del self._by_client[client]

    def in_flight(self) -> dict[CallKind, int]:
        with self._lock:
            return {kind: count for kind, count in self._by_kind.items() if count}


class IdleWatch:
    """Cancels calls that wait longer than `timeout_s` for a request message (0 = never).
    One thread checks the waiting calls a few times per timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.cancelled = 0
        self._waiting: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.timeout_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlfeed-idle-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @contextlib.contextmanager
    def waiting(self, context: grpc.ServicerContext) -> Iterator[None]:
        """The call of `context` waits for a request message inside this block."""
        if self.timeout_s <= 0:
            yield
            return
        key = id(context)
        with self._lock:
            self._waiting[key] = (time.monotonic() + self.timeout_s, context)
        try:
            yield
        finally:
            with self._lock:
                self._waiting.pop(key, None)

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                expired = [key for key, (deadline, _) in self._waiting.items() if deadline <= now]
                contexts = [self._waiting.pop(key)[1] for key in expired]
            for context in contexts:
                self.cancelled += 1
                _log.debug("rlfeed: cancelled a call idle for %.0f s", self.timeout_s)
                self._cancel(context)  # the handler's read ends; its slot and thread are freed

    def _cancel(self, context: grpc.ServicerContext) -> None:
        cancel = getattr(context, "cancel", None)
        if cancel is not None:  # a threaded server's call
            cancel()
            return
        # An asyncio server's call run in its thread pool has no cancel(): an abort from
        # here ends it alike (the blocked read raises in the handler's thread).
        with contextlib.suppress(Exception):  # raised here by design, or the call just ended
            context.abort(grpc.StatusCode.CANCELLED, self.message)

    @property
    def message(self) -> str:
        return f"no request message for {self.timeout_s:g} s ([server] request_idle_timeout_s)"


@dataclass(frozen=True)
class Undecodable:
    """What a lenient deserializer returns for bytes that are not the request message."""

    reason: str


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # any failure of any deserializer: the caller's bytes
            return Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

    return deserialize


class _GuardedCall:
    """One admitted call: its request reads, timed and checked."""

    def __init__(self, idle: IdleWatch, context: grpc.ServicerContext, method: str) -> None:
        self._idle = idle
        self._context = context
        self._method = method

    def next_request(self, iterator: Iterator[Any]) -> Any:
        """The next request message; StopIteration at the end of the stream."""
        with self._idle.waiting(self._context):
            request = next(iterator)
        if isinstance(request, Undecodable):
            self._context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self._method}: the request is not a valid message of this method "
                f"({request.reason})",
            )
        return request

    def requests(self, iterator: Iterator[Any]) -> Iterator[Any]:
        while True:
            try:
                request = self.next_request(iterator)
            except StopIteration:
                return
            yield request

    def only_request(self, iterator: Iterator[Any]) -> Any:
        try:
            return self.next_request(iterator)
        except StopIteration:
            self._context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self._method} takes one request message and none arrived (or the call "
                "waited longer than [server] request_idle_timeout_s for it)",
            )


class CallGuard(grpc.ServerInterceptor):
    """The interceptor of the module docstring; `start()` / `stop()` its idle watch."""

    def __init__(self, config: ServerConfig) -> None:
        self.limits = CallLimits.of(config)
        self.idle = IdleWatch(config.request_idle_timeout_s)

    def start(self) -> None:
        self.idle.start()

    def stop(self) -> None:
        self.idle.stop()

    @staticmethod
    def kind_of(method: str, handler: grpc.RpcMethodHandler | None) -> CallKind | None:
        """The kind of slot a call of `method` takes; None: not guarded (no such method,
        or the health service)."""
        if handler is None or method.startswith(HEALTH_PREFIX):
            return None
        default = CallKind.STREAM if handler.request_streaming else CallKind.UNARY
        return _KIND_OF_METHOD.get(method, default)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        kind = self.kind_of(method, handler)
        return handler if kind is None else self._guarded(handler, method, kind)

    def _guarded(
        self, handler: grpc.RpcMethodHandler, method: str, kind: CallKind
    ) -> grpc.RpcMethodHandler:
        streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
        inner = {
            (False, False): handler.unary_unary,
            (False, True): handler.unary_stream,
            (True, False): handler.stream_unary,
            (True, True): handler.stream_stream,
        }[(streaming_in, streaming_out)]

        def requests(call: _GuardedCall, iterator: Iterator[Any]) -> Any:
            return call.requests(iterator) if streaming_in else call.only_request(iterator)

        if streaming_out:

            def behavior(request_iterator, context):
                with self._admitted(kind, method, context) as call:
                    yield from inner(requests(call, request_iterator), context)

            make = grpc.stream_stream_rpc_method_handler
        else:

            def behavior(request_iterator, context):
                with self._admitted(kind, method, context) as call:
                    return inner(requests(call, request_iterator), context)

            make = grpc.stream_unary_rpc_method_handler
        return make(
            behavior,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    @contextlib.contextmanager
    def _admitted(
        self, kind: CallKind, method: str, context: grpc.ServicerContext
    ) -> Iterator[_GuardedCall]:
        client = client_address(context.peer())
        refusal = self.limits.acquire(kind, client)
        if refusal is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {refusal}")
        try:
            yield _GuardedCall(self.idle, context, method)
        finally:
            self.limits.release(kind, client)


class AioCallGuard(grpc.aio.ServerInterceptor):
    """`CallGuard`'s limits on an asyncio server (module docstring): the same slots,
    counts and idle timeout, shared with `guard`."""

    def __init__(self, guard: CallGuard) -> None:
        self.guard = guard
        # method -> (its handler, the guarded one): built once per method, not per call.
        self._built: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        built = self._built.get(method)
        if built is not None and built[0] is handler:
            return built[1]
        guarded = self._guarded_handler(handler, method)
        if handler is not None:
            self._built[method] = (handler, guarded)
        return guarded

    def _guarded_handler(
        self, handler: grpc.RpcMethodHandler | None, method: str
    ) -> grpc.RpcMethodHandler | None:
        kind = self.guard.kind_of(method, handler)
        if kind is None:
            return handler
        streaming = handler.request_streaming or handler.response_streaming
        in_pool = not _is_coroutine_handler(handler)
        if in_pool and streaming:
            return self.guard._guarded(handler, method, kind)  # runs in the thread pool
        if streaming:
            raise TypeError(f"{method}: a guarded coroutine handler must be unary-unary")
        return self._guarded_coroutine(handler, method, kind, in_pool)

    def _guarded_coroutine(
        self, handler: grpc.RpcMethodHandler, method: str, kind: CallKind, in_pool: bool
    ) -> grpc.RpcMethodHandler:
        """A unary-unary call whose slot, request read and idle timer live on the event
        loop; `in_pool`: its synchronous handler then runs in the loop's default executor
        (the server's pool, `aio_host`) with the request read. Not by `CallGuard._guarded`:
        each read of its request iterator crosses from the pool to the loop and back, two
        thread hops more per call (GetStatus cost 1.7-1.8 ms of front-end CPU instead of
        the threaded server's 1.45 ms)."""
        limits, idle, inner = self.guard.limits, self.guard.idle, handler.unary_unary

        async def behavior(request_iterator, context):
            client = client_address(context.peer())
            refusal = limits.acquire(kind, client)
            if refusal is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {refusal}")
            try:
                request = await _only_request(idle, request_iterator, context, method)
                if not in_pool:
                    return await inner(request, context)
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(None, inner, request, PoolContext(context, loop))
            finally:
                limits.release(kind, client)

        return grpc.stream_unary_rpc_method_handler(
            behavior,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def _is_coroutine_handler(handler: grpc.RpcMethodHandler) -> bool:
    behaviors = (handler.unary_unary, handler.unary_stream, handler.stream_unary)
    return any(
        inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
        for behavior in (*behaviors, handler.stream_stream)
        if behavior is not None
    )


async def _within(awaitable, timeout_s: float) -> Any:
    """`awaitable`'s result, or asyncio.TimeoutError after `timeout_s` (<= 0: no limit).
    `asyncio.timeout` (Python 3.11+) where there is one: `wait_for` wraps each read in a
    task of its own, a cost paid on every call."""
    if timeout_s <= 0:
        return await awaitable
    if not hasattr(asyncio, "timeout"):  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await awaitable


async def _only_request(idle: IdleWatch, request_iterator, context, method: str) -> Any:
    """`_GuardedCall.only_request` on the event loop, timed by `_within`."""
    try:
        request = await _within(request_iterator.__anext__(), idle.timeout_s)
    except StopAsyncIteration:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes one request message and none arrived"
        )
    except asyncio.TimeoutError:
        idle.cancelled += 1
        await context.abort(grpc.StatusCode.CANCELLED, idle.message)
    if isinstance(request, Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: the request is not a valid message of this method ({request.reason})",
        )
    return request
