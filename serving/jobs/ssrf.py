"""SSRF guard for webhook destinations.

A URL is refused unless it is http(s) and every address its host resolves to is public:
private, loopback, link-local (which holds the cloud metadata address 169.254.169.254),
unspecified, multicast and reserved ranges are refused unless a network of the allow list
contains the address. Checked when a job is submitted and again before every delivery (the
name may resolve elsewhere by then); redirects are never followed.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from omnistage.errors import InvalidRequestError

METADATA_ADDRESSES = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}


class UnsafeDestinationError(InvalidRequestError):
    code = "webhook_url_not_allowed"

    def __init__(self, message: str):
        super().__init__(message, param="webhook.url")


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


def check_destination(url: str, allow: list[ipaddress._BaseNetwork]) -> None:
    """Raise UnsafeDestinationError (400, param webhook.url) unless `url` may be called."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeDestinationError(f"webhook.url must be an http(s) URL with a host, not {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, ValueError) as exc:
        raise UnsafeDestinationError(f"webhook.url host {parts.hostname!r} does not resolve: {exc}") from exc
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if _is_internal(address) and not any(address in net for net in allow):
            raise UnsafeDestinationError(
                f"webhook.url resolves to {address}, a private, loopback, link-local or metadata address; "
                "the server's webhook allow list (OMNISTAGE_WEBHOOK_ALLOW) does not include it"
            )
