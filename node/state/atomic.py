"""Writing a file so that readers see the old one or the whole new one, never half of it.

The bytes go to a temporary file beside ``path`` (same folder, so the rename stays on one file
system), which is flushed, fsynced and renamed over ``path``; on any error it is deleted and
``path`` is left as it was. Checkpoints have their own writer (``checkpoint_save``), which also
hashes as it writes and fsyncs the folder.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_write(path: Path, *, mode: int | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file to write ``path``'s new contents into; on a clean exit it is fsynced,
    given ``mode`` (it is created 0600) and renamed over ``path``. Creates missing parent folders.
    Raises ``OSError`` from the disk, leaving ``path`` untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path``'s contents with ``data`` atomically (``atomic_write``)."""
    with atomic_write(path, mode=mode) as out:
        out.write(data)
