"""Child ``python -m node`` processes and swarms made with the real command line, on this machine:
shared by the process-level tests (``tests/integration``) and the benches that start real swarms."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import queue
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


# The process-level tests set this: their children are forked from one process that imported
# torch once (node.run.prefork), ~7 s of CPU less each; a bench that times a joiner's start-up
# (bench.late_join) leaves it False, as a person starting ``atoll join`` has a fresh interpreter.
FORK_CHILDREN = False
_fork_server: Any = None  # node.run.prefork.ForkServer, started by the first forked child


def _forked(args: list[str], stdout: int, stderr: int) -> Any:
    """``atoll ARGS`` forked from the shared prefork server (started once, stopped at exit)."""
    global _fork_server
    from node.run.prefork import ForkServer

    if _fork_server is None:
        folder = Path(tempfile.mkdtemp(prefix="atoll-prefork-"))
        _fork_server = ForkServer(folder / "prefork.log", env=ENV, cwd=ROOT)
        atexit.register(_fork_server.close)
    with open(os.devnull, "rb") as devnull:
        return _fork_server.spawn(args, devnull.fileno(), stdout, stderr)


class Proc:
    """A child ``python -m node ...`` whose stdout lines are read on a thread (JSON lines become
    events). Forked from the shared prefork server under ``FORK_CHILDREN``, where forking works."""

    def __init__(self, args: list[str], log: Path) -> None:
        from node.run.prefork import fork_supported

        self.log = log.open("wb")
        self.proc: Any = None
        if FORK_CHILDREN and fork_supported():
            out, child_out = os.pipe()
            try:
                self.proc = _forked(args, child_out, self.log.fileno())
                self.proc.stdout = os.fdopen(out, "rb")
            except RuntimeError:  # the server cannot fork it: a fresh interpreter, as before
                os.close(out)
            finally:
                os.close(child_out)
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "node", *args],
                cwd=ROOT,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=self.log,
                stdin=subprocess.DEVNULL,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            self.lines.put(line)
            with contextlib.suppress(json.JSONDecodeError):
                self.events.append(json.loads(line))
        self.proc.stdout.close()  # at its end: the process has closed it

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if e.get("event") == name:
                    return e
            if self.proc.poll() is not None:
                raise AssertionError(f"process exited ({self.proc.returncode}) before {name!r}")
            time.sleep(0.1)
        raise AssertionError(f"no {name!r} event within {timeout} s")

    def wait_line(self, contains: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"process exited ({self.proc.returncode}) before {contains!r}"
                    ) from None
                continue
            if contains in line:
                return line
        raise AssertionError(f"no line with {contains!r} within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def start_bootstrap(folder: Path, procs: list[Proc], *, timeout: float = 60) -> str:
    """Start ``atoll bootstrap`` on 127.0.0.1 (logging to ``folder/boot.log``, appended to
    ``procs`` so that the caller's cleanup stops it) and return the URL it listens at."""
    boot = Proc(["bootstrap", "--listen", "127.0.0.1:0"], folder / "boot.log")
    procs.append(boot)
    first = boot.lines.get(timeout=timeout)
    if "listening at" not in first:
        raise RuntimeError(f"the bootstrap node said {first!r}, not where it listens")
    return first.rsplit(" ", 1)[-1]


def admin(*args: str) -> None:
    """``atoll ARGS`` in this process (the same ``main`` as the command line; no interpreter start)."""
    from node.cli import main

    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()) as err,
    ):
        code = main(list(args))
    if code != 0:
        raise AssertionError(f"atoll {' '.join(args)} exited {code}: {err.getvalue()}")


def atoll(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m node ARGS`` to completion."""
    out = subprocess.run(
        [sys.executable, "-m", "node", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and out.returncode != 0:
        raise AssertionError(f"atoll {' '.join(args)} exited {out.returncode}: {out.stderr}")
    return out


def get_json(url: str) -> dict[str, Any]:
    """A GET without credentials (open swarms); TLS unverified."""
    ctx = ssl._create_unverified_context() if url.startswith("https") else None  # noqa: S323 (local swarms only)
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        return dict(json.loads(resp.read()))


@dataclass
class SwarmFiles:
    """A swarm made with ``atoll keygen`` and ``atoll swarm ...`` in ``folder``."""

    folder: Path
    manifest: Path
    keys: dict[str, Path] = field(default_factory=dict)
    certs: dict[str, Path] = field(default_factory=dict)

    def key(self, name: str) -> Path:
        if name not in self.keys:
            self.keys[name] = self.folder / f"{name}.key"
            admin("keygen", "--out", str(self.keys[name]))
        return self.keys[name]

    def certify(
        self, peer: str, *, lab: str, roles: str = "learner,owner", days: str = "1"
    ) -> Path:
        path = self.folder / f"{peer}.cert"
        admin(
            "swarm",
            "certify",
            "--manifest",
            str(self.manifest),
            "--authority",
            str(self.key(lab)),
            "--peer",
            str(self.key(peer)),
            "--roles",
            roles,
            "--days",
            days,
            "--out",
            str(path),
        )
        self.certs[peer] = path
        return path

    def args(self, peer: str) -> list[str]:
        out = ["--manifest", str(self.manifest), "--key", str(self.key(peer))]
        if peer in self.certs:
            out += ["--cert", str(self.certs[peer])]
        return out


def make_swarm(
    folder: Path, *, name: str, admission: str, labs: tuple[str, ...], recipe: list[str]
) -> SwarmFiles:
    """Founder and one authority per lab, all through the command line."""
    folder.mkdir(parents=True, exist_ok=True)
    files = SwarmFiles(folder, folder / "swarm.toml")
    admin(
        "swarm",
        "init",
        "--name",
        name,
        "--founder",
        str(files.key("founder")),
        "--admission",
        admission,
        *recipe,
        "--out",
        str(files.manifest),
    )
    for lab in labs:
        admin(
            "swarm",
            "add-authority",
            str(files.manifest),
            "--founder",
            str(files.key("founder")),
            "--lab",
            lab,
            "--key",
            str(files.key(lab)),
        )
    return files
