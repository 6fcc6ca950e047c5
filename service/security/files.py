"""Start-up's check of the `[security]` files: present, readable, parseable, private."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from rlfeed.service.config.fields import requirement
from rlfeed.service.config.security import SecurityConfig
from rlfeed.service.security.certificates import check_certificate_pair
from rlfeed.service.security.tokens import TokenFileError, read_token_file

_log = logging.getLogger(__name__)

_require = requirement("security")


def check_files(config: SecurityConfig) -> None:
    """Every configured file is a readable regular file, the certificate and key are a
    pair valid now (`certificates.py`), and the token file parses: ValueError naming
    the field otherwise. Then a key or token file that other users may read is logged
    as a warning (its path, not its content)."""
    paths = {
        name: Path(getattr(config, name))
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")
        if getattr(config, name)
    }
    for name, path in paths.items():
        _require(path.is_file(), name, f"{path} is not a file")
        _require(os.access(path, os.R_OK), name, f"{path} is not readable")
    if config.tls:
        check_certificate_pair(config.tls_cert, config.tls_key)
    if config.auth_token_file:
        try:
            read_token_file(config.auth_token_file)
        except TokenFileError as exc:
            raise ValueError(f"[security] auth_token_file: {exc}") from None
    for name in ("tls_key", "auth_token_file"):
        path = paths.get(name)
        if path is not None and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            _log.warning(
                "rlfeed: [security] %s: %s is readable by other users (chmod 600 it)",
                name,
                path,
            )
