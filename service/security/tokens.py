"""Bearer tokens: the token file, and the store the interceptor asks for a token's role.

The file (`[security] auth_token_file`) holds one `TOKEN ROLE` per line, role one of
`producer`, `trainer`, `admin`; `#` starts a comment to the end of the line (so a token
cannot contain `#`), blank lines are ignored. A token is at least `MIN_TOKEN_CHARS`
printable ASCII characters without spaces (what an HTTP/2 header value can carry), e.g.
`python -c 'import secrets; print(secrets.token_urlsafe(32))'`. A token may appear once.

Secrets never leave this module in text: parse errors name the file and the line number
only, log lines give counts per role, and the store keeps SHA-256 digests, not tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from rlfeed.service.security.roles import FILE_ROLES

_log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


class TokenFileError(ValueError):
    """The token file is unreadable or malformed (the message names the line, never a
    token)."""


def _digest(token: str) -> bytes:
    # Fixed-length digests: compare_digest then takes the same time whatever the length
    # of the presented token.
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _valid_token(token: str) -> bool:
    return len(token) >= MIN_TOKEN_CHARS and token.isascii() and token.isprintable()


def parse_token_file(text: str, source: str) -> dict[str, str]:
    """token -> role of every line of `text` (read from `source`, named in errors).
    Raises TokenFileError naming `source:line` for a malformed line, an unknown role, a
    short or non-ASCII token, a token given twice, or a file without tokens."""
    tokens: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source}:{number}"
        if len(fields) != 2:
            raise TokenFileError(f"{where}: expected 'TOKEN ROLE', found {len(fields)} fields")
        token, role = fields
        if role not in FILE_ROLES:
            # The field is not echoed: a line written `ROLE TOKEN` would print the token.
            raise TokenFileError(
                f"{where}: the second field is not a role (expected one of {', '.join(FILE_ROLES)})"
            )
        if not _valid_token(token):
            raise TokenFileError(
                f"{where}: the token must be at least {MIN_TOKEN_CHARS} printable ASCII characters"
            )
        if token in first_line:
            raise TokenFileError(f"{where}: repeats the token of line {first_line[token]}")
        first_line[token] = number
        tokens[token] = role
    if not tokens:
        raise TokenFileError(f"{source}: no tokens (every call would be refused)")
    return tokens


def read_token_file(path: str | Path) -> dict[str, str]:
    """`parse_token_file` of the file at `path`; TokenFileError if it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise TokenFileError(f"{path}: cannot read the token file: {reason}") from None
    return parse_token_file(text, str(path))


class TokenStore:
    """The tokens of one file (or of a mapping), each with its role.

    `role_of(token)` compares the presented token with every known one in constant time
    (`hmac.compare_digest` over SHA-256 digests, all of them, no early exit).
    `reload()` re-reads the file and swaps the whole set in one assignment: a call
    checked meanwhile sees the old set or the new one, never a mix; a file that fails to
    parse leaves the old set in force. Thread-safe without locks (so it may run inside a
    signal handler)."""

    def __init__(self, path: str | Path | None = None, tokens: Mapping[str, str] | None = None):
        if (path is None) == (tokens is None):
            raise ValueError("TokenStore takes a token file path or a token mapping, not both")
        self.path = None if path is None else Path(path)
        loaded = read_token_file(self.path) if tokens is None else dict(tokens)
        self._entries = self._entries_of(loaded)

    @staticmethod
    def _entries_of(tokens: Mapping[str, str]) -> tuple[tuple[bytes, str], ...]:
        return tuple((_digest(token), role) for token, role in tokens.items())

    def role_of(self, token: str | None) -> str | None:
        """The role of `token`, or None if it is not known (or None)."""
        if token is None:
            return None
        presented = _digest(token)
        role = None
        for digest, candidate in self._entries:  # one snapshot of the set
            if hmac.compare_digest(presented, digest):
                role = candidate
        return role

    def roles(self) -> Counter[str]:
        """How many tokens each role has (what may be logged or shown)."""
        return Counter(role for _, role in self._entries)

    def reload(self) -> bool:
        """Re-read the file; True if the new set is in force, False (logged, old set
        kept) if it could not be read or parsed. A store built from a mapping keeps it."""
        if self.path is None:
            return True
        try:
            entries = self._entries_of(read_token_file(self.path))
        except TokenFileError as exc:
            _log.error("rlfeed: token file not reloaded, the previous tokens stay: %s", exc)
            return False
        self._entries = entries
        counts = ", ".join(f"{role} {n}" for role, n in sorted(self.roles().items()))
        _log.info("rlfeed: token file %s reloaded (%s)", self.path, counts)
        return True
