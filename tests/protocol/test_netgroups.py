"""Per-address caps over IPv6 prefixes and the network groups of routing diversity (pure)."""

from __future__ import annotations

import pytest

from protocol.dht.netgroups import PrefixCounts, counted_prefixes, diversity_group


def test_ipv6_counts_at_its_64_56_and_48_and_ipv4_as_itself() -> None:
    assert counted_prefixes("2a00:1450:4001:812::1") == [
        ("2a00:1450:4001:812::/64", 1),
        ("2a00:1450:4001:800::/56", 4),
        ("2a00:1450:4001::/48", 16),
    ]
    assert counted_prefixes("203.0.113.7") == [("203.0.113.7", 1)]
    assert counted_prefixes("::ffff:203.0.113.7") == [("203.0.113.7", 1)]  # IPv4-mapped is IPv4
    assert counted_prefixes("fe80::1%eth0")[0] == ("fe80::/64", 1)
    assert counted_prefixes("unknown") == [("unknown", 1)]


def test_a_56_cannot_multiply_its_share_by_changing_its_64() -> None:
    """Counted per /64 only, one /56 was 256 senders with a full cap each and a /48 65,536."""
    caps = PrefixCounts(cap=8)
    held = 0
    for sub in range(256):  # every /64 of one /56
        ip = f"2a00:1450:4001:8{sub:02x}::1"
        while caps.refusal(ip) is None:
            caps.add(ip)
            held += 1
    assert held == 4 * 8  # the /56's share, not 256 x 8
    assert "2a00:1450:4001:800::/56" in (caps.refusal("2a00:1450:4001:8ff::2") or "")
    assert caps.refusal("2a00:1450:4001:900::1") is None  # the next /56 of the same /48 has room
    assert caps.refusal("203.0.113.1") is None
    caps.remove("2a00:1450:4001:800::1")
    assert caps.refusal("2a00:1450:4001:8ff::2") is None
    with pytest.raises(ValueError):
        PrefixCounts(0)


@pytest.mark.parametrize(
    "address, group",
    [
        ("https://8.8.8.8:7000", "8.8.8.0/24"),
        ("http://[2a00:1450:4001:812::1]:7000/v1/dht", "2a00:1450:4001::/48"),
        ("8.8.4.4", "8.8.4.0/24"),
        ("https://127.0.0.1:7000", None),  # loopback: a local swarm
        ("https://10.1.2.3:7000", None),  # private
        ("https://[fd00::1]:7000", None),  # unique local
        ("https://peer.example.org:7000", None),  # a host name: no group
        ("https://[::ffff:8.8.8.8]:1", "8.8.8.0/24"),
    ],
)
def test_diversity_groups(address: str, group: str | None) -> None:
    assert diversity_group(address) == group
