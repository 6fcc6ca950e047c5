"""The CLI's shared argument rules, in-process: which address wins, what an address must
look like, and that `--json` output is strict JSON."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from rlfeed.service.cli import build_parser
from rlfeed.service.cli.argtypes import DEFAULT_ADDRESS, sidecar_address, strict_json
from rlfeed.service.cli.serve import _resolve_ray_address


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (None, None, None),  # an embedded local Ray
        (None, "10.0.0.5:6379", "10.0.0.5:6379"),  # Ray's convention: join $RAY_ADDRESS
        ("auto", "10.0.0.5:6379", "auto"),  # the flag wins
        ("local", "10.0.0.5:6379", None),  # ... and `local` asks for the embedded one
        (None, "  ", None),  # empty counts as unset
    ],
)
def test_serve_joins_the_flag_then_ray_address_then_an_embedded_ray(
    monkeypatch, flag, env, expected
):
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    args = argparse.Namespace(ray_address=flag)
    _resolve_ray_address(args)
    assert args.ray_address == expected
    assert args.ray_address_from_env == (flag is None and expected is not None)


@pytest.mark.parametrize("command", ["status", "layout"])
def test_client_commands_take_the_flag_then_rlfeed_address_then_the_default(monkeypatch, command):
    extra = ["-o", "x.png"] if command == "layout" else []
    monkeypatch.delenv("RLFEED_ADDRESS", raising=False)
    assert build_parser().parse_args([command, *extra]).address == DEFAULT_ADDRESS
    monkeypatch.setenv("RLFEED_ADDRESS", "sidecar.internal:7000")
    assert build_parser().parse_args([command, *extra]).address == "sidecar.internal:7000"
    flagged = build_parser().parse_args([command, *extra, "--address", "10.1.2.3:9"])
    assert flagged.address == "10.1.2.3:9"


def test_demo_starts_its_own_sidecar_unless_given_an_address(monkeypatch):
    monkeypatch.delenv("RLFEED_ADDRESS", raising=False)
    assert build_parser().parse_args(["demo"]).address is None
    monkeypatch.setenv("RLFEED_ADDRESS", "")
    assert build_parser().parse_args(["demo"]).address is None
    monkeypatch.setenv("RLFEED_ADDRESS", "sidecar.internal:7000")
    assert build_parser().parse_args(["demo"]).address == "sidecar.internal:7000"


@pytest.mark.parametrize(
    "good",
    [
        "127.0.0.1:50051",
        "sidecar.internal:7000",
        "[::1]:50051",
        "unix:/run/x.sock",
        "10.0.0.5:50051,10.0.0.6:50051",  # several front-ends
        "dns:///rlfeed-frontends.ns.svc:50051",
    ],
)
def test_addresses_with_a_port_or_a_scheme_are_taken_as_given(good):
    assert sidecar_address(good) == good


@pytest.mark.parametrize("bad", ["localhost", ":50051", "host:", "host:http", "host:0", "h:70000"])
def test_addresses_without_a_usable_port_are_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="must be HOST:PORT"):
        sidecar_address(bad)


@pytest.mark.parametrize("command", ["status", "layout", "demo"])
def test_client_commands_take_a_list_of_front_ends_from_the_flag_or_rlfeed_address(
    monkeypatch, capsys, command
):
    extra = ["-o", "x.png"] if command == "layout" else []
    front_ends = "10.0.0.5:50051,10.0.0.6:50051"
    monkeypatch.setenv("RLFEED_ADDRESS", front_ends)
    assert build_parser().parse_args([command, *extra]).address == front_ends
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args([command, *extra, "--address", "10.0.0.5:1,fe-2:1"])
    assert usage.value.code == 2
    assert "'fe-2:1' is a host name" in capsys.readouterr().err


def test_strict_json_writes_non_finite_figures_as_null():
    value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2, "NaN")}
    text = strict_json(value)

    def refuse(token: str):
        raise AssertionError(f"not JSON: {token}")

    assert json.loads(text, parse_constant=refuse) == {
        "a": None,
        "b": [1.5, None, {"c": None}],
        "d": [2, "NaN"],
    }


@pytest.mark.parametrize(
    ("flags", "print_config", "config_format"),
    [
        ([], None, "toml"),  # serve: the config printed at start-up, as TOML
        (["--print-config"], "toml", "toml"),  # print it and exit
        (["--print-config", "json"], "json", "toml"),
        (["--config-format", "json"], None, "json"),  # serve, printing it as JSON
    ],
)
def test_serve_print_config_is_print_and_exit_and_config_format_the_start_up_print(
    flags, print_config, config_format
):
    args = build_parser().parse_args(["serve", *flags])
    assert (args.print_config, args.config_format) == (print_config, config_format)


def test_serve_world_size_is_a_positive_count(capsys):
    assert build_parser().parse_args(["serve", "--world-size", "2"]).world_size == 2
    assert build_parser().parse_args(["serve"]).world_size is None  # [batching] world_size
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(["serve", "--world-size", "0"])
    assert usage.value.code == 2
    assert "must be an integer >= 1, got 0" in capsys.readouterr().err


def test_the_listening_line_says_what_security_is_on():
    from rlfeed.service.config.security import SecurityConfig

    assert SecurityConfig().summary() == "TLS off, mTLS off, tokens off"
    secured = SecurityConfig(tls_cert="s.pem", tls_key="s.key", auth_token_file="tokens.txt")
    assert secured.summary() == "TLS on, mTLS off, tokens on"
    mutual = SecurityConfig(tls_cert="s.pem", tls_key="s.key", tls_client_ca="ca.pem")
    assert mutual.summary() == "TLS on, mTLS on, tokens off"
