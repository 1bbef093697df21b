"""A family is one folder: models/<family>/ holds everything that knows the family, and the rest of
vramfit asks it through the Family protocol (models/adapter.py) found in the registry.

So no module outside the family folders names a family in its code (a family's name as a key, a
comparison, a config file's name: a string without spaces that holds the name; docstrings,
comments and prose messages aside), no module outside them imports them but the registry, the
families import nothing of each other, and every registered family answers the whole protocol.
The one name list that cannot come from the registry is model.family's Literal in
config/schema.py (config/ sits below models/ and cannot import it): it must list the registry's.
"""
from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import vramfit
from vramfit.config.schema import ModelConfig
from vramfit.formats.lora import LoraFamily
from vramfit.models.adapter import Family
from vramfit.models.registry import FAMILIES

ROOT = Path(vramfit.__file__).parent
FOLDERS = {f"models/{name}/" for name in FAMILIES}
NAMED = re.compile(r"(?<![a-z0-9])(" + "|".join(map(re.escape, FAMILIES)) + r")(?![a-z0-9])")


def _sources() -> dict[str, ast.Module]:
    """Every module of the package outside the family folders (relative path -> its syntax tree)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(tuple(FOLDERS)):
            found[rel] = ast.parse(path.read_text(encoding="utf-8"))
    return found


def _docstrings(tree: ast.Module) -> set[int]:
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, kinds))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _schema_literal(rel: str, tree: ast.Module) -> set[int]:
    """The constants of config/schema.py's `Literal[...]` subscripts (model.family's choices)."""
    if rel != "config/schema.py":
        return set()
    return {id(c) for n in ast.walk(tree)
            if isinstance(n, ast.Subscript) and getattr(n.value, "id", "") == "Literal"
            for c in ast.walk(n.slice) if isinstance(c, ast.Constant)}


def _names_a_family(node: ast.AST) -> bool:
    """A string constant without whitespace (a key, a value compared, a file name: not prose) that
    holds a family's name as a word of its own ("sd3", "tiny_sd3_unet", "sd3-medium"; not "sd3m")."""
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and not re.search(r"\s", node.value) and NAMED.search(node.value) is not None)


def test_no_module_outside_the_family_folders_names_a_family():
    named = []
    for rel, tree in _sources().items():
        skip = _docstrings(tree) | _schema_literal(rel, tree)
        named += [f"{rel}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if _names_a_family(node) and id(node) not in skip]
    assert not named, ("family names outside models/<family>/ (ask the family instead):\n  "
                       + "\n  ".join(named))


def test_the_check_finds_a_family_name_where_there_is_one():
    """The check above can fail: it sees a key, a comparison and a file name, and leaves prose alone."""
    name = next(iter(FAMILIES))
    tree = ast.parse(f"x = {{'{name}': 1}}\nif y == '{name}': pass\nz = 'tiny_{name}_unet'\n"
                     f"w = 'applies to {name} models only'\n")
    hits = sorted(node.value for node in ast.walk(tree) if _names_a_family(node))
    assert hits == sorted([name, name, f"tiny_{name}_unet"])


def _imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_only_the_registry_imports_a_family_folder_and_families_import_no_other():
    packages = {name: f"vramfit.models.{name}" for name in FAMILIES}
    wrong = []
    for rel, tree in _sources().items():
        for module in _imported(tree):
            inside = any(module == p or module.startswith(p + ".") for p in packages.values())
            if inside and rel != "models/registry.py":
                wrong.append(f"{rel} imports {module}")
    for name in FAMILIES:
        for path in sorted((ROOT / "models" / name).rglob("*.py")):
            for module in _imported(ast.parse(path.read_text(encoding="utf-8"))):
                if any(module == p or module.startswith(p + ".") for n, p in packages.items() if n != name):
                    wrong.append(f"{path.relative_to(ROOT).as_posix()} imports {module}")
    assert not wrong, "\n".join(wrong)


def _protocol_members() -> set[str]:
    """The attributes and methods the Family protocol (with LoraFamily's) declares."""
    members = set()
    for cls in (Family, LoraFamily):
        members.update(vars(cls).get("__annotations__", {}))
        members.update(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_"))
    return members


def test_every_family_is_a_folder_that_answers_the_whole_protocol():
    members = _protocol_members()
    assert {"name", "pipeline", "kohya_names", "activations", "synthetic_batch", "block_containers",
            "lora_tensors", "files"} <= members
    for name, family in FAMILIES.items():
        assert family.name == name
        assert (ROOT / "models" / name / "__init__.py").is_file(), f"models/{name}/ is not a package"
        assert type(family).__module__.startswith(f"vramfit.models.{name}."), type(family).__module__
        missing = sorted(m for m in members if not hasattr(family, m))
        assert not missing, f"{name} does not answer {missing}"


def test_model_family_choices_are_the_registry_families():
    choices = typing.get_args(ModelConfig.model_fields["family"].annotation)
    assert set(choices) == {"auto", *FAMILIES}
