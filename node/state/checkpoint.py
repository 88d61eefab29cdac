"""Atomic, verified checkpoints: safetensors for the tensors, a small JSON for the rest.

Theory of operation. A checkpoint is ONE file in the safetensors format, so the whole of it
appears or disappears with a single ``os.replace``. ``save_checkpoint`` writes it under a hidden
temporary name in the same directory (``.NAME.<pid>-<random>.tmp``), fsyncs the file, renames
it over the final name and fsyncs the directory. A crash (``kill -9`` or a power cut) at any
point leaves either the previous checkpoint or the new one under the final name, never a mix,
and the new one is durable once ``save_checkpoint`` returns; at worst a temporary file is left
behind, which the next save of the same path (and ``Checkpointer``, for its whole folder)
removes. One process writes a given path.

On-disk format (version ``FORMAT_VERSION``)::

    u64 little-endian  N = length of the JSON header
    N bytes            JSON header, padded with spaces to a multiple of 8:
                       {"__metadata__": {"atoll_format": "1",
                                         "atoll_created": ISO-8601 UTC time,
                                         "atoll_meta": the caller's meta as a JSON string,
                                         "atoll_sha256": 64 hex digits},
                        NAME: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..}
    data               raw little-endian tensor bytes, widest dtype first (so every tensor is
                       aligned to its element size), then by name

Any safetensors reader loads the tensors. ``atoll_sha256`` is the SHA-256 of the compact JSON
``["atoll-checkpoint", 1, created, meta, [[name, dtype, shape, sha256(data) hex], ..]]`` with
the tensors in name order: it covers the format version, the creation time, the caller's meta
and every tensor's name, dtype, shape and bytes. The writer hashes each tensor in <= 1 MiB
slices of the very bytes it writes (one pass, no copy of a CPU tensor), writes the header last
into the space reserved for it, and the reader re-hashes before trusting anything, so a
truncated file, a flipped byte or a torn header is refused (``CheckpointError``) with a
message that says what is wrong and what to do. Nothing is ever pickled.

``Checkpointer`` keeps ``step-000123.safetensors`` files in one folder, prunes all but the
newest ``keep`` and finds the newest one that loads, skipping (with a warning) corrupt ones.
Writing one file is ``node.state.checkpoint_save``, reading one ``node.state.checkpoint_load``,
and what both share (format version, dtype codes, digest, ``CheckpointError``)
``node.state.checkpoint_format``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from node.state.checkpoint_format import FORMAT_VERSION, CheckpointError, Expected
from node.state.checkpoint_load import load_checkpoint
from node.state.checkpoint_save import (
    PendingCheckpoint,
    _remove_temps,
    begin_checkpoint,
    save_checkpoint,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "Checkpointer",
    "Expected",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- a folder of them

_STEP = re.compile(r"step-(\d{6,})\.safetensors")


class Checkpointer:
    """Numbered checkpoints in one folder: ``save`` and prune, ``latest`` valid one back.

    One process owns the folder. ``save(step, ...)`` writes ``step-000123.safetensors`` and
    deletes all but the newest ``keep`` at or below ``step``; files above it (left behind when
    a run resumed from an earlier step, e.g. past a corrupt one) stay until a save overwrites
    them. Leftover temporary files from a killed writer are removed on creation and each save.
    """

    def __init__(self, folder: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.folder = Path(folder)
        self.keep = keep
        self.folder.mkdir(parents=True, exist_ok=True)
        _remove_temps(self.folder, ".step-*.tmp")

    def path(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"step must be >= 0, not {step}")
        return self.folder / f"step-{step:06d}.safetensors"

    def steps(self) -> list[int]:
        """The steps with a checkpoint file, oldest first (valid or not)."""
        found = (_STEP.fullmatch(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
        """Write checkpoint ``step`` atomically, then prune; raises like ``save_checkpoint``."""
        return self.begin(step, tensors, meta)()

    def begin(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        *,
        write_now: Collection[str] = (),
    ) -> Callable[[], Path]:
        """``save`` in two parts (``begin_checkpoint``): the tensors named in ``write_now`` are
        in the file when this returns; the function returned writes the rest, renames, prunes
        and returns the path (call it once, in any thread). Raises like ``save_checkpoint``."""
        path = self.path(step)
        _remove_temps(self.folder, ".step-*.tmp")
        pending = begin_checkpoint(path, tensors, meta, write_now=write_now)
        return lambda: self._finish(step, pending)

    def _finish(self, step: int, pending: PendingCheckpoint) -> Path:
        pending.finish()
        for old in [s for s in self.steps() if s <= step][: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                self.path(old).unlink()
        return pending.path

    def latest(
        self,
        *,
        expected: Expected | None = None,
        allow_nonfinite: bool = False,
        check: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The newest checkpoint that loads (and that ``check`` does not refuse with a
        ``CheckpointError``: its meta record's fields, say), or None; refused newer ones are
        logged and skipped."""
        for step in reversed(self.steps()):
            try:
                found = load_checkpoint(
                    self.path(step), expected=expected, allow_nonfinite=allow_nonfinite
                )
                if check is not None:
                    check(*found)
                return found
            except CheckpointError as e:
                log.warning("skipping checkpoint step %d: %s", step, e)
        return None
