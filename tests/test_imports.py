"""The import graph among specdec's modules has no cycle, function-level imports included.

A cycle hidden in a function-level import works until someone moves that import to the top or a
module starts using the other one while it loads; then `import specdec.x` fails with a partially
initialized module, or only in the order a given entry point imports things. Two such circles were
found and untied (issue 33): ``args.py`` <-> ``deploy.py`` (``QUANTIZATIONS`` now lives in
``config.py``) and the server package <-> its cluster subpackage (the flags of `specdec serve` now
live in ``server/flags.py``, ``build_app`` in ``server/app.py``, ``APP_NAME`` in ``cluster/app.py``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    """specdec's module names -> their files (a package is named by its ``__init__.py``)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The specdec modules ``name`` imports anywhere in its file (top level, functions, TYPE_CHECKING):
    ``from pkg import sub`` names the submodule when ``sub`` is one, else the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_a_cycle_through_several_modules():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_of_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "specdec"
    (pkg / "server").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "args.py").write_text("def f():\n    from specdec.deploy import X\n")
    (pkg / "deploy.py").write_text("")
    (pkg / "server" / "__init__.py").write_text("from . import app\nfrom ..args import f\n")
    (pkg / "server" / "app.py").write_text("import specdec.server\n")
    modules = {"specdec": pkg / "__init__.py", "specdec.args": pkg / "args.py", "specdec.deploy": pkg / "deploy.py",
               "specdec.server": pkg / "server" / "__init__.py", "specdec.server.app": pkg / "server" / "app.py"}
    assert imports_of("specdec.args", modules["specdec.args"], modules) == {"specdec.deploy"}
    assert imports_of("specdec.server", modules["specdec.server"], modules) == {"specdec.server.app", "specdec.args"}
    assert imports_of("specdec.server.app", modules["specdec.server.app"], modules) == {"specdec.server"}


def test_specdec_has_no_import_cycle():
    """Would have caught args.py <-> deploy.py and specdec.server <-> specdec.server.cluster (both through
    function-level imports), and specdec.server <-> server/app.py and scheduler.py (the defaults), and
    server/cluster/__init__.py <-> launch.py (APP_NAME)."""
    modules = module_names()
    assert len(modules) > 50 and "specdec.server.cluster.replica" in modules
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "specdec.deploy" in graph["specdec.args"]  # the walk sees function-level imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The rooms of loading, lowest first: a room imports only rooms before it (issue 55's arrows that ran back up:
# the kernels asking the model hub for the cache directory, the model runner, then in the runtime's room,
# importing the network that imports the runtime's caches, the quantized linears importing the GGUF file's names)
ROOMS = ("home", "kernels", "runtime", "quant", "models", "formats", "heads")


def room_of(name: str) -> str:
    """The room of a module: its first name below ``specdec``."""
    return name.split(".")[1] if "." in name else name


def arrows_up(graph: dict[str, set[str]], rooms: tuple[str, ...] = ROOMS) -> list[str]:
    """The imports of ``graph`` from a module of one of ``rooms`` into a later one."""
    rank = {r: i for i, r in enumerate(rooms)}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if room_of(a) in rank and room_of(b) in rank and rank[room_of(b)] > rank[room_of(a)])


def test_arrows_up_sees_a_lower_room_importing_a_higher_one():
    graph = {"specdec.kernels": {"specdec.formats.hub"}, "specdec.formats.hub": {"specdec.kernels", "specdec.errors"},
             "specdec.models.runner": {"specdec.models.llama", "specdec.runtime.kv_cache"}}
    assert arrows_up(graph) == ["specdec.kernels -> specdec.formats.hub"]


def test_the_rooms_of_loading_import_only_rooms_below_them():
    modules = module_names()
    assert {"specdec.formats.gguf_model", "specdec.quant.qlinear", "specdec.heads.eagle", "specdec.home"} <= set(modules)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert arrows_up(graph) == []
