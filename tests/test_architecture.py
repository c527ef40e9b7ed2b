"""The rooms' import rules (docs/architecture.md), checked on the source with `ast`: no model, no Ray.

- The serving core (engine), the cache tiers and model I/O (modelio) never import Ray, the HTTP
  layer (api), the fleet or the deployments: they run, and are tested, in a plain process.
- The cache tiers never import the engine or model I/O: they store what any caller hands them.
- Model I/O never imports the engine: it resolves, converts and loads models for whoever asks.
- No module imports a private name of mlx, mlx-lm or Ray, or reaches into one through an
  attribute (`module._name`): their private parts change without notice between releases.
- No module under tests/ imports benchmarks: the product's tests stand without the harness, whose
  own checks live beside it (benchmarks/tests/); fixtures both use live under tests/.
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


def test_tests_never_import_benchmarks() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: imports {module}"
             for path in sorted((ROOT / "tests").rglob("*.py"))
             for line, module, _ in imports(ast.parse(path.read_text(), str(path)))
             if module.split(".")[0] == "benchmarks"]
    assert not found, "\n".join(found)
