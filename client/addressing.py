"""What a sidecar address means: one front-end, a list of them, or a gRPC target.

    address                                    dialled as                       balanced
    10.0.0.5:50051, [fd00::5]:50051            as given                         no
    sidecar.internal:50051                     as given (gRPC's dns resolver)   yes
    10.0.0.5:50051,10.0.0.6:50051              ipv4:10.0.0.5:50051,10.0.0.6:... yes
    [fd00::5]:50051,[fd00::6]:50051            ipv6:[fd00::5]:50051,...         yes
    dns:///rlfeed-frontends.ns.svc:50051       as given                         yes
    ipv4:a:p,b:p  ipv6:[a]:p,[b]:p             as given                         yes
    unix:/run/rlfeed.sock (any other scheme)   as given                         no

Any front-end of a sidecar accepts any rollout (the scheduler actor drops duplicates) and
serves any (step, rank) (front-ends forward to each other), so a client may spread its
calls over all of them. A "balanced" target, one that may resolve to several front-ends,
gets gRPC's `round_robin` policy: each unary call (GetBatch, AckSteps, SampleTasks,
SubmitRolloutBatch) goes to the next READY front-end, a stream stays on the one it
started on, and a front-end that goes away drops out of the rotation until it answers
again; the channel's reconnect backoff (`transport.RECONNECT_CHANNEL_OPTIONS`) applies to
each front-end's connection. gRPC's default, `pick_first`, would send everything to the
first address that answers.

A list takes IP addresses only. A list of host names would have to be resolved here, once:
a front-end that comes back on another address (a rescheduled pod) would never be found
again, and gRPC's Python API has no resolver for a fixed list of names. One name that
resolves to every front-end (`dns:///name:port`; on Kubernetes a headless Service) is
looked up again as front-ends come and go, so a list naming a host is refused with that
advice.

TLS: with several hosts there is no one name to check the certificates against; the
client's `tls_server_name` (RLFEED_TLS_SERVER_NAME) names it (`client/auth.py`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

ROUND_ROBIN_OPTION = ("grpc.lb_policy_name", "round_robin")
"""The channel argument of a balanced target. A channel argument, not a service config,
so a service config the resolver or a later option brings (retries) still composes."""

# Schemes whose targets are taken as given (gRPC's resolvers); `dns`, `ipv4` and `ipv6`
# may name several front-ends.
_BALANCED_SCHEMES = ("dns", "ipv4", "ipv6")
_SINGLE_SCHEMES = ("unix", "unix-abstract", "vsock")


@dataclass(frozen=True, kw_only=True)
class SidecarTarget:
    """A parsed sidecar address (module docstring)."""

    address: str
    """The address as given, stripped of spaces: what messages call the sidecar."""
    target: str
    """What gRPC dials."""
    balanced: bool
    """May resolve to several front-ends: the channel uses `round_robin`."""
    hosts: tuple[str, ...]
    """The distinct hosts named (IP literals without brackets, or a name); empty for a
    target without a host (unix:). More than one: TLS needs `tls_server_name`."""

    @property
    def channel_options(self) -> list[tuple[str, str]]:
        """The channel arguments this target needs (the load-balancing policy)."""
        return [ROUND_ROBIN_OPTION] if self.balanced else []


def _fail(address: str, problem: str) -> ValueError:
    return ValueError(f"sidecar address {address!r}: {problem}")


def _split_host_port(entry: str, address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; the host unbracketed."""
    host, colon, port = entry.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _fail(address, f"{entry!r} must be HOST:PORT (port 1-65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if _ip_version(host) != 6:
            raise _fail(address, f"{entry!r}: [{host}] is not an IPv6 address")
    elif ":" in host:
        raise _fail(address, f"{entry!r}: write an IPv6 address in brackets, [{host}]:{port}")
    return host, int(port)


def _ip_version(host: str) -> int | None:
    """4 or 6 for an IP literal, None for a host name."""
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def _scheme(address: str) -> str | None:
    """The gRPC scheme `address` starts with ("dns", "unix", ...), None for host:port."""
    head, colon, _ = address.partition(":")
    return head if colon and head in (*_BALANCED_SCHEMES, *_SINGLE_SCHEMES) else None


def _parse_uri(address: str, scheme: str) -> SidecarTarget:
    rest = address[len(scheme) + 1 :]
    if scheme in _SINGLE_SCHEMES:
        if not rest:
            raise _fail(address, f"{scheme}: needs a path")
        return SidecarTarget(address=address, target=address, balanced=False, hosts=())
    if scheme == "dns":
        # dns:host:port, dns:///host:port, or dns://resolver-host/host:port
        if rest.startswith("//"):
            _, slash, rest = rest[2:].partition("/")
            if not slash:
                raise _fail(address, "must be dns:///HOST:PORT")
        host, _ = _split_host_port(rest, address)
        return SidecarTarget(address=address, target=address, balanced=True, hosts=(host,))
    version = 4 if scheme == "ipv4" else 6
    hosts = _ip_list(address, rest.split(","), version)
    return SidecarTarget(address=address, target=address, balanced=True, hosts=hosts)


def _ip_list(address: str, entries: list[str], version: int | None) -> tuple[str, ...]:
    """The distinct hosts of IP "host:port" `entries`, all of one IP version (`version`,
    or that of the first entry when None); ValueError naming the first bad entry."""
    seen: set[tuple[str, int]] = set()
    hosts: dict[str, None] = {}
    for entry in entries:
        entry = entry.strip()
        if not entry:
            raise _fail(address, "an empty entry in the list (a stray comma?)")
        host, port = _split_host_port(entry, address)
        found = _ip_version(host)
        if found is None:
            raise _fail(
                address,
                f"{entry!r} is a host name; a list takes IP addresses only (names in a list "
                f"would be resolved once, so a front-end that moves would never be found "
                f"again): give one name that resolves to every front-end, "
                f"dns:///{host}:{port} (on Kubernetes, a headless Service), or the "
                f"front-ends' IP addresses",
            )
        version = version or found
        if found != version:
            raise _fail(
                address,
                f"{entry!r} is IPv{found} but the list is IPv{version} (gRPC takes one "
                f"family per list)",
            )
        key = (str(ipaddress.ip_address(host)), port)
        if key in seen:
            raise _fail(address, f"{entry!r} is listed twice")
        seen.add(key)
        hosts[host] = None
    return tuple(hosts)


def host_is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address, IPv6 without brackets) is this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> SidecarTarget:
    """`text` as a sidecar target (module docstring). ValueError naming the address and,
    in a list, the bad entry: no port (gRPC would dial 443), a port outside 1-65535, a
    host name in a list, mixed IP families, an entry listed twice."""
    address = text.strip()
    if not address:
        raise ValueError("sidecar address: empty (expected HOST:PORT)")
    scheme = _scheme(address)
    if scheme is not None:
        return _parse_uri(address, scheme)
    if "," in address:
        entries = address.split(",")
        hosts = _ip_list(address, entries, None)
        family = "ipv6" if _ip_version(hosts[0]) == 6 else "ipv4"
        target = f"{family}:" + ",".join(entry.strip() for entry in entries)
        return SidecarTarget(address=address, target=target, balanced=True, hosts=hosts)
    if ":/" in address:
        # Another scheme (xds:///..., a custom resolver): gRPC's to interpret.
        return SidecarTarget(address=address, target=address, balanced=False, hosts=())
    host, _ = _split_host_port(address, address)
    return SidecarTarget(
        address=address, target=address, balanced=_ip_version(host) is None, hosts=(host,)
    )


def tls_name(target: SidecarTarget, server_name: str) -> str:
    """The name to check the sidecar's certificates against: `server_name` when given
    (`tls_server_name`), else "" (gRPC's default, the dialled host) except for an IP
    list, whose gRPC authority is the whole list: its one host if all entries share it,
    else a ValueError asking for `tls_server_name`."""
    if server_name or not target.target.startswith(("ipv4:", "ipv6:")):
        return server_name
    if len(target.hosts) == 1:
        return target.hosts[0]
    raise ValueError(
        f"sidecar address {target.address!r}: with TLS, front-ends on several hosts need "
        f"one name to check their certificates against: set tls_server_name "
        f"(RLFEED_TLS_SERVER_NAME) to a name every front-end's certificate carries"
    )
