"""``atoll local`` prints each peer's status page as the peer starts listening."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from node.config import RunConfig
from node.run.local import LocalSwarm, PeerProcess

pytestmark = pytest.mark.timeout(30)


class _Lines:
    """A peer process's stdout: the JSON lines it printed."""

    def __init__(self, *events: dict[str, Any]) -> None:
        self.lines = [json.dumps(e).encode() + b"\n" for e in events]

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._each()

    async def _each(self) -> AsyncIterator[bytes]:
        for line in self.lines:
            yield line


class _Proc:
    def __init__(self, stdout: _Lines) -> None:
        self.stdout, self.returncode = stdout, 0


@pytest.mark.parametrize("quiet", [False, True])
async def test_each_peer_page_is_printed_when_it_listens(
    tmp_path: Path, quiet: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    swarm = LocalSwarm(RunConfig(peers=2), tmp_path, quiet=quiet)
    for index, port in ((0, 41001), (1, 41002)):
        listening = {
            "event": "listening",
            "index": index,
            "url": f"http://127.0.0.1:{port}",
            "peer_id": "ab",
        }
        peer = PeerProcess(index, _Proc(_Lines(listening)), tmp_path / f"peer{index}.log")  # type: ignore[arg-type]
        await swarm.read(peer)
        assert peer.url == f"http://127.0.0.1:{port}"
    printed = capsys.readouterr().out.splitlines()
    expected = ["peer 0: http://127.0.0.1:41001/", "peer 1: http://127.0.0.1:41002/"]
    assert printed == ([] if quiet else expected)
