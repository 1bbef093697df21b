"""The package's layers point one way: a module imports only from its own layer or the layers
below it (imports inside functions count too), and no modules import each other in a circle.

The layers, top to bottom, are LAYERS below. KNOWN_UPWARD lists the imports that still point
up, each with what removing it needs; the test fails on any other, so the list only shrinks.
"""
from __future__ import annotations

import ast
from pathlib import Path

import vramfit

ROOT = Path(vramfit.__file__).parent
LAYERS = [
    {"__main__", "cli", "demo", "launch"},  # entry points: parse, call the library
    {"run"},  # one training run: the plan and the probe around train/
    {"fit"},  # policy: planner, model facts, fit probe, spill watch
    {"train"},  # the loop and the pieces a run is made of
    {"generate", "lora_tools"},  # sampling pipelines (sample grids, class images use them); LoRA merge/extract
    {"models"},  # families: loading, layouts, encoding, objectives
    {"optim"},  # optimizers, the step in backward
    {"memory"},  # mechanisms: streaming, quantization, rounding, checkpointing, accounting
    {"data"},  # scan, buckets, cache
    {"formats"},  # safetensors IO, key maps
    {"config"},  # the schema and its loading
    {"__init__"},
]
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left; the test fails on any new one


def _layer(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"{name} is in no layer of tests/test_layers.py: give it one")


def _room(module: str) -> str:
    """The top-level package or module of vramfit that `module` (dotted) belongs to."""
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports() -> dict[str, set[str]]:
    """Every module file under src/vramfit (relative path) -> the vramfit modules it imports."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names
                             if (ROOT / Path(*node.module.split(".")[1:]) / f"{a.name}.py").is_file())
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        found[rel] = {n for n in names if n == "vramfit" or n.startswith("vramfit.")}
    return found


def _file_room(rel: str) -> str:
    return rel.split("/")[0].removesuffix(".py")


def test_imports_point_down_the_layers():
    upward = []
    for rel, modules in _imports().items():
        here = _layer(_file_room(rel))
        for module in modules:
            if _layer(_room(module)) < here and (rel, module) not in KNOWN_UPWARD:
                upward.append(f"{rel} imports {module}")
    assert not upward, "imports from a lower layer up to a higher one:\n  " + "\n  ".join(upward)


def test_the_known_upward_imports_are_still_there():
    """An entry of KNOWN_UPWARD that was removed from the code must leave the list too."""
    imports = _imports()
    gone = [pair for pair in KNOWN_UPWARD if pair[1] not in imports.get(pair[0], set())]
    assert not gone, f"remove from KNOWN_UPWARD: {gone}"


def _module_file(module: str) -> str | None:
    parts = module.split(".")[1:]
    for rel in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
        if (ROOT / rel).is_file():
            return rel
    return None


def test_no_modules_import_each_other_in_a_circle():
    graph = {rel: {f for m in modules if (f := _module_file(m)) and f != rel
                   and (rel, m) not in KNOWN_UPWARD}
             for rel, modules in _imports().items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "modules that import each other in a circle:\n  " + "\n  ".join(circles)
