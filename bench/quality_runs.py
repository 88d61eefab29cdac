"""Running the runs of ``bench.quality``: one ``atoll local`` or data-parallel baseline each.

Every run is a subprocess (``atoll local --report`` or ``python -m node.workload.baseline
--json``) whose output goes to a log file beside its report, so this process's stdout stays
free for the benchmark's JSON. A run whose report already exists is read back instead of run
again (``--resume``), and every finished run is appended as one line to a JSON lines journal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config import RunConfig

__all__ = ["Runner", "Setting", "baseline_key", "local_flags", "summarise_local"]

# The RunConfig fields the data-parallel baseline depends on (node.workload.baseline's TrainConfig
# reads these from the swarm's config); two swarms equal on them share one baseline.
BASELINE_FIELDS = (
    "peers",
    "seed",
    "model",
    "corpus",
    "corpus_max_bytes",
    "steps",
    "batch_size",
    "lr",
    "warmup_steps",
    "weight_decay",
    "eval_batches",
    "sharding",
)


@dataclass(frozen=True)
class Setting:
    """One swarm configuration: a name and the RunConfig fields it changes from the defaults."""

    name: str
    overrides: tuple[tuple[str, Any], ...]

    def config(self) -> RunConfig:
        """The RunConfig; raises ValueError naming a field RunConfig does not have."""
        known = {f.name for f in dataclasses.fields(RunConfig)}
        unknown = [k for k, _ in self.overrides if k not in known]
        if unknown:
            raise ValueError(
                f"setting {self.name!r}: unknown RunConfig fields {unknown}; known: {sorted(known)}"
            )
        return RunConfig(**dict(self.overrides))

    def slug(self) -> str:
        """A short file-name-safe id of the overrides (equal settings share their reports)."""
        text = json.dumps(sorted(self.overrides), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def local_flags(cfg: RunConfig) -> list[str]:
    """``atoll local`` flags for every field of ``cfg`` that differs from RunConfig's default."""
    default = RunConfig()
    flags: list[str] = []
    for f in dataclasses.fields(RunConfig):
        value = getattr(cfg, f.name)
        if value != getattr(default, f.name) and value is not None:
            flags += ["--" + f.name.replace("_", "-"), str(value)]
    return flags


def baseline_key(cfg: RunConfig, lr: float) -> str:
    """The file-name-safe id of the baseline a swarm config is compared with, at inner lr ``lr``."""
    fields = {name: getattr(cfg, name) for name in BASELINE_FIELDS} | {"lr": lr}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def summarise_local(report: dict[str, Any], path: Path) -> dict[str, Any]:
    """The numbers ``bench.quality`` keeps from an ``atoll local`` report."""
    return {
        "report": str(path),
        "eval_loss_end": float(report["eval_loss"]["end"]),
        "eval_loss_start": float(report["eval_loss"]["start"]),
        "eval_curve_global": report.get("eval_curve_global", []),
        "tokens_trained": int(report["tokens_trained"]),
        "n_params": int(report["n_params"]),
        "bytes_sent": int(report["bytes_sent"]),
        "bytes_sent_ddp_equivalent": int(report["bytes_sent_ddp_equivalent"]),
        "bandwidth_reduction_vs_ddp": report.get("bandwidth_reduction_vs_ddp"),
        "hashes_agree": bool(report["hashes_agree"]),
        "global_versions": report.get("global_versions", []),
        "stalled_steps": int(report["stalled_steps"]),
        "wall_s": float(report["wall_s"]),
    }


