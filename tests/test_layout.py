"""The package's rooms stay apart: no import cycle (function-local imports included, TYPE_CHECKING
imports excepted), the proxy's entry loads nothing of the instance or the engine, and the layering
rules that the folder docstrings state."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvpush"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """kvpush modules that `path` imports anywhere (top level or inside functions)."""
    tree = ast.parse(path.read_text())
    skip, out = _type_checking_nodes(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvpush"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
            out |= subs or {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvpush")}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) & mods.keys() for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    assert _cycle(_graph()) is None


def _deps_of(prefix: str, graph: dict[str, set[str]]) -> set[str]:
    return {d for m, deps in graph.items() if m == prefix or m.startswith(prefix + ".") for d in deps}


def test_rooms_import_only_what_their_docstrings_allow():
    graph = _graph()
    # The proxy shares kvpush.protocol with the instance; it never imports the instance or the engine.
    assert not {d for d in _deps_of("kvpush.proxy", graph)
                if d.split(".")[1] in {"instance", "engine", "transfer", "models", "layers", "launcher"}}
    # Tensor code knows no scheduling types: the sampler gets values and returns values.
    assert not {d for d in _deps_of("kvpush.layers", graph)
                if d in {"kvpush.engine.request", "kvpush.engine.scheduler", "kvpush.engine.engine"}}
    # The connectors implement the engine's interface (engine/kv_connector.py), not the scheduler's module.
    assert "kvpush.engine.scheduler" not in _deps_of("kvpush.transfer", graph)
    # The legs' wire types live in kvpush.protocol; the engine's request carries none (only its Trace).
    assert "kvpush.protocol.kv_params" not in graph["kvpush.engine.request"]
    # The engine imports nothing of the transfer layer, the instance or the proxy.
    assert not {d for d in _deps_of("kvpush.engine", graph) if d.split(".")[1] in {"transfer", "instance", "proxy"}}


def _loaded_by(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


def test_the_proxy_entry_loads_no_instance_engine_or_torch():
    loaded = _loaded_by("import kvpush.cli, kvpush.proxy.proxy")
    assert "kvpush.proxy.proxy" in loaded  # the probe sees what it loads
    banned = {m for m in loaded if m.split(".")[0] == "torch"
              or m.startswith(("kvpush.instance", "kvpush.engine", "kvpush.transfer", "kvpush.models",
                               "kvpush.layers"))}
    assert banned == set()


def test_import_kvpush_is_lazy():
    loaded = _loaded_by("import kvpush")
    assert {m for m in loaded if m.startswith("kvpush.")} == set()
    loaded = _loaded_by("from kvpush import SamplingParams; SamplingParams(max_tokens=1)")
    assert "kvpush.engine.sampling_params" in loaded
