"""A training peer's checkpoint: what an island saves every H steps and resumes from after ``kill -9``.

Saved (``node.state.checkpoint``: one safetensors file, atomic, hashed): the local replica θ,
the inner optimizer's state (AdamW moments and step counts), the global fragments and the
versions held, the data sampler's generator, and the island's counters (inner step, tokens
trained, steps and tokens since each fragment's last contribution). On resume the peer trains
on from that step with those moments and that data order, holds those global versions (state
sync then fetches only newer ones from the owners), and re-sends nothing that was in flight: a
contribution in flight at the kill was either merged (its effect is in the newer global version
the peer syncs) or lost, and the island's next one covers the steps since its base.

Writing runs on a background thread from a snapshot taken at a step boundary, so training waits
only for the copy; a save still running when the next is due is skipped (and counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from node.diloco.island import Island
from node.state.checkpoint import Checkpointer, CheckpointError

__all__ = ["IslandCheckpoints"]

log = logging.getLogger("atoll.resume")

FORMAT = "atoll-island/1"


class IslandCheckpoints:
    """Saves and restores one island (model, optimizer, global fragments, counters, data order)."""

    def __init__(
        self,
        folder: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        island: Island,
        generator: torch.Generator,
        *,
        keep: int = 2,
    ) -> None:
        self.store = Checkpointer(folder, keep=keep)
        self.model, self.optimizer, self.island, self.generator = (
            model,
            optimizer,
            island,
            generator,
        )
        self._writer: threading.Thread | None = None
        self.saved = self.skipped = 0
        self.failed: str | None = None

    # --- save ------------------------------------------------------------------------------------
    def _snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        isl = self.island
        # the model and the optimizer's state as they are, not copied: ``save`` writes them into
        # the checkpoint's file before training goes on (docs/scale.md)
        tensors: dict[str, torch.Tensor] = {
            f"model.{n}": p.detach() for n, p in self.model.named_parameters()
        }
        index = {id(p): i for i, p in enumerate(self._optimizer_params())}  # state_dict's numbering
        for param, state in self.optimizer.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.{index[id(param)]}.{k}"] = v.detach()
        # a global version is a value (adoption replaces the tensor, never writes into it): the
        # writer reads it as it is, without a second copy of the model (docs/scale.md)
        for i, flat in enumerate(isl.global_flat):
            tensors[f"global.{i}"] = flat
        tensors["sampler.rng"] = self.generator.get_state()
        meta = {
            "format": FORMAT,
            "step": isl.stats.step,
            "tokens_trained": isl.stats.tokens_trained,
            "versions": list(isl.versions),
            "c_steps": list(isl.c_steps),
            "c_tokens": list(isl.c_tokens),
            "next_due": list(isl.next_due),
            # wall clock: a restarted peer's version fence counts the swarm's merges since
            # then, not since it loaded these versions (which refused honest versions)
            "saved_at": time.time(),
        }
        return tensors, meta

    def save(self) -> bool:
        """Write the model and optimizer state into the checkpoint's file now, and the rest (the
        global fragments, which adoption replaces and never writes into; the hashes; the fsync)
        in the background. False when the previous write is still going."""
        if self._writer is not None and self._writer.is_alive():
            self.skipped += 1
            return False
        tensors, meta = self._snapshot()
        try:
            live = [n for n in tensors if n.startswith(("model.", "optim."))]
            finish = self.store.begin(int(meta["step"]), tensors, meta, write_now=live)
        except (OSError, ValueError) as exc:  # a full disk must not stop training
            self._failed(meta, exc)
            return False
        del tensors

        def write() -> None:
            try:
                finish()
                self.saved += 1
            except (OSError, ValueError) as exc:
                self._failed(meta, exc)

        self._writer = threading.Thread(target=write, name="atoll-checkpoint", daemon=True)
        self._writer.start()
        return True

    def _failed(self, meta: dict[str, Any], exc: Exception) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        log.error("checkpoint at step %s not written: %s", meta["step"], self.failed)

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # --- restore -----------------------------------------------------------------------------------
    def _well_formed(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """``CheckpointError`` for an island checkpoint whose meta record is malformed (a crafted or
        damaged file whose digest still holds): wrong types, counts past 2^63, lists of the wrong
        length. ``Checkpointer.latest`` then skips it with the reason, and an older one (or a
        fresh start) is used instead of a traceback. Another format is left to ``restore``."""
        if meta.get("format") != FORMAT:
            return
        n = len(self.island.versions)

        def counts(value: object, length: int | None) -> bool:
            items = value if isinstance(value, list) else [value]
            return (length is None or (isinstance(value, list) and len(value) == length)) and all(
                type(v) is int and 0 <= v < 1 << 63 for v in items
            )

        fields = {
            "step": None,
            "tokens_trained": None,
            "versions": n,
            "c_steps": n,
            "c_tokens": n,
            "next_due": n,
        }
        bad = [name for name, length in fields.items() if not counts(meta.get(name), length)]
        if bad or not isinstance(tensors.get("sampler.rng"), torch.Tensor):
            raise CheckpointError(
                f"island checkpoint in {self.store.folder}: malformed meta record "
                f"({', '.join(bad) or 'sampler.rng'}: not counts for {n} fragments)"
            )

    def restore(self) -> dict[str, Any] | None:
        """Load the newest valid checkpoint into the model, optimizer, island and sampler.

        Returns its meta (None when there is none). Raises ``CheckpointError`` when one exists
        but does not fit this model (another model or fragment plan): a clear message, not a
        half-restored island."""
        expected = {
            f"model.{n}": (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()
        }
        for i, flat in enumerate(self.island.global_flat):
            expected[f"global.{i}"] = (tuple(flat.shape), flat.dtype)
        found = self.store.latest(check=self._well_formed)
        if found is None:
            return None
        tensors, meta = found
        if meta.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint in {self.store.folder} is not an island checkpoint "
                f"({meta.get('format')!r}); point --checkpoint-dir at an empty folder"
            )
        for name, (shape, dtype) in expected.items():
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                raise CheckpointError(
                    f"checkpoint in {self.store.folder} does not fit this model ({name}: "
                    f"{None if t is None else tuple(t.shape)}, expected {shape}); it is "
                    "another swarm's: point --checkpoint-dir at an empty folder"
                )
        versions = [int(v) for v in meta["versions"]]
        if len(versions) != len(self.island.versions):
            raise CheckpointError(
                f"checkpoint holds {len(versions)} fragments, this plan has "
                f"{len(self.island.versions)}"
            )
        with torch.no_grad():
            for n, param in self.model.named_parameters():
                param.copy_(tensors[f"model.{n}"])
        params = self._optimizer_params()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if name.startswith("optim."):
                _, index, k = name.split(".", 2)
                state.setdefault(int(index), {})[k] = t
        sd = self.optimizer.state_dict()
        sd["state"] = {
            i: {k: v.to(params[i].device) if k != "step" else v for k, v in s.items()}
            for i, s in state.items()
            if i < len(params)
        }
        self.optimizer.load_state_dict(sd)
        isl = self.island
        for p in range(len(isl.global_flat)):
            isl.global_flat[p] = tensors[f"global.{p}"].float().clone()
        isl.versions = versions
        isl.c_steps, isl.c_tokens = (
            [int(x) for x in meta["c_steps"]],
            [int(x) for x in meta["c_tokens"]],
        )
        isl.next_due = [int(x) for x in meta["next_due"]]
        isl.stats.step, isl.stats.tokens_trained = int(meta["step"]), int(meta["tokens_trained"])
        self.generator.set_state(tensors["sampler.rng"])
        log.info("resumed from step %d with global versions %s", isl.stats.step, versions)
        return meta
