"""The layout draws the architecture: the recorder writes, the analyses read, views and the MCP server sit on top.

Read from the source's imports (every ``import``, a function's lazy ones included), so a new module cannot break
the rule unnoticed:
- ``tracer.recorder`` imports only the shared contract (``tracer``'s top modules) and ``probes``;
- ``tracer.analysis`` never imports the recorder, a view, a command or the MCP server;
- the views, the commands and ``mcp_server`` use the recorder only through ``tracer.recorder``'s own names;
- no two modules import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tracer", "mcp_server", "probes")
# the shared contract: the schema, the one histogram, /proc, errors, the live-snapshot handshake between a
# recorder and the MCP server it serves through, the vocabulary, the bearer-token check and the new-file check
CONTRACT = {
    "tracer",
    "tracer.schema",
    "tracer.sqltext",
    "tracer.hist",
    "tracer.procfs",
    "tracer.errors",
    "tracer.live",
    "tracer.vocabulary",  # the names the recorder writes and every reader shows (issue 23)
    "tracer.containers",  # container and pod identity from a cgroup path, stored and labelled (issue 32)
    "tracer.steprule",  # the one step rule: the analyses over stored calls, the live tracer_steps_total (issue 32)
    "tracer.bearer",  # the bearer-token check of the MCP server and the recorder's metrics endpoint (issue 32)
    "tracer.newfile",  # the one check of a file about to be created: the recorder's --db, the views' -o (issue 31)
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts as pkg.mod when that is a module)."""
    path = MODULES[name]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.split(".")[0] in PACKAGES and t in MODULES and t != name}
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_the_recorder_imports_only_the_contract_and_probes():
    bad = {
        (m, i)
        for m, deps in GRAPH.items()
        if _in(m, "tracer.recorder")
        for i in deps
        # tracer.snapshot reads live processes (tracer dump, and the recorder's thread snapshots): no reader of a DB
        if not (i in CONTRACT or _in(i, "tracer.recorder") or _in(i, "tracer.snapshot") or _in(i, "probes"))
    }
    assert not bad, f"the recorder imports a reader, a view or the server: {sorted(bad)}"


def test_the_analyses_never_import_the_recorder_or_what_sits_on_top():
    above = ("tracer.recorder", "tracer.views", "tracer.commands", "mcp_server")
    bad = {
        (m, i) for m, deps in GRAPH.items() if _in(m, "tracer.analysis") for i in deps if any(_in(i, a) for a in above)
    }
    assert not bad, sorted(bad)


@pytest.mark.parametrize("top", ["tracer.views", "tracer.commands", "mcp_server"])
def test_views_commands_and_server_use_only_the_recorders_public_names(top):
    bad = {(m, i) for m, deps in GRAPH.items() if _in(m, top) for i in deps if _in(i, "tracer.recorder.")}
    assert not bad, sorted(bad)


def test_no_import_cycles():
    # Tarjan's strongly connected components over the module graph: any component of two or more is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_rule_would_see_a_violation():
    # GIVEN the graph as read  THEN the reader really sees imports (a parser that saw none would pass everything)
    assert "tracer.recorder.store" in GRAPH["tracer.recorder.session"]
    assert "tracer.analysis.db" in GRAPH["mcp_server.server"]


def test_the_snapshot_reader_imports_no_analysis_view_or_server():
    above = ("tracer.analysis", "tracer.views", "tracer.commands", "mcp_server")
    bad = {
        (m, i) for m, deps in GRAPH.items() if _in(m, "tracer.snapshot") for i in deps if any(_in(i, a) for a in above)
    }
    assert not bad, sorted(bad)


def test_no_two_test_modules_share_a_name():
    # pytest imports test modules by their base name (rootdir-relative, no packages): a second test_x.py in
    # tests/integration/ fails the whole suite's collection (it did, on a merge)
    root = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    for p in sorted(root.rglob("test_*.py")):
        assert p.name not in seen, f"{p} and {seen[p.name]} share a name"
        seen[p.name] = p
