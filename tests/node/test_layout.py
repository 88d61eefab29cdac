"""node/ is layered: no import cycle between its modules, and arrows only point down.

Layers, top to bottom: the entry points (``node/run``, ``node/api``, ``node/cli``,
``node/__main__``), then ``node/peer``, then the concern folders (``wire``, ``dht``,
``diloco``, ``state``) and the workload, then ``node/config`` and protocol/. The peer never
imports the workload: what a learner may claim comes from the swarm's config, not the GPT preset.
Imports under ``if TYPE_CHECKING:`` are ignored (they never run); imports inside functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "node"

ENTRY = ("node.run", "node.api", "node.cli", "node.__main__")
CONCERNS = ("node.wire", "node.dht", "node.diloco", "node.state")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The node.* modules that ``path`` imports at run time (resolved to a module in ``known``)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("node.") and name in known:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in NODE.rglob("*.py")}
    known = set(files)
    return {name: imports_of(path, known) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_tree_is_grouped_by_concern() -> None:
    for folder in ("wire", "dht", "diloco", "state", "workload", "run"):
        assert (NODE / folder / "__init__.py").is_file(), f"node/{folder}/ is missing"
    top = sorted(p.name for p in NODE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "cli.py", "config.py", "peer.py"]


def test_no_import_cycle_inside_node() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_arrows_point_down() -> None:
    graph = import_graph()
    wrong = []
    for module, deps in graph.items():
        for dep in deps:
            if _in(dep, ENTRY) and not _in(module, ENTRY):
                wrong.append(f"{module} imports the entry point {dep}")
            if dep == "node.peer" and not _in(module, ENTRY):
                wrong.append(f"{module} imports node.peer (only run/, api and cli may)")
            if _in(module, CONCERNS + ("node.peer", "node.config")) and _in(
                dep, ("node.workload",)
            ):
                wrong.append(f"{module} imports the workload {dep}")
            if module == "node.config" and dep != module:
                wrong.append(f"node.config must be a leaf, imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import node.peer\n", {"node.peer"}),
        ("from node.diloco.owner import FragmentOwner\n", {"node.diloco.owner"}),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from node.peer import PeerNode\n",
            set(),
        ),
        ("def f():\n    from node.peer import PeerNode\n", {"node.peer"}),
    ],
)
def test_import_parser(tmp_path: Path, source: str, expected: set[str]) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imports_of(path, {"node.peer", "node.diloco.owner"}) == expected


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
