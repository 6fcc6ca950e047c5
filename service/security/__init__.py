"""Who may call the sidecar: TLS / mutual TLS on the listening ports, bearer tokens with
roles checked by a server interceptor, token rotation on SIGHUP (`README.md` here).

- `config.SecurityConfig`: the `[security]` section (paths and one switch, no secrets).
- `roles`: the roles and which gRPC methods each may call, derived from `rlfeed.proto`.
- `tokens.TokenStore`: the token file, re-read on demand, compared in constant time.
- `interceptor.AuthInterceptor`: refuses calls without a token of an allowed role.
- `credentials.bind_port`: a port with TLS/mTLS (or plaintext) per the config.
- `signals.reload_tokens_on_sighup`: rotation without a restart.
- `server_security.ServerSecurity`: all of the above for the server start-up, in one call.

Nothing here runs at import time; the server start-up builds and wires these
(`ServerSecurity.from_config`).
"""
