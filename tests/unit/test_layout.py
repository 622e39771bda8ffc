"""The code's layout rules, read from the source (nothing imported): no import cycle among the
server's modules (imports under `TYPE_CHECKING` and inside functions included), no network class
under `drafters/` (networks live in `models/`), and no Python module over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "backend" / "specserve"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports anywhere in its body (a `from x import y` of a
    submodule y counts as importing x.y)."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_servers_modules_import_each_other_without_a_cycle():
    graph = _graph()
    assert "specserve.engine.engine" in graph and graph["specserve.engine.engine"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle_through_type_hints():
    graph = _graph()
    graph["specserve.tree"] = graph["specserve.tree"] | {"specserve.engine.engine"}  # as a TYPE_CHECKING import would
    cycle = _cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]


def test_drafters_define_no_network():
    for path in (PACKAGE / "drafters").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"nn.Module", "torch.nn.Module", "Module"}, f"{path.name}: {node.name}"


def test_no_module_is_over_500_lines():
    sources = [p for top in ("backend", "kernels", "client", "bench", "tests") for p in (ROOT / top).rglob("*.py")]
    assert len(sources) > 100
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
