"""``atoll status --serve`` against a real certified peer (HTTPS, every request's certificate
checked): an unsigned GET of the peer's ``/metrics`` is refused, while the same GET through the
local proxy returns the metrics, the page and its JSON; a key the swarm does not know gets the
peer's reason; a ``Host`` that is not the proxy's is refused. The last test runs the command line
itself as a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from node.config import RunConfig
from node.dht.swarm import SwarmCredentials
from node.peer import PeerNode
from node.status.serve import PeerUnavailable, StatusProxy
from node.wire.identity import save_certificate, save_key, save_manifest
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer
from tests.integration.swarms import ENV
from tests.node.fakes import tiny_model, tiny_plan

pytestmark = pytest.mark.timeout(90)


def _key() -> Signer:
    return Signer.from_seed(os.urandom(32))


class Swarm:
    """A certified swarm: its founder, one lab's authority and the manifest naming it."""

    def __init__(self, admission: str = "certified") -> None:
        self.founder, self.lab = _key(), _key()
        m = SwarmManifest(
            name="ops", founder=self.founder.public_key, admission=admission, created=time.time()
        )
        self.manifest = m.with_authority("lab-a", self.lab.public_key).signed(self.founder)

    def cert(self, who: Signer) -> Certificate:
        now = time.time()
        return Certificate.issue(
            self.lab,
            manifest=self.manifest,
            subject=who.public_key,
            roles=("learner", "owner"),
            not_before=now - 60,
            not_after=now + 3600,
        )


@pytest.fixture
async def peer(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Swarm, PeerNode]]:
    """A certified peer serving HTTPS on 127.0.0.1 (its board, metrics and admission real); an
    open swarm's (plain HTTP) when the test is parametrized with ``"open"``."""
    swarm, who = Swarm(getattr(request, "param", "certified")), _key()
    model = tiny_model()
    node = PeerNode(
        RunConfig(max_tokens_per_step=64, swarm=swarm.manifest.swarm_id),
        who,
        model,
        tiny_plan(model),
        credentials=SwarmCredentials(swarm.manifest, who, swarm.cert(who)),
    )
    await node.transport.start()
    try:
        yield swarm, node
    finally:
        await node.transport.close()


async def _get(url: str, **headers: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(url, ssl=False, headers=headers, allow_redirects=False) as resp,
    ):
        return resp.status, await resp.read()


async def test_the_proxy_signs_what_an_unsigned_request_cannot_read(
    peer: tuple[Swarm, PeerNode],
) -> None:
    swarm, node = peer
    assert node.transport.url.startswith("https://")
    status, body = await _get(node.transport.url + "/metrics")
    assert status == 403 and b"atoll_" not in body  # a browser or Prometheus, unsigned
    operator = _key()
    proxy = StatusProxy(
        node.transport.url,
        swarm=swarm.manifest.swarm_id,
        signer=operator,
        cert=swarm.cert(operator),
    )
    url = await proxy.start()
    try:
        assert url.startswith("http://127.0.0.1:") and proxy.peer_id == node.signer.peer_id
        status, metrics = await _get(url + "metrics")
        assert status == 200 and b"atoll_bytes_sent_total" in metrics
        status, board = await _get(url + "v1/status/board")
        assert status == 200 and json.loads(board)["peer_id"] == node.signer.peer_id.hex()
        status, page = await _get(url)
        assert status == 200 and b'<script src="/status.js">' in page
        status, _ = await _get(url + "metrics", Host="rebound.example:80")
        assert status == 421  # a page elsewhere, through DNS rebinding
    finally:
        await proxy.close()


@pytest.mark.parametrize("peer", ["open"], indirect=True)
async def test_over_plain_http_the_peer_id_comes_from_its_signed_status(
    peer: tuple[Swarm, PeerNode],
) -> None:
    swarm, node = peer
    assert node.transport.url.startswith("http://")
    operator = _key()
    proxy = StatusProxy(
        node.transport.url, swarm=swarm.manifest.swarm_id, signer=operator, cert=None
    )
    url = await proxy.start()
    try:
        assert proxy.peer_id == node.signer.peer_id
        status, metrics = await _get(url + "metrics")
        assert status == 200 and b"atoll_bytes_sent_total" in metrics
    finally:
        await proxy.close()


async def test_a_key_the_swarm_does_not_know_gets_the_peers_reason(
    peer: tuple[Swarm, PeerNode],
) -> None:
    swarm, node = peer
    proxy = StatusProxy(node.transport.url, swarm=swarm.manifest.swarm_id, signer=_key(), cert=None)
    with pytest.raises(PeerUnavailable, match="answered 403: .*certified peers only"):
        await proxy.start()


async def test_atoll_status_serve_runs_as_a_command(
    peer: tuple[Swarm, PeerNode], tmp_path: Path
) -> None:
    swarm, node = peer
    operator = _key()
    save_key(operator, tmp_path / "op.key")
    save_certificate(swarm.cert(operator), tmp_path / "op.cert")
    save_manifest(swarm.manifest, tmp_path / "swarm.toml")
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "node", "status", "--peer", node.transport.url, "--serve"),
        *("--manifest", str(tmp_path / "swarm.toml")),
        *("--key", str(tmp_path / "op.key"), "--cert", str(tmp_path / "op.cert")),
        env=ENV,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "status page at http://127.0.0.1:" in line, line
        metrics_url = line.split(" and its metrics at ")[1].split()[0]
        status, metrics = await _get(metrics_url)
        assert status == 200 and b"atoll_members" in metrics
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
