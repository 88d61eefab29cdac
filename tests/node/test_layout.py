"""node/ is layered: no import cycle between its modules, and arrows only point down.

Layers, top to bottom: the entry points (``node/run``, ``node/api``, ``node/cli``,
``node/__main__``), then ``node/peer/`` (the peer's own parts, composed), then the concern folders (``wire``, ``dht``,
``diloco``, ``state``) and the workload, then ``node/config`` and protocol/. The peer never
imports the workload: what a learner may claim comes from the swarm's config, not the GPT preset.
Imports under ``if TYPE_CHECKING:`` are ignored (they never run); imports inside functions count.
Objects are composed, not mixed in: no class in node/ subclasses a class defined in another node/
module, and ``TYPE_CHECKING`` imports into node/ (stubs that hold mixins together) are counted
and may not grow (none in node/peer/).
"""

from __future__ import annotations

import ast
import functools
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


@functools.cache
def _parsed() -> dict[str, ast.Module]:
    """node/'s modules (by name), each parsed once for every test here: each test parsed all of
    them again, 1.2 to 2 s a test."""
    return {_module_name(p): ast.parse(p.read_text()) for p in sorted(NODE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The node.* modules that ``path`` imports at run time (resolved to a module in ``known``)."""
    return _imports_in(ast.parse(path.read_text()), known)


@functools.cache
def _skipped() -> dict[str, set[int]]:
    """Each parsed module's ``if TYPE_CHECKING:`` lines, found once."""
    return {name: _type_checking_lines(tree) for name, tree in _parsed().items()}


def _imports_in(tree: ast.Module, known: set[str], skip: set[int] | None = None) -> set[str]:
    skip = _type_checking_lines(tree) if skip is None else skip
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


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the node.* modules it imports; built once, read by three tests."""
    trees, skipped = _parsed(), _skipped()
    known = set(trees)
    return {name: _imports_in(tree, known, skipped[name]) - {name} for name, tree in trees.items()}


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
    for folder in ("wire", "dht", "diloco", "state", "workload", "run", "peer"):
        assert (NODE / folder / "__init__.py").is_file(), f"node/{folder}/ is missing"
    top = sorted(p.name for p in NODE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "cli.py", "config.py"]


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
            if _in(dep, ("node.peer",)) and not _in(module, ENTRY + ("node.peer",)):
                wrong.append(f"{module} imports {dep} (only run/, api and cli may)")
            if module.startswith("node.peer.") and dep == "node.peer":
                wrong.append(f"{module} imports its own package node.peer (import the module)")
            if _in(module, CONCERNS + ("node.peer", "node.config")) and _in(
                dep, ("node.workload",)
            ):
                wrong.append(f"{module} imports the workload {dep}")
            if module == "node.config" and dep != module:
                wrong.append(f"node.config must be a leaf, imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))


# sibling folders (above wire, below the peer) import each other only here; a new edge fails
SIBLINGS = ("node.dht", "node.diloco", "node.state", "node.status")
SIBLING_IMPORTS = {
    ("node.state.owner_checkpoint", "node.diloco.replica"),  # a checkpoint holds a ReplicaState
    ("node.state.sync", "node.diloco.flat"),  # state sync checks a fragment's flat shapes
}


def test_sibling_folders_import_each_other_only_where_listed() -> None:
    def folder(module: str) -> str | None:
        return next((s for s in SIBLINGS if _in(module, (s,))), None)

    graph = import_graph()
    edges = {
        (module, dep)
        for module, deps in graph.items()
        for dep in deps
        if folder(module) and folder(dep) and folder(module) != folder(dep)
    }
    assert edges <= SIBLING_IMPORTS, (
        f"new imports between sibling folders: {edges - SIBLING_IMPORTS}"
    )
    assert edges >= SIBLING_IMPORTS, f"gone, delete from SIBLING_IMPORTS: {SIBLING_IMPORTS - edges}"


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


def _classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [n for n in tree.body if isinstance(n, ast.ClassDef)]


def _node_imports(tree: ast.Module, skip: set[int]) -> dict[str, str]:
    """Local name -> the node.* module it was imported from (``from node.x import Name``)."""
    names: dict[str, str] = {}
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.ImportFrom)
            and n.module
            and n.module.startswith("node.")
            and n.lineno not in skip
        ):
            for a in n.names:
                names[a.asname or a.name] = n.module
    return names


def _class_bases_across_modules() -> list[str]:
    """``module.Class(Base)`` for every class in node/ whose base is a class defined in another
    node/ module (a mixin spread over files). Protocols, exceptions, dataclasses and library
    bases are fine: only bases defined as plain classes in node/ count."""
    trees = _parsed()
    allowed: dict[str, set[str]] = {}  # module -> its classes that may be subclassed elsewhere
    for name, tree in trees.items():
        allowed[name] = set()
        for c in _classes(tree):
            bases = {ast.unparse(b) for b in c.bases}
            decorators = {ast.unparse(d).split("(")[0] for d in c.decorator_list}
            exception = any(b.endswith(("Exception", "Error")) for b in bases)
            if (
                exception
                or "Protocol" in bases
                or decorators & {"dataclass", "dataclasses.dataclass"}
            ):
                allowed[name].add(c.name)
    wrong = []
    for name, tree in trees.items():
        imported = _node_imports(tree, _skipped()[name])
        for c in _classes(tree):
            for b in c.bases:
                base = ast.unparse(b)
                home = imported.get(base)
                if home is None or home == name or home not in trees:
                    continue
                defined = {k.name for k in _classes(trees[home])}
                if base in defined and base not in allowed[home]:
                    wrong.append(f"{name}.{c.name}({base}) subclasses {home}.{base}")
    return sorted(wrong)


def _type_checking_imports_into_node() -> dict[str, int]:
    """Per node/ module, the node.* imports under ``if TYPE_CHECKING:``."""
    out: dict[str, int] = {}
    for name, tree in _parsed().items():
        skip = _skipped()[name]
        count = 0
        for n in ast.walk(tree):
            if getattr(n, "lineno", None) not in skip:
                continue
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("node."):
                count += 1
            elif isinstance(n, ast.Import):
                count += sum(1 for a in n.names if a.name.startswith("node."))
        if count:
            out[name] = count
    return out


# TYPE_CHECKING imports into node/ once every mixin was composed (issue 49); lower it, never raise it
TYPE_CHECKING_BUDGET = 5

# mixins across modules: none left (issue 49), so any class that subclasses another node/ module's
# class fails here (compose an object instead)
KNOWN_MIXINS: set[str] = set()

# a constructor takes a config object plus at most this many parameters (its collaborators): "a
# handful" (the style guide's item 9); group the rest in a frozen dataclass named for what it is
MAX_CONSTRUCTOR_PARAMETERS = 6
# none wider: the public API's SwarmIsland groups its arguments (Swarm, Network, Timing) too
WIDE_CONSTRUCTORS: dict[str, int] = {}


def _constructor_widths() -> dict[str, int]:
    """Each node/ class's ``__init__`` parameters, less ``self`` and a ``config``/``cfg``."""
    widths = {}
    for name, tree in _parsed().items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for f in cls.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    a = f.args
                    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)][1:]
                    width = len([n for n in names if n not in ("config", "cfg")])
                    widths[f"{name}.{cls.name}"] = width
    return widths


