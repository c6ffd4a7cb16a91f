"""The library's layering, read from the source with ast (nothing is imported):

    compat < common < models < data < convert < extensions < evaluation < recipes < demo

compat holds every use of a library's private API (tests/test_compat.py): all may use it, it uses
none of ours. common holds the utilities every layer may use (atomic writes, secrets). extensions
are our Composer extensions (callbacks, EMA, sample grids), evaluation the image metrics, recipes
what builds a run from a config. A package may import itself and the packages to its left, never
one to its right, nor the entry points above them all (train.py, bench/, tests/). Imports inside
functions count: they run too, and can hide a cycle (convert.__main__ -> convert.latents ->
data.image_caption -> data.synthetic -> convert.__main__ is one). No file-level import cycle is
allowed either, even inside one package. An import names the longest project module it reaches
(`from models import build` is the file models/build.py when there is one, else the package models).
"""

import ast
from pathlib import Path

from tests.conftest import REPO

LAYERS = ("compat", "common", "models", "data", "convert", "extensions", "evaluation", "recipes", "demo")


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the layered packages: dotted name -> file."""
    return {
        module_name(root, path): path
        for package in LAYERS
        if (root / package).is_dir()
        for path in sorted((root / package).rglob("*.py"))
    }


def top_level_names(root: Path) -> set[str]:
    """Importable names at the repo's top: the packages and entry points (train, bench, tests...)."""
    names = {p.stem for p in root.glob("*.py")}
    names |= {
        p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py"))
    }
    return names


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names a file imports, anywhere in it, relative imports made absolute; for
    `from X import a`, both X and X.a (a may be a submodule)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # `from .. import x` climbs level - 1 packages from this file's package
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, Path]]:
    """(module -> project modules it imports, module -> other top-level names it imports, files)."""
    modules = project_modules(root)
    outside_layers = top_level_names(root) - set(LAYERS)
    graph, entry_points = {}, {}
    for module, path in modules.items():
        graph[module], entry_points[module] = set(), set()
        for name in imported_names(module, path):
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                graph[module].add(".".join(parts))
            elif not parts and name.split(".")[0] in outside_layers:
                entry_points[module].add(name)
    return graph, entry_points, modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node or a self-loop (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward_edges(root: Path) -> list[str]:
    """`file -> module` for every import of a package to the right, or of an entry point."""
    graph, entry_points, modules = import_graph(root)
    bad = []
    for module, targets in sorted(graph.items()):
        rank = LAYERS.index(module.split(".")[0])
        for target in sorted(targets):
            if LAYERS.index(target.split(".")[0]) > rank:
                bad.append(f"{modules[module].relative_to(root)} -> {target}")
    for module, names in sorted(entry_points.items()):
        bad += [f"{modules[module].relative_to(root)} -> {name} (an entry point)" for name in sorted(names)]
    return bad


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(module.split(".")[0], set()).update(
            t.split(".")[0] for t in targets if t.split(".")[0] != module.split(".")[0]
        )
    return packages


def test_packages_import_only_to_their_left():
    bad = upward_edges(REPO)
    assert not bad, f"imports against the order {' < '.join(LAYERS)}:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph, _, modules = import_graph(REPO)
    assert set(LAYERS) <= {m.split(".")[0] for m in modules}  # the walk found every package
    assert not cycles(graph), "file-level import cycles:\n" + "\n".join(
        " <-> ".join(c) for c in cycles(graph)
    )
    packages = package_graph(graph)
    assert not cycles(packages), f"package cycles: {cycles(packages)} (edges {packages})"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checker_sees_hidden_upward_imports_and_cycles(tmp_path):
    """The hidden shapes of an upward import: a function-level import from data up into convert (via a
    relative import inside convert), which closes a cycle; an import of an entry point; and compat
    importing one of ours."""
    _write(
        tmp_path,
        {
            "compat/__init__.py": "",
            "compat/torch.py": "import torch\nfrom models import tokenizer\n",
            "models/__init__.py": "",
            "models/tokenizer.py": "import os\n",
            "data/__init__.py": "",
            "data/synthetic.py": "def prepare():\n    from convert.__main__ import main\n",
            "data/image_caption.py": "from data.synthetic import prepare\nfrom models import tokenizer\n",
            "convert/__init__.py": "",
            "convert/__main__.py": "from . import latents\n",
            "convert/latents.py": "from data.image_caption import x\n",
            "recipes/__init__.py": "",
            "recipes/trainer.py": "import train\n",
            "demo/__init__.py": "",
            "train.py": "",
        },
    )
    assert upward_edges(tmp_path) == [
        "compat/torch.py -> models",
        "compat/torch.py -> models.tokenizer",
        "data/synthetic.py -> convert.__main__",
        "recipes/trainer.py -> train (an entry point)",
    ]
    graph, _, _ = import_graph(tmp_path)
    assert graph["data.image_caption"] == {"data.synthetic", "models", "models.tokenizer"}
    assert cycles(graph) == [["convert.__main__", "convert.latents", "data.image_caption", "data.synthetic"]]
    assert cycles(package_graph(graph)) == [["convert", "data"]]


def test_no_two_modules_share_a_name():
    """A name says which module it is: `samples.py` in two packages, or `evaluate.py`, made readers
    (and tracebacks) ambiguous. Package markers aside, every module of the layered packages has a name
    of its own. A family folder's modules are named by their folder and their role (every
    models/families/<name>/ has its model.py, presets.py and family.py), so they are left out."""
    names: dict[str, list[str]] = {}
    for module, path in project_modules(REPO).items():
        if path.stem not in ("__init__", "__main__") and not module.startswith("models.families."):
            names.setdefault(path.stem, []).append(module)
    assert {name: where for name, where in names.items() if len(where) > 1} == {}
