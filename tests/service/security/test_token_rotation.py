"""Token rotation by SIGHUP, and secrets kept out of every error message and log line.

The rotation test sends SIGHUP to this very process from the main thread (pytest runs
tests there) with `reload_tokens_on_sighup` installed, against a real loopback server with
the interceptor and the FAKE servicer of conftest.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time

import grpc
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.config.security import SecurityConfig
from rlfeed.service.security.interceptor import AuthInterceptor
from rlfeed.service.security.signals import reload_tokens_on_sighup
from rlfeed.service.security.tokens import TokenFileError, TokenStore, parse_token_file

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP here")


def _status(address: str, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.SidecarStatusStub(channel).GetStatus(
                pb.GetStatusRequest(),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=5,
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_sighup_reload_swaps_the_old_token_for_the_new(tmp_path, caplog, serve_fake):
    old, new = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    path = tmp_path / "tokens.txt"
    path.write_text(f"{old} admin\n")
    store = TokenStore(path)
    server, servicer, (address,) = serve_fake([AuthInterceptor(store)], SecurityConfig())
    restore = reload_tokens_on_sighup(store)
    try:
        assert _status(address, old) == grpc.StatusCode.OK
        assert _status(address, new) == grpc.StatusCode.UNAUTHENTICATED

        path.write_text(f"# rotated\n{new} admin\n")
        with caplog.at_level(logging.DEBUG):
            os.kill(os.getpid(), signal.SIGHUP)
            assert _wait_until(lambda: store.role_of(new) == "admin")

        assert _status(address, old) == grpc.StatusCode.UNAUTHENTICATED
        assert _status(address, new) == grpc.StatusCode.OK
        assert servicer.calls["GetStatus"] == 2

        # A broken file keeps the tokens in force, says so, and names no token.
        path.write_text(f"{old} root\n")
        with caplog.at_level(logging.DEBUG):
            os.kill(os.getpid(), signal.SIGHUP)
            assert _wait_until(lambda: "not reloaded" in caplog.text)
        assert _status(address, new) == grpc.StatusCode.OK
        assert old not in caplog.text and new not in caplog.text
        assert "reloaded (admin 1)" in caplog.text
    finally:
        restore()
        server.stop(None)


def test_the_handler_is_installed_from_the_main_thread_only(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text(f"{secrets.token_urlsafe(32)} trainer\n")
    store, errors = TokenStore(path), []

    def install():
        try:
            reload_tokens_on_sighup(store)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def test_refusals_never_echo_the_token(secured, tokens, caplog):
    """Status details, the client's exception text and every log line at DEBUG, for
    unknown and wrong-role tokens sent well-formed and malformed."""
    texts = []
    with caplog.at_level(logging.DEBUG), grpc.insecure_channel(secured.plaintext) as channel:
        status = pb_grpc.SidecarStatusStub(channel)
        batches = pb_grpc.BatchServingStub(channel)
        for token in (tokens.unknown, tokens.producer, tokens.trainer):
            for method in (status.GetStatus, batches.ReportTrainerMetrics):
                request = (
                    pb.GetStatusRequest() if method is status.GetStatus else pb.TrainerReport()
                )
                for value in (f"Bearer {token}", token, f"Basic {token}"):
                    try:
                        method(request, metadata=(("authorization", value),), timeout=5)
                    except grpc.RpcError as exc:
                        texts += [exc.details() or "", str(exc), repr(exc)]
    texts.append(caplog.text)
    for secret in (tokens.unknown, tokens.producer, tokens.trainer, tokens.admin):
        assert all(secret not in text for text in texts)
    assert any("may not call" in text for text in texts)


def test_token_file_errors_name_the_line_never_the_token():
    token = secrets.token_urlsafe(32)
    cases = {
        f"{token}\n": "1: expected 'TOKEN ROLE', found 1 fields",
        f"# c\n\nadmin {token}\n": "3: the second field is not a role",
        f"{token} admin extra\n": "1: expected 'TOKEN ROLE', found 3 fields",
        f"{token} trainer\n{token} admin\n": "2: repeats the token of line 1",
        "short admin\n": "1: the token must be at least 16",
        "# only a comment\n": "no tokens",
    }
    for text, expected in cases.items():
        with pytest.raises(TokenFileError) as error:
            parse_token_file(text, "tokens.txt")
        assert expected in str(error.value)
        assert token not in str(error.value)


def test_token_file_comments_and_roles():
    producer, trainer = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    text = f"# fleet\n{producer} producer  # inference\n\n  {trainer}\ttrainer\n"
    assert parse_token_file(text, "t") == {producer: "producer", trainer: "trainer"}
    store = TokenStore(tokens={producer: "producer"})
    assert store.role_of(producer) == "producer"
    assert store.role_of(producer + "x") is None
    assert store.role_of("") is None and store.role_of(None) is None


def test_the_store_keeps_digests_not_tokens(tokens):
    store = TokenStore(tokens.path)
    assert tokens.admin.encode() not in repr(vars(store)).encode()
    assert store.roles() == {"producer": 1, "trainer": 1, "admin": 1}
