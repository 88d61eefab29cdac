"""protocol/ stays sans-IO: no sockets, event loops, threads, clocks or unseeded randomness."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PROTOCOL = Path(__file__).resolve().parents[2] / "protocol"
FORBIDDEN_MODULES = {
    "asyncio",
    "aiohttp",
    "socket",
    "threading",
    "time",
    "node",
    "logging",
    "selectors",
    "subprocess",
    "multiprocessing",
    "concurrent",
    "urllib",
    "http",
    "requests",
    "secrets",
}
# Calls that read the clock, the OS entropy pool, or a global (unseeded) random state.
FORBIDDEN_CALLS = {
    "os.urandom",
    "os.getrandom",
    "random.random",
    "random.randint",
    "random.choice",
    "random.shuffle",
    "random.sample",
    "random.uniform",
    "random.getrandbits",
    "random.seed",
    "torch.manual_seed",
    "torch.rand",
    "torch.randn",
    "torch.randint",
    "torch.randperm",
    "numpy.random",
    "np.random",
    "uuid.uuid4",
    "datetime.now",
    "datetime.datetime.now",
    "datetime.utcnow",
    "open",
}


def _sources() -> list[Path]:
    files = sorted(PROTOCOL.rglob("*.py"))
    assert files, f"no sources under {PROTOCOL}"
    return files


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def violations(source: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.module == "random":
                names += [f"random.{a.name}" for a in node.names if a.name != "Random"]
        elif isinstance(node, ast.Call):
            call = _dotted(node.func)
            if any(call == f or call.startswith(f + ".") for f in FORBIDDEN_CALLS):
                found.append(f"line {node.lineno}: call {call}()")
            if call in ("random.Random", "Random") and not node.args and not node.keywords:
                found.append(f"line {node.lineno}: unseeded random.Random()")
            continue
        else:
            continue
        for name in names:
            if name.split(".")[0] in FORBIDDEN_MODULES or name.startswith("random."):
                found.append(f"line {node.lineno}: import {name}")
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PROTOCOL)))
def test_protocol_module_is_sans_io(path: Path) -> None:
    assert violations(path.read_text()) == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import asyncio",
        "from aiohttp import web",
        "import socket",
        "import threading",
        "import time",
        "from time import monotonic",
        "import os\nos.urandom(16)",
        "import random\nrandom.random()",
        "from random import randint",
        "import random\nr = random.Random()",
        "import torch\ntorch.randn(3)",
        "from node import cli",
    ],
)
def test_checker_catches_forbidden_use(snippet: str) -> None:
    assert violations(snippet), snippet


def test_checker_allows_seeded_randomness() -> None:
    assert violations("import random\nr = random.Random(7)\nx = r.random()") == []
