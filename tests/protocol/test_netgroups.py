"""Per-address caps over IPv6 prefixes and the network groups of routing diversity (pure)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol.dht.netgroups import PrefixCounts, counted_prefixes, diversity_group, sender_key


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


# ── sender_key: the one key a sender's address is counted under ─────────────────────────────

_V6 = st.integers(min_value=0, max_value=(1 << 128) - 1).map(ipaddress.IPv6Address)
_V4 = st.integers(min_value=0, max_value=(1 << 32) - 1).map(ipaddress.IPv4Address)
_ZONE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), _V4.map(str), _V6.map(str)))
def test_sender_key_is_the_narrowest_counted_prefix_and_is_bounded(text: str) -> None:
    key = sender_key(text)
    assert counted_prefixes(text)[0] == (key, 1)
    assert len(key) <= 64
    assert sender_key(key) == key  # a key counts as itself: idempotent


@settings(max_examples=300, deadline=None)
@given(_V4)
def test_ipv4_counts_as_itself_also_when_mapped(v4: ipaddress.IPv4Address) -> None:
    mapped = ipaddress.IPv6Address((0xFFFF << 32) | int(v4))
    assert sender_key(str(v4)) == sender_key(str(mapped)) == str(v4)
    assert counted_prefixes(str(mapped)) == [(str(v4), 1)]


@settings(max_examples=300, deadline=None)
@given(_V6, st.integers(min_value=0, max_value=(1 << 64) - 1), _ZONE)
@example(ipaddress.IPv6Address("::"), 0xFFFF_0000_0000, "eth0")  # same_64 = ::ffff:0.0.0.0
def test_ipv6_counts_by_its_64_whatever_its_host_bits_and_zone(
    v6: ipaddress.IPv6Address, host: int, zone: str
) -> None:
    if v6.ipv4_mapped is not None:
        return
    same_64 = ipaddress.IPv6Address((int(v6) >> 64 << 64) | host)
    if same_64.ipv4_mapped is not None:
        return  # ::/64 holds ::ffff:0:0/96, whose addresses are IPv4 peers and count as such
    key = sender_key(str(v6))
    assert key == sender_key(str(same_64)) == sender_key(f"{same_64}%{zone}")
    assert key == str(ipaddress.IPv6Network((v6, 64), strict=False))
    other_64 = ipaddress.IPv6Address(int(v6) ^ (1 << 64))
    if other_64.ipv4_mapped is None:
        assert sender_key(str(other_64)) != key


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=300).filter(lambda t: _not_ip(t)))
def test_other_text_is_cut_to_64_characters(text: str) -> None:
    assert sender_key(text) == text[:64]


def _not_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return True
    return False
