"""The server interceptor that decides, per call, whether it may reach a handler.

With a token store, every call outside the health service needs one
`authorization: Bearer <token>` metadata entry (RFC 6750; the scheme's case does not
matter) whose token's role the method map allows:

- no token, a malformed header or an unknown token -> UNAUTHENTICATED;
- a known token of a role not allowed for the method (or a method not in the map) ->
  PERMISSION_DENIED;
- `grpc.health.v1.Health` is always open (orchestrator probes carry no token);
- server reflection is UNIMPLEMENTED unless allowed, then open to any known token.

Without a token store only the reflection rule applies (the port's TLS/mTLS, if any, is
the whole check). A refused call never reaches the servicer and none of its request is
read: the refusal is a stream-request handler that aborts at once, whatever the method's
kind (a unary-request handler would first take the whole message in, up to the server's
size limit, from a caller that proved nothing). Status details name the method and the
role, never the token; refusals are logged at DEBUG only (an attacker must not be able to
fill the log) and counted through `on_refused`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
from rlfeed.service.security.roles import MethodRoles, public_method_roles
from rlfeed.service.security.tokens import TokenStore

_log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = (
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
_BEARER = "bearer "


def bearer_token(metadata: Sequence[tuple[str, str]] | None) -> str | None:
    """The token of the call's one `authorization: Bearer <token>` entry; None if there
    is none, more than one, or it is not a bearer token."""
    values = [value for key, value in metadata or () if key == "authorization"]
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    value = values[0]
    if value[: len(_BEARER)].lower() != _BEARER:
        return None
    token = value[len(_BEARER) :].strip()
    return token or None


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def refuse(request_iterator, context):
        context.abort(code, message)

    # Stream-request, stream-response: nothing is read, and the status reaches a caller of
    # any of the four kinds alike (no response message is sent).
    return grpc.stream_stream_rpc_method_handler(refuse)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls per the module docstring.

    tokens: the store to check bearer tokens against; None = no token check.
    method_roles: "/package.Service/Method" -> roles allowed; default the public map
      (`roles.public_method_roles()`); the peer port passes `roles.peer_method_roles()`.
    allow_reflection: serve reflection calls (`[security] allow_reflection`).
    on_refused: called with the status code of each refused call (metrics; must be cheap:
      it runs on gRPC's thread that routes calls).
    """

    def __init__(
        self,
        tokens: TokenStore | None,
        *,
        method_roles: MethodRoles | None = None,
        allow_reflection: bool = False,
        on_refused: Callable[[grpc.StatusCode], None] | None = None,
    ) -> None:
        self._tokens = tokens
        self._method_roles = public_method_roles() if method_roles is None else method_roles
        self._allow_reflection = allow_reflection
        self._on_refused = on_refused

    def refusal(self, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
        """The decision of the module docstring for a call of `method` with `metadata`:
        None (it may reach its handler) or the status to refuse it with (counted, logged)."""
        refused = self._decide(method, metadata)
        if refused is not None:
            _log.debug("rlfeed: refused %s: %s", method, refused[0].name)
            if self._on_refused is not None:
                self._on_refused(refused[0])
        return refused

    def _decide(self, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
        if method.startswith(HEALTH_PREFIX):
            return None
        reflection = method.startswith(REFLECTION_PREFIXES)
        if reflection and not self._allow_reflection:
            return (
                grpc.StatusCode.UNIMPLEMENTED,
                "server reflection is off on this sidecar ([security] allow_reflection)",
            )
        if self._tokens is None:
            return None
        token = bearer_token(metadata)
        if token is None:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "this sidecar needs a token: send call metadata 'authorization: Bearer "
                "<token>' (RLFEED_TOKEN or RLFEED_TOKEN_FILE for the rlfeed clients)",
            )
        role = self._tokens.role_of(token)
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not known"
        if reflection:
            return None
        allowed = self._method_roles.get(method)
        if allowed is None or role not in allowed:
            return grpc.StatusCode.PERMISSION_DENIED, f"a {role} token may not call {method}"
        return None

    def intercept_service(self, continuation, handler_call_details):
        refused = self.refusal(
            handler_call_details.method, handler_call_details.invocation_metadata
        )
        if refused is not None:
            return _refusal(*refused)
        return continuation(handler_call_details)


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    """`AuthInterceptor`'s decisions on an asyncio server; a refusal aborts on the event
    loop (no thread of the server's pool is taken for it)."""

    def __init__(self, decider: AuthInterceptor) -> None:
        self.decider = decider

    async def intercept_service(self, continuation, handler_call_details):
        refused = self.decider.refusal(
            handler_call_details.method, handler_call_details.invocation_metadata
        )
        if refused is not None:
            return _async_refusal(*refused)
        return await continuation(handler_call_details)


def _async_refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request_iterator, context):
        await context.abort(code, message)

    # A coroutine stream-stream handler: nothing is read, as `_refusal`.
    return grpc.stream_stream_rpc_method_handler(refuse)


def peer_interceptor(peer_token: str) -> AuthInterceptor:
    """The peer port's interceptor: only calls carrying `peer_token` (the sidecar's own
    secret for its front-ends, `roles.PEER`) reach the peer service and the forwarded
    GetBatch; every token of the token file is refused there."""
    from rlfeed.service.security.roles import PEER, peer_method_roles

    return AuthInterceptor(TokenStore(tokens={peer_token: PEER}), method_roles=peer_method_roles())
