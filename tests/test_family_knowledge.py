"""Family knowledge lives in the family folders (models/families/*/, each declaring its `Family`) and
the registry that lists them (models/registry.py): product code asks the registry (`of(preset)`,
`of_model(model)`) and never branches on a family. Read from the source's syntax trees, the lines
that do: a comparison with a family's name or with a family lookup (`family(...)`), an
isinstance/issubclass against a family's model class, a dict keyed by family names, or a subscript
by one. Issue 38's bound: at most 2 files, at most 20 lines."""

import ast
from pathlib import Path

import pytest

from models.registry import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = [
    "models",
    "convert",
    "data",
    "recipes",
    "extensions",
    "evaluation",
    "launch",
    "common",
    "compat",
    "demo",
    "bench",
]
NAMES = set(FAMILIES)
CLASSES = {family.model_class.__name__ for family in FAMILIES.values()}
LOOKUPS = {"family", "family_name", "of_record", "weights_family"}  # calls that give a family's name


def _called(node) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return None


def _named(node) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def branches(source: str) -> set[int]:
    """The lines of `source` that branch on a family (see the module docstring)."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            hit = any(_named(o) or _called(o) in LOOKUPS for o in (node.left, *node.comparators))
        elif (
            isinstance(node, ast.Call)
            and _called(node) in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            hit = any(getattr(k, "id", getattr(k, "attr", None)) in CLASSES for k in kinds)
        elif isinstance(node, ast.Dict):
            hit = any(_named(key) for key in node.keys if key is not None)
        elif isinstance(node, ast.Subscript):
            hit = _named(node.slice)
        else:
            hit = False
        if hit:
            lines.add(node.lineno)
    return lines


def family_branches() -> dict[str, set[int]]:
    files = [p for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))] + [ROOT / "train.py"]
    found = {str(p.relative_to(ROOT)): branches(p.read_text()) for p in files}
    return {path: lines for path, lines in found.items() if lines}


@pytest.mark.heavy
def test_family_knowledge_stays_in_the_table():
    found = family_branches()
    assert len(found) <= 2 and sum(map(len, found.values())) <= 20, found
    assert set(found) <= {"models/registry.py"} | {
        str(p.relative_to(ROOT)) for p in ROOT.glob("models/families/*/*.py")
    }, found


@pytest.mark.parametrize(
    "line",
    [
        'if family(preset) == "sdxl": pass',
        "if isinstance(model, StableDiffusionXL): pass",
        'x = {"sd": 1, "mmdit": 2}',
        'x = FAMILIES["mmdit"]',
        "if of_record(record) != name: pass",
    ],
)
def test_the_scan_sees_each_kind_of_branch(line):
    assert branches(line) == {1}


def test_the_scan_leaves_generic_code_alone():
    assert (
        branches('family = of(preset)\nif family.reads_t5 and name == "unet": pass\nx = {"vae": 1}') == set()
    )
