"""The package layout is the architecture: every import points down a layer, and none goes round in a circle.

Read from the source (every ``import``, lazy ones inside functions and ``TYPE_CHECKING``
ones included), not from what happens to be imported at run time, so an upward import
fails here even on a path no test runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "tierfs"
# The test scaffolding (a local cluster, a GCS emulator, CSI stand-ins, the coordination
# simulator): a distribution of its own, so that the tierfs wheel never ships it.
SCAFFOLDING = ROOT / "testing"

# Bottom first. A module may import its own layer and the layers listed before it.
LAYERS = [
    "core",  # formats, parsers, system calls: what everything builds on
    "coordination",  # the coordination protocol and its decisions, pure (no I/O of its own)
    "discovery",  # the --peers grammar, DNS, the current list of peer addresses
    "config",  # the one configuration object
    "ramtier",  # this node's RAM tier: layout, snapshots, committed steps
    "fs",  # the FUSE file system over the RAM tier
    "peers",  # the peer protocol: framing, TLS, the client of one peer
    "store",  # this node's chunk and replica store, and the service that serves it
    "tiers",  # every tier as a value behind one interface
    "pipeline",  # survey, restore choice and plan, restore, replication
    "mtc",  # GKE multi-tier checkpointing's file protocol
    "csi",  # the Kubernetes CSI node plugin
    "daemon",  # the composition root
    "commands",  # the CLI
]
ENTRY_POINTS = {"tierfs", "tierfs.__main__"}
GENERATED = {"tierfs.csi.csi_pb2"}
MAX_LINES = 500


def _module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
SCAFFOLDING_MODULES = {_module_name(p, SCAFFOLDING): p for p in sorted((SCAFFOLDING / "tierfs_testing").rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The tierfs modules ``name`` imports, resolved to modules (a package counts as its ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t == "tierfs" or t.startswith("tierfs."))
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_sits_in_a_layer():
    loose = [name for name in MODULES if name not in ENTRY_POINTS and _layer(name) is None]
    assert not loose, f"modules outside every layer (add them to a package of LAYERS): {loose}"


def test_imports_only_point_down():
    upward = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name not in ENTRY_POINTS
        for target in targets
        if target not in ENTRY_POINTS and _layer(target) > _layer(name)
    ]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _absolute_imports(path: Path) -> set[str]:
    """Every module ``path`` names in an absolute ``import`` or ``from ... import``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_the_scaffolding_lives_outside_the_package():
    assert not list(PACKAGE.glob("testing/*.py")), "the test scaffolding belongs in testing/tierfs_testing"
    assert "tierfs_testing" in SCAFFOLDING_MODULES


def test_the_product_never_imports_the_test_scaffolding():
    users = [
        f"{name} -> {target}"
        for name, path in MODULES.items()
        for target in _absolute_imports(path)
        if target.split(".")[0] == "tierfs_testing" or target.startswith("tierfs.testing")
    ]
    assert not users, "the product imports the test scaffolding:\n" + "\n".join(sorted(users))


ALL_MODULES = MODULES | SCAFFOLDING_MODULES


@pytest.mark.parametrize("name", sorted(set(ALL_MODULES) - GENERATED))
def test_no_module_is_too_big_to_read(name):
    lines = len(ALL_MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{ALL_MODULES[name].relative_to(ROOT)} has {lines} lines: split it by what its parts do"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
