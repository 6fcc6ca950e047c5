"""One object for the server start-up: `ServerSecurity.from_config(config.security)`.

    security = ServerSecurity.from_config(config.security)  # checks files, fails fast
    server = grpc.server(executor, interceptors=security.interceptors, options=...)
    port = security.bind(server, f"{host}:{port}")            # TLS / mTLS / plaintext
    restore = security.reload_on_sighup()                     # main thread only
    try: ... finally: restore(); server.stop(grace)

`describe()` is the start-up line to log: what is on, never a secret.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from rlfeed.service.config.security import SecurityConfig
from rlfeed.service.security.credentials import bind_port
from rlfeed.service.security.files import check_files
from rlfeed.service.security.interceptor import AioAuthInterceptor, AuthInterceptor
from rlfeed.service.security.signals import reload_tokens_on_sighup
from rlfeed.service.security.tokens import TokenStore


@dataclass(frozen=True)
class ServerSecurity:
    """The public port's security, built from `[security]`: the token store (None
    without a token file) and the interceptor every public server gets."""

    config: SecurityConfig
    tokens: TokenStore | None
    interceptor: AuthInterceptor

    @classmethod
    def from_config(
        cls,
        config: SecurityConfig,
        on_refused: Callable[[grpc.StatusCode], None] | None = None,
    ) -> ServerSecurity:
        """Reads and checks every configured file (ValueError naming the field) and builds
        the interceptor; `on_refused` counts refusals (see `AuthInterceptor`)."""
        check_files(config)
        tokens = TokenStore(config.auth_token_file) if config.tokens else None
        interceptor = AuthInterceptor(
            tokens, allow_reflection=config.allow_reflection, on_refused=on_refused
        )
        return cls(config, tokens, interceptor)

    @property
    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [self.interceptor]

    @property
    def aio_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The same decisions for an asyncio server (the public port's)."""
        return [AioAuthInterceptor(self.interceptor)]

    def bind(self, server: grpc.Server, address: str) -> int:
        """`credentials.bind_port` with this config; returns the bound port. `server`: a
        threaded server or anything with its `add_*_port` (`AioServerThread`)."""
        return bind_port(server, address, self.config)

    def reload_on_sighup(self) -> Callable[[], None]:
        """Install the SIGHUP token reload (main thread only); returns the restore
        function, a no-op without a token file."""
        if self.tokens is None:
            return lambda: None
        return reload_tokens_on_sighup(self.tokens)

    def describe(self) -> str:
        """E.g. "mutual TLS, tokens (admin 1, producer 2, trainer 8), reflection off"."""
        config = self.config
        transport = "mutual TLS" if config.mutual_tls else "TLS" if config.tls else "plaintext"
        if self.tokens is None:
            tokens = "no tokens"
        else:
            counts = sorted(self.tokens.roles().items())
            tokens = "tokens (" + ", ".join(f"{role} {n}" for role, n in counts) + ")"
        reflection = "reflection on" if config.allow_reflection else "reflection off"
        return f"{transport}, {tokens}, {reflection}"
