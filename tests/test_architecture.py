"""The rooms' import rules (docs/architecture.md), checked on the source with `ast`: no model, no Ray.

- The serving core (engine), the cache tiers and model I/O (modelio) never import Ray, the HTTP
  layer (api), the fleet or the deployments: they run, and are tested, in a plain process.
- The cache tiers never import the engine or model I/O: they store what any caller hands them.
- Model I/O never imports the engine: it resolves, converts and loads models for whoever asks.
- Inside the HTTP layer, the dialect rooms (api/openai, api/anthropic, api/responses) never import
  one another: what two dialects share lives in the core room (api/core: the request fields, the
  request model, the route body), so a change to one dialect cannot reach another's wire format.
  Neither they nor the core and output rooms import the service (api/service), which mounts the
  dialects' routes and hands them what they need through a declared protocol (`RouteHost`); the
  core and output rooms import no dialect room.
- No module imports a private name of mlx, mlx-lm or Ray, or reaches into one through an
  attribute (`module._name`): their private parts change without notice between releases.
- No import circles between the project's modules, counting imports inside functions and under
  `TYPE_CHECKING`: a circle means two rooms are one, or a type sits in the wrong one.
- The engine host layer (the Serve replica's engine host, the engine process's parent side, the
  wire between them and the engine worker process) never imports Ray, not even through what it
  imports: the engine worker is a plain Python process, started and tested without Ray.
- No module under tests/ imports benchmarks: the product's tests stand without the harness, whose
  own checks live beside it (benchmarks/tests/); fixtures both use live under tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "cache_tiers", "modelio", "fleet", "api", "deployments", "benchmarks")
LIBRARIES = ("mlx", "mlx_lm", "ray")
FORBIDDEN = {
    "engine": ("ray", "api", "fleet", "deployments"),
    "cache_tiers": ("ray", "api", "fleet", "deployments", "engine", "modelio"),
    "modelio": ("ray", "api", "fleet", "deployments", "engine"),
    "fleet": ("api", "deployments"),
}

DIALECT_ROOMS = ("api.openai", "api.anthropic", "api.responses")
API_FORBIDDEN = {
    **{room: tuple(d for d in DIALECT_ROOMS if d != room) + ("api.service",) for room in DIALECT_ROOMS},
    "api.core": DIALECT_ROOMS + ("api.service",),
    "api.output": DIALECT_ROOMS + ("api.service",),
}


def imports(tree: ast.AST) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names imported from it) of every import, absolute and relative to nothing."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module, tuple(a.name for a in node.names)))
    return found


def private_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """`x._name` where `x` is bound by `import lib...` / `from lib... import module` to a library."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            bound |= {a.asname or a.name for a in node.names if a.name[:1].islower()}
    return [(node.lineno, f"{node.value.id}.{node.attr}") for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in bound and node.attr.startswith("_") and not node.attr.startswith("__")]


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def violations(path: Path, root: Path = ROOT) -> list[str]:
    rel = path.relative_to(root)
    room = rel.parts[0]
    tree = ast.parse(path.read_text(), str(rel))
    bad = []
    for line, module, names in imports(tree):
        top = module.split(".")[0]
        if top in FORBIDDEN.get(room, ()):
            bad.append(f"{rel}:{line}: the {room} room imports {module}")
        if top in LIBRARIES:
            private = [p for p in module.split(".")[1:] + list(names) if p.startswith("_") and p != "__future__"]
            bad += [f"{rel}:{line}: imports the private {module}.{p}" for p in private]
    bad += [f"{rel}:{line}: reaches into {name}" for line, name in private_attributes(tree)]
    return bad + api_room_violations(rel, tree)


def api_room_violations(rel: Path, tree: ast.AST) -> list[str]:
    """An api sub-room importing a room it must not (`from api import openai` counts too)."""
    if rel.parts[0] != "api" or len(rel.parts) < 3:
        return []
    room = f"api.{rel.parts[1]}"
    bad = []
    for line, module, names in imports(tree):
        targets = [f"{module}.{n}" for n in names] if module == "api" else [module]
        for target in targets:
            hit = [r for r in API_FORBIDDEN.get(room, ()) if target == r or target.startswith(r + ".")]
            bad += [f"{rel}:{line}: the {room} room imports {target}" for _ in hit]
    return bad


def test_every_room_keeps_its_import_rules() -> None:
    found = [v for path in sources() for v in violations(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("import ray\n", "the engine room imports ray"),
    ("from api.wire import event_to_wire\n", "the engine room imports api.wire"),
    ("from mlx_lm.tokenizer_utils import _byte_decoder\n", "private mlx_lm.tokenizer_utils._byte_decoder"),
    ("from mlx_lm import utils\nutils._download('x')\n", "reaches into utils._download"),
    ("import mlx.core as mx\nmx._private\n", "reaches into mx._private"),
])
def test_a_broken_rule_is_reported(tmp_path: Path, source: str, expected: str) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "bad.py").write_text(source)
    found = violations(tmp_path / "engine" / "bad.py", root=tmp_path)
    assert any(expected in v for v in found), found


