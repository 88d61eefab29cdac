"""Fetching artifacts by hash from peers (``ArtifactFetcher``): resumable, verified, bounded.

A joiner asks its initial peers for each artifact it lacks, one range of ``ARTIFACT_PIECE``
bytes at a time, appending to ``partial/<hash>`` in the store (a download cut off resumes from
the bytes it has); a peer that lacks the artifact names members that may hold it, which are asked
next (at most ``max_sources`` addresses in all). A whole download is hashed before it enters the
store: bytes that do not match their name are deleted and the next peer is asked. Nothing
fetched is ever executed. Every failure is one line naming the artifact and what each peer said.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from node.state.artifact_serve import ARTIFACT_PIECE
from node.state.artifacts import ArtifactError, ArtifactStore
from protocol.errors import DecodeError
from protocol.wire.membership import bare_origin

__all__ = ["ArtifactFetcher", "Get", "MAX_ARTIFACT_BYTES"]

log = logging.getLogger("atoll.artifacts")

MAX_ARTIFACT_BYTES = 64 << 30  # the largest artifact a peer fetches (a model's weights)
# (url, extra headers) -> (HTTP status, body); raises OSError when no answer came
Get = Callable[[str, dict[str, str]], tuple[int, bytes]]


class ArtifactFetcher:
    """Fills ``store`` with artifacts fetched through ``get`` (see the module docstring)."""

    def __init__(
        self,
        store: ArtifactStore,
        get: Get,
        *,
        piece: int = ARTIFACT_PIECE,
        max_bytes: int = MAX_ARTIFACT_BYTES,
        max_sources: int = 16,
    ) -> None:
        self.store, self.get = store, get
        self.piece, self.max_bytes, self.max_sources = piece, max_bytes, max_sources
        self.fetched: dict[str, str] = {}  # hash -> the address it came from
        self.bytes_received = 0

    def ensure(self, digests: Iterable[str], sources: list[str]) -> dict[str, Path]:
        """Every artifact of ``digests`` held and verified (fetched from ``sources`` and the peers
        they name if missing). Raises ``ArtifactError`` with one line for the first that fails."""
        out: dict[str, Path] = {}
        for digest in digests:
            if not self.store.has(digest):
                self.fetch(digest, sources)
            out[digest] = self.store.open_verified(digest)
        return out

    def fetch(self, digest: str, sources: list[str]) -> Path:
        """``digest`` from the first peer that has it whole and right; raises ``ArtifactError``."""
        queue, seen = collections.deque(s.rstrip("/") for s in sources), set[str]()
        said: list[str] = []
        while queue and len(seen) < self.max_sources:
            base = queue.popleft()
            if base in seen:
                continue
            seen.add(base)
            try:
                path = self._from(base, digest, queue)
            except ArtifactError as exc:
                said.append(f"{base}: {exc}")
                log.warning("artifact %s from %s: %s", digest[:16], base, exc)
                continue
            self.fetched[digest] = base
            log.info(
                "artifact %s fetched from %s (%d bytes)", digest[:16], base, path.stat().st_size
            )
            return path
        raise ArtifactError(
            f"artifact {digest[:16]} could not be fetched: "
            + ("; ".join(said) if said else "no peer to ask (pass --initial-peers)")
        )

    def _from(self, base: str, digest: str, queue: collections.deque[str]) -> Path:
        """Fetch ``digest`` from ``base`` piece by piece into the partial file; then verify it."""
        part = self.store.partial(digest)
        url = f"{base}/v1/artifacts/{digest}"
        while True:
            have = part.stat().st_size if part.exists() else 0
            try:
                status, body = self.get(url, {"Range": f"bytes={have}-{have + self.piece - 1}"})
            except OSError as exc:
                raise ArtifactError(f"no answer ({exc})") from None
            if status == 404:
                self._hints(body, queue)
                raise ArtifactError("does not hold it")
            if status == 416 and have > 0:
                break  # the partial file holds every byte already
            if status not in (200, 206):
                raise ArtifactError(f"answered {status}: {_reason(body)}")
            if status == 200 and have > 0:
                part.unlink()  # a whole answer to a ranged ask: start again from it
                have = 0
            if have + len(body) > self.max_bytes:
                part.unlink(missing_ok=True)
                raise ArtifactError(f"past {self.max_bytes} bytes, the most an artifact may be")
            with part.open("ab") as f:
                f.write(body)
            self.bytes_received += len(body)
            if status == 200 or len(body) < self.piece:
                break
        return self.store.adopt_partial(digest)

    def _hints(self, body: bytes, queue: collections.deque[str]) -> None:
        """Queue the member addresses a 404 names (bare origins only, at most ``max_sources``)."""
        try:
            peers = json.loads(body).get("peers", [])
        except (ValueError, AttributeError, RecursionError):
            return
        if not isinstance(peers, list):
            return
        for url in peers[: self.max_sources]:
            try:
                queue.append(bare_origin(url))
            except DecodeError:
                continue


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body).get("reason"))[:200]
    except (ValueError, AttributeError, RecursionError):
        return body[:200].decode(errors="replace")
