"""What a sidecar address means (`client/addressing.py`): which target gRPC dials, when
calls are spread round-robin, which name TLS checks, and errors that name the bad entry."""

from __future__ import annotations

import pytest
from rlfeed.client.addressing import ROUND_ROBIN_OPTION, parse_address, tls_name


@pytest.mark.parametrize(
    ("address", "target", "balanced", "hosts"),
    [
        # One front-end at an IP: dialled as before, gRPC's default policy.
        ("127.0.0.1:50051", "127.0.0.1:50051", False, ("127.0.0.1",)),
        ("[::1]:50051", "[::1]:50051", False, ("::1",)),
        # A name may resolve to several front-ends (a headless Service).
        ("sidecar.internal:7000", "sidecar.internal:7000", True, ("sidecar.internal",)),
        # A list of IPs becomes gRPC's multi-address target of its family.
        (
            "10.0.0.5:50051,10.0.0.6:50052",
            "ipv4:10.0.0.5:50051,10.0.0.6:50052",
            True,
            ("10.0.0.5", "10.0.0.6"),
        ),
        (" 10.0.0.5:1 , 10.0.0.5:2 ", "ipv4:10.0.0.5:1,10.0.0.5:2", True, ("10.0.0.5",)),
        ("[fd00::5]:1,[fd00::6]:1", "ipv6:[fd00::5]:1,[fd00::6]:1", True, ("fd00::5", "fd00::6")),
        # gRPC target URIs are dialled as given.
        (
            "dns:///rlfeed-frontends.ns.svc:50051",
            "dns:///rlfeed-frontends.ns.svc:50051",
            True,
            ("rlfeed-frontends.ns.svc",),
        ),
        ("dns://10.0.0.2:53/fe.svc:1", "dns://10.0.0.2:53/fe.svc:1", True, ("fe.svc",)),
        (
            "ipv4:10.0.0.5:1,10.0.0.6:1",
            "ipv4:10.0.0.5:1,10.0.0.6:1",
            True,
            ("10.0.0.5", "10.0.0.6"),
        ),
        ("ipv6:[::1]:1,[::1]:2", "ipv6:[::1]:1,[::1]:2", True, ("::1",)),
        ("unix:/run/rlfeed.sock", "unix:/run/rlfeed.sock", False, ()),
        ("xds:///rlfeed", "xds:///rlfeed", False, ()),
    ],
)
def test_each_address_form_dials_its_target_round_robin_where_it_may_name_several(
    address, target, balanced, hosts
):
    parsed = parse_address(address)
    assert (parsed.target, parsed.balanced, parsed.hosts) == (target, balanced, hosts)
    assert parsed.address == address.strip()
    assert parsed.channel_options == ([ROUND_ROBIN_OPTION] if balanced else [])


@pytest.mark.parametrize(
    ("address", "named"),
    [
        ("", "empty"),
        ("localhost", "'localhost' must be HOST:PORT"),
        (":50051", "':50051' must be HOST:PORT"),
        ("host:http", "'host:http' must be HOST:PORT"),
        ("h:70000", "'h:70000' must be HOST:PORT"),
        ("::1:50051", r"write an IPv6 address in brackets, \[::1\]:50051"),
        ("[fe-1]:5", r"\[fe-1\] is not an IPv6 address"),
        ("dns:///fe.svc", "'fe.svc' must be HOST:PORT"),
        ("dns://10.0.0.2", "must be dns:///HOST:PORT"),
        ("unix:", "needs a path"),
        # In a list, the message names the entry at fault.
        ("10.0.0.5:1,10.0.0.6", "'10.0.0.6' must be HOST:PORT"),
        ("10.0.0.5:1,,10.0.0.6:1", "an empty entry"),
        ("10.0.0.5:1,10.0.0.6:0", "'10.0.0.6:0' must be HOST:PORT"),
        ("10.0.0.5:1,fe-2.internal:1", r"'fe-2.internal:1' is a host name.*dns:///fe-2.internal:1"),
        ("10.0.0.5:1,[::1]:1", r"'\[::1\]:1' is IPv6 but the list is IPv4"),
        ("ipv4:10.0.0.5:1,[::1]:1", r"'\[::1\]:1' is IPv6 but the list is IPv4"),
        ("ipv6:[::1]:1,10.0.0.5:1", "'10.0.0.5:1' is IPv4 but the list is IPv6"),
        ("10.0.0.5:1, 10.0.0.5:1", "'10.0.0.5:1' is listed twice"),
        ("[::1]:1,[0:0::1]:1", r"'\[0:0::1\]:1' is listed twice"),  # one address, two spellings
    ],
)
def test_a_bad_address_is_refused_naming_the_entry(address, named):
    with pytest.raises(ValueError, match=named) as refused:
        parse_address(address)
    assert str(refused.value).startswith("sidecar address")


def test_tls_checks_the_given_name_else_the_dialled_host_else_asks_for_one():
    assert tls_name(parse_address("sidecar.internal:1"), "") == ""  # gRPC's default: the host
    assert tls_name(parse_address("dns:///fe.svc:1"), "") == ""
    assert tls_name(parse_address("10.0.0.5:1,10.0.0.6:1"), "fe.svc") == "fe.svc"
    # gRPC would check the whole list ("10.0.0.5:1,10.0.0.5:2") as the name: the one host.
    assert tls_name(parse_address("10.0.0.5:1,10.0.0.5:2"), "") == "10.0.0.5"
    with pytest.raises(ValueError, match=r"set tls_server_name \(RLFEED_TLS_SERVER_NAME\)"):
        tls_name(parse_address("10.0.0.5:1,10.0.0.6:1"), "")
