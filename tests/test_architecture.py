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
"""

from __future__ import annotations

import ast
from pathlib import Path

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