class Runner:
    """Runs (or reads back) swarms and baselines under ``out_dir``, journaling each result."""

    def __init__(
        self,
        out_dir: Path,
        *,
        resume: bool,
        journal: Path | None,
        timeout_s: float,
        retries: int = 1,
        dp_jobs: int = 1,
    ) -> None:
        if dp_jobs < 1:
            raise ValueError(f"dp_jobs must be at least 1, got {dp_jobs}")
        self.out_dir = out_dir
        self.retries = retries
        self.dp_jobs = dp_jobs
        self._journal_lock = threading.Lock()  # baselines run on threads may finish together
        self.resume = resume
        self.journal = journal
        self.timeout_s = timeout_s
        self.done: set[Path] = set()  # reports this process wrote: equal settings run once
        out_dir.mkdir(parents=True, exist_ok=True)

    def local(self, setting: Setting, cfg: RunConfig, method: str) -> dict[str, Any]:
        """One ``atoll local`` run of ``cfg`` (method: decoupled or sync); its summary."""
        path = self.out_dir / f"{method}-s{cfg.seed}-{setting.slug()}.json"
        fresh = not self._have(path)
        if fresh:
            cmd = [
                sys.executable,
                "-m",
                "node",
                "local",
                "--quiet",
                "--report",
                str(path),
                *local_flags(cfg),
            ]
            self._call(cmd, path.with_suffix(".log"), f"{method} {setting.name} seed {cfg.seed}")
        out = summarise_local(json.loads(path.read_text()), path)
        if fresh:
            self._journal(
                {
                    "kind": "local",
                    "method": method,
                    "setting": setting.name,
                    "overrides": dict(setting.overrides),
                    "seed": cfg.seed,
                    **_without_curve(out),
                }
            )
        return out

    def baseline(self, cfg: RunConfig, lr: float) -> dict[str, Any]:
        """Synchronous data-parallel training at equal tokens to ``cfg``'s swarm, inner lr ``lr``."""
        path = self.out_dir / f"dp-s{cfg.seed}-{baseline_key(cfg, lr)}.json"
        _wait_for_other_writer(path)
        fresh = not self._have(path)
        if fresh:
            # one torch thread, as each peer: two spin-waiting threads crawl on a loaded machine
            cmd = [
                sys.executable,
                "-m",
                "node.workload.baseline",
                "--json",
                "--threads",
                "1",
                "--peers",
                str(cfg.peers),
                "--seed",
                str(cfg.seed),
                "--model",
                cfg.model,
                "--steps",
                str(cfg.steps),
                "--batch-size",
                str(cfg.batch_size),
                "--lr",
                str(lr),
                "--warmup-steps",
                str(cfg.warmup_steps),
                "--weight-decay",
                str(cfg.weight_decay),
                "--eval-batches",
                str(cfg.eval_batches),
                "--eval-every",
                str(cfg.eval_every),
                "--sharding",
                cfg.sharding,
            ]
            if cfg.corpus:
                cmd += ["--corpus", cfg.corpus]
            if cfg.corpus_max_bytes:
                cmd += ["--max-bytes", str(cfg.corpus_max_bytes)]
            log = path.with_suffix(".log")
            with _claim(path):
                self._call(cmd, log, f"data-parallel lr {lr:g} seed {cfg.seed}")
            lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
            if not lines:
                raise RuntimeError(f"the baseline printed no JSON result; see {log}")
            path.write_text(lines[-1])
        result = json.loads(path.read_text())
        out = {
            "report": str(path),
            "lr": lr,
            "eval_loss_end": float(result["eval_loss_end"]),
            "eval_curve": result["eval_curve"],
            "tokens_trained": int(result["tokens_trained"]),
        }
        if fresh:
            self._journal({"kind": "baseline", "seed": cfg.seed, **_without_curve(out)})
        return out

    def baselines(self, cfg: RunConfig, lrs: list[float]) -> list[dict[str, Any]]:
        """``baseline(cfg, lr)`` for each of ``lrs`` (distinct), in that order, ``dp_jobs`` at a
        time: each is a subprocess of one torch thread, so this process only waits on them."""
        if self.dp_jobs == 1 or len(lrs) < 2:
            return [self.baseline(cfg, lr) for lr in lrs]
        with ThreadPoolExecutor(min(self.dp_jobs, len(lrs))) as pool:
            return list(pool.map(lambda lr: self.baseline(cfg, lr), lrs))

    def _have(self, path: Path) -> bool:
        """Whether ``path`` may be read back instead of run; from now on it may."""
        have = path in self.done or (self.resume and path.exists())
        self.done.add(path)
        return have

    def _call(self, cmd: list[str], log: Path, what: str) -> None:
        """Run ``cmd`` with its output in ``log``, again up to ``retries`` times if it fails (a
        swarm on an overloaded machine may miss a start-up deadline); RuntimeError if it never
        succeeds."""
        for attempt in range(1 + self.retries):
            print(
                f"[quality] {time.strftime('%H:%M:%S')} running {what}: {' '.join(cmd[1:])}",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.monotonic()
            with log.open("wb") as f:
                try:
                    code = subprocess.run(
                        cmd, stdout=f, stderr=subprocess.STDOUT, timeout=self.timeout_s
                    ).returncode
                except subprocess.TimeoutExpired:
                    code = -1
            if code == 0:
                print(
                    f"[quality] {what} done in {time.monotonic() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                return
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            problem = f"{what} failed (exit code {code}, -1: over {self.timeout_s:.0f} s): {tail} (log: {log})"
            if attempt == self.retries:
                raise RuntimeError(problem)
            print(f"[quality] {problem}; trying again", file=sys.stderr, flush=True)
            self._journal({"kind": "failure", "what": what, "exit_code": code, "log": tail})
            log.rename(log.with_suffix(f".failed{attempt}.log"))

    def _journal(self, record: dict[str, Any]) -> None:
        if self.journal is None:
            return
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}
        with self._journal_lock, self.journal.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")


@contextlib.contextmanager
def _claim(path: Path) -> Iterator[None]:
    """Mark ``path`` as being written by this process (``path.lock`` holds its pid)."""
    lock = path.with_suffix(".lock")
    lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _wait_for_other_writer(path: Path, poll_s: float = 10.0) -> None:
    """If another live process claimed ``path`` (another bench.quality sharing ``--out``), wait
    until it is done, so that each baseline is trained once."""
    lock = path.with_suffix(".lock")
    told = False
    while lock.exists():
        try:
            pid = int(lock.read_text())
            os.kill(pid, 0)
        except (ValueError, OSError):  # unreadable, or its writer is gone
            return
        if pid == os.getpid():
            return
        if not told:
            print(
                f"[quality] waiting for process {pid} to finish {path.name}",
                file=sys.stderr,
                flush=True,
            )
            told = True
        time.sleep(poll_s)


def _without_curve(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if not k.startswith("eval_curve")}
