"""A 1-rank island and a 2-rank island (torchrun, gloo) of one swarm on 127.0.0.1, each a
process of a worker script: the multi-rank island tests (DDP and FSDP) share this launcher."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two_islands(worker: Path, out: Path, steps: int, *two_args: str) -> None:
    """Found the swarm with ``worker --name one --found``, then run ``worker --name two`` as 2
    torchrun ranks (with ``two_args``) against it; both must exit 0. The workers write their
    results under ``out``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    common = ["--out", str(out), "--steps", str(steps)]
    one = subprocess.Popen(
        [sys.executable, str(worker), "--name", "one", "--found", *common],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    two = None
    try:
        deadline = time.monotonic() + 90
        while not (out / "founder.url").exists():
            assert one.poll() is None, one.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the 1-rank island never came up"
            time.sleep(0.2)
        url = (out / "founder.url").read_text()
        two = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(_free_port()),
                str(worker),
                "--name",
                "two",
                *two_args,
                "--initial-peer",
                url,
                *common,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out_two, _ = two.communicate(timeout=200)
        assert two.returncode == 0, out_two[-12000:]
        out_one, _ = one.communicate(timeout=60)
        assert one.returncode == 0, out_one[-12000:]
    finally:
        for proc in (one, two):
            if proc is not None and proc.poll() is None:
                proc.kill()
