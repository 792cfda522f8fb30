"""Network addresses in settings: CIDR networks, and destinations `ADDR[/PREFIX][:PORT]`."""

from __future__ import annotations

import ipaddress

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_destination(entry: str) -> tuple[Network, int]:
    """`ADDR[/PREFIX][:PORT]`, IPv6 in brackets when a port follows (`[::1]:5000`); port 0 = any."""
    address, port = entry, "0"
    if entry.startswith("["):
        address, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":") or "0"
    elif entry.count(":") == 1:
        address, port = entry.split(":")
    try:
        network, number = ipaddress.ip_network(address, strict=False), int(port)
    except ValueError:
        raise ValueError(f"{entry!r} is not ADDR[/PREFIX][:PORT]") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{entry!r}: port {number} is out of range")
    return network, number


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine: `localhost`, 127.0.0.0/8 or ::1
    (`[::1]` too). Any other name or address, `0.0.0.0` and `::` among them, may be reached from
    elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:  # a host name: where it resolves is not known here
        return False
