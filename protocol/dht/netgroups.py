"""Which addresses count as one sender: per-address caps over IPv6 prefixes, and the network
groups that keep a routing bucket diverse.

**One sender key.** ``sender_key`` is the one function that says under which key a sender's
address is counted, everywhere (record fair shares, Store and manifest-post rate limits, auth
replays, connections, bodies, replies, long-polls): an IPv4 address as itself (a /32; also when
IPv4-mapped), an IPv6 address by its /64, zone ids stripped, and anything that is not an IP
address as its text cut to 64 characters (a bounded key whatever the peer sends).

**Per-address caps.** An IPv4 address is one sender. IPv6 hands whole prefixes to one party: a
host commonly gets a /64, a subscriber a /56 (RFC 6177's recommendation for homes), a site or a
rented server a /48. Counting IPv6 only per /64 let one /56 count as 256 senders and one /48 as
65,536, each with the full cap. ``counted_prefixes`` gives the keys an address is counted under,
narrowest first, and ``PREFIX_SHARES`` how many times the cap each may hold: a /64 the cap (what
one IPv4 address gets), the /56 around it 4 times the cap, the /48 16 times. So a party with a
/48 holds at most 16 caps' worth, and honest hosts that share a /56 or /48 with others still
have room: a few caps, not one.

**Bucket diversity** (Kademlia hardening: S/Kademlia, Baumgart & Mies 2007; libp2p's
``peerdiversity`` filter). An eclipse attacker places many ids near a key (the swarm's members
key) from a few networks. ``diversity_group`` names the network a contact's address is in (an
IPv4 /24, an IPv6 /48) and ``protocol.dht.routing.RoutingTable`` keeps at most
``max_per_group`` contacts of one group in a bucket. Addresses that are not global (loopback,
private, link-local, documentation ranges) and host names have no group: a local or LAN swarm
runs every peer from one address, and diversity would only cut it off.

Pure: strings in, strings out.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import Counter

__all__ = [
    "PREFIX_SHARES",
    "PrefixCounts",
    "counted_prefixes",
    "diversity_group",
    "sender_key",
]

PREFIX_SHARES = {64: 1, 56: 4, 48: 16}  # IPv6 prefix length -> how many caps it may hold
V4_GROUP, V6_GROUP = 24, 48


@functools.lru_cache(maxsize=4096)  # every connection and request asks; the same few addresses
def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        addr = ipaddress.ip_address(text.partition("%")[0])  # no zone id
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def sender_key(ip: str) -> str:
    """The key ``ip`` is counted under (see the module docstring): an IPv4 address, an IPv6 /64
    (no zone id), or other text cut to 64 characters. The narrowest of ``counted_prefixes``."""
    addr = _ip(ip)
    if addr is None:
        return ip[:64]
    if isinstance(addr, ipaddress.IPv4Address):
        return str(addr)
    return str(ipaddress.IPv6Network((addr, 64), strict=False))


def counted_prefixes(ip: str) -> list[tuple[str, int]]:
    """(key, share) pairs ``ip`` counts under, narrowest first, the first always
    ``(sender_key(ip), 1)``: only that for IPv4 (also IPv4-mapped) and for anything that is not
    an IP address; for IPv6 its /64, /56 and /48 with their ``PREFIX_SHARES``."""
    addr = _ip(ip)
    if not isinstance(addr, ipaddress.IPv6Address):
        return [(sender_key(ip), 1)]
    return [
        (str(ipaddress.IPv6Network((addr, bits), strict=False)), share)
        for bits, share in PREFIX_SHARES.items()
    ]


def _host(address: str) -> str:
    """The host of ``scheme://host:port/path`` (IPv6 in brackets), or of a bare host[:port]."""
    netloc = address.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    if netloc.startswith("["):
        return netloc[1 : netloc.find("]")] if "]" in netloc else ""
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def diversity_group(address: str) -> str | None:
    """The network of a contact's address (a URL or a bare host): its IPv4 /24 or IPv6 /48; None
    for a non-global address or a host name (see the module docstring)."""
    addr = _ip(_host(address))
    if addr is None or not addr.is_global:
        return None
    bits = V4_GROUP if isinstance(addr, ipaddress.IPv4Address) else V6_GROUP
    return str(ipaddress.ip_network((addr, bits), strict=False))


class PrefixCounts:
    """Things held per sender address (long-polls, bodies being read) under a cap of ``cap`` per
    address: an IPv6 sender is held to it at its /64 and to ``PREFIX_SHARES`` times it at its /56
    and /48 (``counted_prefixes``). ``refusal`` says why one more would go past a cap."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, not {cap}")
        self.cap = cap
        self.held: Counter[str] = Counter()

    def refusal(self, ip: str) -> str | None:
        """None when ``ip`` may hold one more; else which prefix is full."""
        for key, share in counted_prefixes(ip):
            if self.held[key] >= self.cap * share:
                return f"{self.held[key]} held from {key} (at most {self.cap * share})"
        return None

    def add(self, ip: str) -> None:
        for key, _ in counted_prefixes(ip):
            self.held[key] += 1

    def remove(self, ip: str) -> None:
        for key, _ in counted_prefixes(ip):
            self.held[key] -= 1
            if self.held[key] <= 0:
                del self.held[key]
