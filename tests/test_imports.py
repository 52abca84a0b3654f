"""The package's import graph, read from the source: no cycle among entmtp's modules (imports
inside functions count), and only the command line's entry points import the command line."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "entmtp"
CLI_ENTRY_POINTS = {"cli", "__main__"}


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The entmtp modules `source` (a module of the package) imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif node.level == 0 and node.module and node.module.split(".")[0] == "entmtp":
                parts = node.module.split(".")
                names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            else:
                continue
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("entmtp.")]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    files = {p.stem: p for p in pkg.glob("*.py")}
    modules = set(files) - {"__init__"}
    return {m: imported_modules(files[m].read_text(encoding="utf-8"), modules) - {m} for m in sorted(modules)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_the_graph_finds_every_kind_of_import(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\nimport entmtp.c\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "c.py").write_text("class K:\n    def g(self):\n        from entmtp.a import y\n")
    (tmp_path / "d.py").write_text("import os\nfrom .missing import z\n")
    g = import_graph(tmp_path)
    assert g == {"a": {"b", "c"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_among_entmtp_modules():
    g = import_graph()
    assert {"cli", "methods", "models", "decoding"} <= set(g)
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_entry_points_import_the_cli():
    importers = sorted(m for m, deps in import_graph().items() if "cli" in deps)
    assert set(importers) <= CLI_ENTRY_POINTS, f"{importers} import entmtp.cli: use entmtp.methods and the library instead"