# -- import circles ------------------------------------------------------------------------------
def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project's packages by dotted name (a package by its own name)."""
    found = {}
    for path in (p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path) -> Iterator[str]:
    """The dotted names `name` (at `path`) imports, anywhere in it: module level, inside functions,
    under `TYPE_CHECKING`; relative imports resolved; `from a import b` yields `a` and `a.b`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = module_names(root)
    return {name: {m for m in imported(name, path) if m in modules and m != name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back() -> None:
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_an_import_circle_is_reported(tmp_path: Path) -> None:
    (tmp_path / "engine" / "step").mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "step" / "__init__.py").write_text("")
    (tmp_path / "engine" / "step" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.step.b import B\n")
    (tmp_path / "engine" / "step" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "engine" / "c.py").write_text("import engine.step.a\n")
    assert circles(import_graph(tmp_path)) == [["engine.step.a", "engine.step.b"]]


# -- the engine host layer runs without Ray -------------------------------------------------------
ENGINE_HOST = ("deployments.engine_host", "deployments.engine_process", "deployments.engine_ipc",
               "deployments.engine_worker")


def reaches(start: str, library: str, root: Path = ROOT) -> list[str]:
    """Import chains from `start` through project modules to `library` (empty: none)."""
    modules = module_names(root)
    graph = import_graph(root)
    chains, seen, todo = [], {start}, [[start]]
    while todo:
        chain = todo.pop()
        names = set(imported(chain[-1], modules[chain[-1]]))
        chains += [" -> ".join(chain + [n]) for n in sorted(names) if n.split(".")[0] == library]
        for m in sorted(graph[chain[-1]] - seen):
            seen.add(m)
            todo.append(chain + [m])
    return chains


@pytest.mark.parametrize("module", ENGINE_HOST)
def test_the_engine_host_layer_never_imports_ray(module: str) -> None:
    found = reaches(module, "ray")
    assert not found, "\n".join(found)


def test_a_ray_import_behind_the_engine_host_is_reported(tmp_path: Path) -> None:
    (tmp_path / "deployments").mkdir()
    (tmp_path / "deployments" / "engine_worker.py").write_text("def main():\n    from api.wire import pack\n")
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "wire.py").write_text("import ray.serve\n")
    assert reaches("deployments.engine_worker", "ray", tmp_path) == \
        ["deployments.engine_worker -> api.wire -> ray.serve"]


# -- the own step is one room ---------------------------------------------------------------------
STEP_DOORS = {"engine.runner_choice", "engine.config"}  # make_runner; the speculation settings


def test_only_the_runner_choice_and_the_config_reach_into_the_own_step() -> None:
    """The engine sees the own step through the `Runner` protocol (engine/runner.py): outside
    engine/step/ only `make_runner`'s module and the config (which parses `engine.speculative`)
    import from it. Benchmarks may import everything."""
    found = [f"{m} imports {sorted(d for d in deps if d.startswith('engine.step.'))}"
             for m, deps in import_graph().items()
             if not m.startswith(("engine.step", "benchmarks")) and m not in STEP_DOORS
             and any(d.startswith("engine.step.") for d in deps)]
    assert not found, "\n".join(found)

@pytest.mark.parametrize("room, source, expected", [
    ("anthropic", "from api.openai.chat import tool_from\n", "the api.anthropic room imports api.openai.chat"),
    ("openai", "from api import responses\n", "the api.openai room imports api.responses"),
    ("responses", "import api.anthropic.request\n", "the api.responses room imports api.anthropic.request"),
    ("core", "from api.openai.shapes import sse\n", "the api.core room imports api.openai.shapes"),
    ("responses", "from api.service.auth import tenant_of\n", "the api.responses room imports api.service.auth"),
    ("output", "from api.service.settings import AppSettings\n", "the api.output room imports api.service.settings"),
])
def test_a_dialect_room_importing_another_is_reported(tmp_path: Path, room: str, source: str, expected: str) -> None:
    (tmp_path / "api" / room).mkdir(parents=True)
    (tmp_path / "api" / room / "bad.py").write_text(source)
    found = violations(tmp_path / "api" / room / "bad.py", root=tmp_path)
    assert any(expected in v for v in found), found


def test_shared_fields_are_no_dialect_room_import() -> None:
    """A dialect reading the shared fields from the core room is allowed."""
    tree = ast.parse("from api.core.fields import tool_from\nfrom api.core.dialect import respond\n")
    assert api_room_violations(Path("api/anthropic/request.py"), tree) == []


def test_tests_never_import_benchmarks() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: imports {module}"
             for path in sorted((ROOT / "tests").rglob("*.py"))
             for line, module, _ in imports(ast.parse(path.read_text(), str(path)))
             if module.split(".")[0] == "benchmarks"]
    assert not found, "\n".join(found)
