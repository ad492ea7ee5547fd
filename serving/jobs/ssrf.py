"""SSRF guard for webhook destinations.

A URL is refused unless it is http(s) and every address its host resolves to is public:
private, loopback, link-local (which holds the cloud metadata address 169.254.169.254),
unspecified, multicast and reserved ranges are refused unless a network of the allow list
contains the address. Checked when a job is submitted and again before every delivery (the
name may resolve elsewhere by then); a delivery then connects to an address that check
accepted (`pinned`), never to a second lookup's answer; redirects are never followed.

Names are looked up with the system's resolver, or with a given DNS server
(OMNISTAGE_WEBHOOK_RESOLVER, through dnspython).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit, urlunsplit

from omnistage.errors import InvalidRequestError

METADATA_ADDRESSES = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
DNS_TIMEOUT_S = 5.0


class UnsafeDestinationError(InvalidRequestError):
    code = "webhook_url_not_allowed"

    def __init__(self, message: str):
        super().__init__(message, param="webhook.url")


class Resolver:
    """Host name -> addresses: the system's resolver, or the DNS server at `server` ("host[:port]")."""

    def __init__(self, server: str | None = None):
        self.server = server
        self._dns = None
        if server:
            import dns.resolver

            host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
            self._dns = dns.resolver.Resolver(configure=False)
            self._dns.nameservers = [host]
            self._dns.port = int(port or 53)
            self._dns.lifetime = DNS_TIMEOUT_S
            self._dns.cache = None  # every check asks again: the answer may have changed

    def addresses(self, host: str, port: int) -> list[str]:
        if self._dns is None:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
            return [info[4][0] for info in infos]
        import dns.exception
        import dns.resolver

        found: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                found += [r.address for r in self._dns.resolve(host, rdtype, search=False)]
            except dns.resolver.NoAnswer:
                continue
            except dns.exception.DNSException as exc:
                raise socket.gaierror(f"{type(exc).__name__} from {self.server}: {exc}") from exc
        if not found:
            raise socket.gaierror(f"no A or AAAA record from {self.server}")
        return found


SYSTEM_RESOLVER = Resolver()


def parse_allow_list(networks: tuple[str, ...] | list[str]) -> list[ipaddress._BaseNetwork]:
    return [ipaddress.ip_network(n.strip(), strict=False) for n in networks if n.strip()]


def _is_internal(address: ipaddress._BaseAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (
        address in METADATA_ADDRESSES
        or address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_unspecified
        or address.is_multicast
        or address.is_reserved
    )


def needs_lookup(url: str) -> bool:
    """True when checking `url` asks DNS (its host is a name, not an address): a caller on an
    event loop runs that check in a thread."""
    try:
        ipaddress.ip_address((urlsplit(url).hostname or "").split("%")[0])
    except ValueError:
        return True
    return False


def check_destination(
    url: str, allow: list[ipaddress._BaseNetwork], resolver: Resolver = SYSTEM_RESOLVER
) -> list[ipaddress._BaseAddress]:
    """Raise UnsafeDestinationError (400, param webhook.url) unless `url` may be called; returns
    the addresses its host has now (IPv4 first), every one of them checked."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeDestinationError(f"webhook.url must be an http(s) URL with a host, not {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if needs_lookup(url):
            found = resolver.addresses(parts.hostname, port)
        else:
            found = [parts.hostname]
    except (socket.gaierror, ValueError) as exc:
        raise UnsafeDestinationError(f"webhook.url host {parts.hostname!r} does not resolve: {exc}") from exc
    addresses = sorted({ipaddress.ip_address(a.split("%")[0]) for a in found}, key=lambda a: a.version)
    for address in addresses:
        if _is_internal(address) and not any(address in net for net in allow):
            raise UnsafeDestinationError(
                f"webhook.url resolves to {address}, a private, loopback, link-local or metadata address; "
                "the server's webhook allow list (OMNISTAGE_WEBHOOK_ALLOW) does not include it"
            )
    return addresses


def pinned(url: str, address: ipaddress._BaseAddress) -> tuple[str, dict[str, str], str | None]:
    """`url` with its host replaced by the checked `address`: (url, headers, TLS server name)
    that reach that address while the Host header and TLS (SNI, certificate) keep the name."""
    parts = urlsplit(url)
    if not needs_lookup(url):
        return url, {}, None
    host = f"[{address}]" if address.version == 6 else str(address)
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    server_name = parts.hostname if parts.scheme == "https" else None
    return urlunsplit(parts._replace(netloc=netloc)), {"host": parts.netloc.rpartition("@")[2]}, server_name
