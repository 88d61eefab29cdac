"""Reading a corpus's bytes: a file, a folder of text files, or the Python standard library's
own ``.py`` files (``node.workload.corpus`` splits and samples them). Apart from torch, so that
``atoll local`` and ``atoll join`` tell a corpus that is not there before torch is imported."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path, PurePath

__all__ = ["load_corpus", "stdlib_corpus_files"]

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SEPARATOR = b"\n"  # between files, so the last line of one file never runs into the next


def stdlib_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, recursively, without site-packages, sorted by their
    path relative to the stdlib folder (so the order is the same on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return _walk(root, suffix=".py")


def _walk(root: Path, *, suffix: str | None) -> list[Path]:
    """Files under ``root`` (pruning hidden folders and _SKIP_DIRS), sorted by relative path."""
    found: list[PurePath] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = PurePath(dirpath).relative_to(root)
        found += [
            rel / f
            for f in filenames
            if not f.startswith(".") and (suffix is None or f.endswith(suffix))
        ]
    return [root / rel for rel in sorted(found, key=lambda p: p.parts)]


def _read_joined(files: list[Path], *, skip_binary: bool, max_bytes: int | None) -> bytes:
    """Read ``files`` in order and join them once; stops reading once ``max_bytes`` are in."""
    parts: list[bytes] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = f.read_bytes()
        if not data or (skip_binary and b"\0" in data):
            continue
        parts.append(data)
        total += len(data) + len(_SEPARATOR)
    joined = _SEPARATOR.join(parts)
    return joined if max_bytes is None else joined[:max_bytes]


def load_corpus(path: Path | None, *, max_bytes: int | None = None) -> bytes:
    """The training bytes.

    ``path`` None: the standard library (``stdlib_corpus_files``). A file: its bytes. A folder:
    every text file under it, recursively, in sorted order, joined with newlines; files holding a
    NUL byte count as binary and are skipped, as are hidden files and folders. ``max_bytes`` caps
    the result (reading stops early).

    Raises FileNotFoundError if ``path`` does not exist, ValueError if the corpus is empty or
    ``max_bytes`` is not positive.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    path = None if path is None else Path(path)
    if path is None:
        data = _read_joined(stdlib_corpus_files(), skip_binary=True, max_bytes=max_bytes)
        where = f"the Python standard library at {sysconfig.get_paths()['stdlib']}"
    elif not path.exists():
        raise FileNotFoundError(
            f"corpus path {path} does not exist: pass a text file, a folder of text files, "
            "or no corpus path to train on the Python standard library"
        )
    elif path.is_file():
        data = path.read_bytes()
        data = data if max_bytes is None else data[:max_bytes]
        where = str(path)
    elif path.is_dir():
        data = _read_joined(_walk(path, suffix=None), skip_binary=True, max_bytes=max_bytes)
        where = f"folder {path} (binary files, i.e. with NUL bytes, are skipped)"
    else:
        raise ValueError(f"corpus path {path} is neither a file nor a folder")
    if not data:
        raise ValueError(f"corpus is empty: no text bytes found in {where}")
    return data
