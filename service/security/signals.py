"""Token rotation without a restart: SIGHUP re-reads the token file.

`reload_tokens_on_sighup(store)` must be called from the main thread (Python runs signal
handlers there, and only the main thread may install them: it raises RuntimeError
elsewhere). The handler re-reads the file in the main thread between two bytecodes: a
small file, parsed and swapped in one assignment (`TokenStore.reload`), with no lock that
the interrupted code could hold. A file that fails to parse is logged and the old tokens
stay in force. Each process of a sidecar (every replica) holds its own store, so each
needs the signal: send it to the process group, or have the first process pass it on.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from rlfeed.service.security.tokens import TokenStore


def reload_tokens_on_sighup(store: TokenStore) -> Callable[[], None]:
    """Install the SIGHUP handler; returns the function that puts the previous handler
    back (call it on shutdown). RuntimeError outside the main thread or where the
    platform has no SIGHUP (Windows)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("reload_tokens_on_sighup must be called from the main thread")
    if not hasattr(signal, "SIGHUP"):
        raise RuntimeError("this platform has no SIGHUP; restart to rotate tokens")

    def reload(signum, frame) -> None:
        store.reload()

    previous = signal.signal(signal.SIGHUP, reload)

    def restore() -> None:
        signal.signal(signal.SIGHUP, previous)

    return restore
