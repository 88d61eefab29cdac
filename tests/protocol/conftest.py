"""Fixtures shared by the protocol tests."""

from __future__ import annotations

import pytest

from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer
from tests.protocol.swarm_keys import two_labs


@pytest.fixture
def swarm() -> tuple[Signer, Signer, Signer, SwarmManifest]:
    """A certified swarm of two labs: (founder, lab A's authority, lab B's, the signed manifest)."""
    return two_labs()