def test_constructors_take_a_config_and_few_collaborators() -> None:
    widths = _constructor_widths()
    wide = {
        k: w
        for k, w in widths.items()
        if w > MAX_CONSTRUCTOR_PARAMETERS and w > WIDE_CONSTRUCTORS.get(k, 0)
    }
    assert not wide, f"constructors over {MAX_CONSTRUCTOR_PARAMETERS} parameters: {wide}"
    assert all(widths.get(k) == w for k, w in WIDE_CONSTRUCTORS.items()), "lower WIDE_CONSTRUCTORS"


def test_no_class_is_mixed_in_from_another_module() -> None:
    found = set(_class_bases_across_modules())
    new, gone = sorted(found - KNOWN_MIXINS), sorted(KNOWN_MIXINS - found)
    assert not new, "mixins across modules (compose objects instead):\n" + "\n".join(new)
    assert not gone, "no longer mixins: delete from KNOWN_MIXINS:\n" + "\n".join(gone)
    assert not [m for m in found if m.startswith("node.peer.")]


def test_type_checking_imports_into_node_do_not_grow() -> None:
    counts = _type_checking_imports_into_node()
    peer = {m: n for m, n in counts.items() if _in(m, ("node.peer",))}
    assert not peer, f"TYPE_CHECKING imports in node/peer/ (import at run time): {peer}"
    total = sum(counts.values())
    assert total <= TYPE_CHECKING_BUDGET, (
        f"{total} TYPE_CHECKING imports into node/ (budget {TYPE_CHECKING_BUDGET}): {counts}"
    )


def test_the_import_reader_skips_type_checking_imports() -> None:
    source = "from typing import TYPE_CHECKING\nfrom node.a import Base\nif TYPE_CHECKING:\n    from node.b import Stub\n"
    tree = ast.parse(source)
    assert _node_imports(tree, _type_checking_lines(tree)) == {"Base": "node.a"}
