"""A peer's content-addressed artifact store: recipe documents, model configs, tokenizers, weights
and data files, each a file named by its SHA-256 (``protocol.wire.recipe``).

A file enters the store only through ``put_bytes``/``put_file``/``adopt_partial``, which hash it
as it is written to a temporary file and rename it into place (atomic: a reader sees the whole
artifact or none). ``open_verified`` hashes a held file again before its bytes are used, so a
file changed on disk after it was stored (one byte is enough) is refused with a one-line
reason, never loaded. The store only ever holds bytes: nothing in it is executed or unpickled.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from protocol.wire.recipe import is_sha256

__all__ = ["ArtifactError", "ArtifactStore", "default_artifact_dir", "sha256_file"]

READ_PIECE = 1 << 20


class ArtifactError(ValueError):
    """An artifact that is missing, malformed or does not match its hash (one line: what, why)."""


def default_artifact_dir() -> Path:
    """``$XDG_CACHE_HOME/atoll/artifacts`` (``~/.cache/atoll/artifacts``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "atoll" / "artifacts"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in pieces."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(READ_PIECE):
            h.update(piece)
    return h.hexdigest()


class ArtifactStore:
    """Files named by their SHA-256 under ``root``; ``partial/`` holds downloads under way."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.partial_dir = self.root / "partial"

    def _check(self, digest: str) -> str:
        if not is_sha256(digest):
            raise ArtifactError(
                f"{digest[:80]!r} is not an artifact hash (64 lower-case hex digits)"
            )
        return digest

    def path(self, digest: str) -> Path:
        return self.root / self._check(digest)

    def has(self, digest: str) -> bool:
        return is_sha256(digest) and (self.root / digest).is_file()

    def size(self, digest: str) -> int:
        return self.path(digest).stat().st_size

    def partial(self, digest: str) -> Path:
        """Where a download of ``digest`` is written until it is whole (resumed from its size)."""
        self.partial_dir.mkdir(parents=True, exist_ok=True)
        return self.partial_dir / self._check(digest)

    def put_bytes(self, data: bytes) -> str:
        """Store ``data``; returns its hash."""
        digest = hashlib.sha256(data).hexdigest()
        if not self.has(digest):
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".put-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.root / digest)
        return digest

    def put_file(self, source: Path) -> str:
        """Copy the file at ``source`` into the store; returns its hash. Raises ``OSError``."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".put-")
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out, Path(source).open("rb") as src:
                while piece := src.read(READ_PIECE):
                    h.update(piece)
                    out.write(piece)
            os.replace(tmp, self.root / h.hexdigest())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return h.hexdigest()

    def adopt_partial(self, digest: str) -> Path:
        """Move a whole download into the store once it hashes to ``digest``; a mismatch deletes
        it and raises ``ArtifactError`` (so the next try starts afresh)."""
        part = self.partial(digest)
        got = sha256_file(part)
        if got != digest:
            part.unlink(missing_ok=True)
            raise ArtifactError(
                f"artifact {digest[:16]}: the bytes received hash to {got[:16]}, not to its name"
            )
        os.replace(part, self.root / digest)
        return self.root / digest

    def open_verified(self, digest: str) -> Path:
        """The held file of ``digest``, its bytes hashed again first. Raises ``ArtifactError``
        when it is missing or no longer matches (the file is then moved aside, not used)."""
        path = self.path(digest)
        if not path.is_file():
            raise ArtifactError(f"artifact {digest[:16]} is not in {self.root}")
        got = sha256_file(path)
        if got != digest:
            bad = self.root / "corrupt"
            bad.mkdir(exist_ok=True)
            shutil.move(str(path), str(bad / digest))
            raise ArtifactError(
                f"artifact {digest[:16]} in {self.root} hashes to {got[:16]}: changed on disk, "
                "refused (moved to corrupt/; it is fetched again on the next start)"
            )
        return path

    def read_range(self, digest: str, start: int, length: int) -> bytes:
        """``length`` bytes (fewer at the end) of a held artifact from byte ``start``."""
        with self.path(digest).open("rb") as f:
            f.seek(start)
            return f.read(length)
