"""The package's folders are its architecture: each role's modules import only their own role and the roles below."""

import ast
from pathlib import Path

import stoker

PACKAGE = Path(stoker.__file__).parent
# Lowest first, as docs/architecture.md draws them. The top two are siblings: `run` conducts `stoker train`, `use` is
# stoker outside it (the Loader, a trained model, eval and predict); neither imports the other.
LAYERS = ["common", "data", "pipeline", "training", "observe"]
TOP = ["run", "use"]
# A producer runs these: its start must not pay for torch's import (2 s on 2 cores).
TORCH_FREE = ["data", "pipeline"]


def _stoker_imports(source: Path) -> list[tuple[int, str]]:
    """(line, first folder under stoker) of every `import stoker.X...` and `from stoker.X import ...`."""
    found = []
    for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "stoker" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def test_every_module_lives_in_a_role_folder():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", "__main__.py", "cli.py"})
    assert loose == [], f"modules outside a role folder: {loose}"
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted([*LAYERS, *TOP, "bench"])


def _allowed(folder: str) -> list[str]:
    if folder in TOP:
        return [*LAYERS, folder]
    return LAYERS[: LAYERS.index(folder) + 1]


def test_imports_run_only_downward():
    upward = []
    for folder in [*LAYERS, *TOP]:
        for module in sorted((PACKAGE / folder).rglob("*.py")):
            for line, target in _stoker_imports(module):
                if target not in _allowed(folder):
                    upward.append(f"{module.relative_to(PACKAGE.parent)}:{line} imports stoker.{target}")
    assert upward == []


def _imports_torch(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "torch" for alias in node.names)
    return isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch"


def _module_level_torch(source: Path) -> list[int]:
    """Lines of `import torch...` / `from torch... import` outside any function or class (a TYPE_CHECKING block,
    which never runs, excepted)."""
    lines = []
    for node in ast.parse(source.read_text(), filename=str(source)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        lines += [inner.lineno for inner in ast.walk(node) if _imports_torch(inner)]
    return lines


def test_the_producer_side_never_imports_torch_at_module_level():
    found = [f"{module.relative_to(PACKAGE.parent)}:{line}"
             for folder in TORCH_FREE for module in sorted((PACKAGE / folder).rglob("*.py"))
             for line in _module_level_torch(module)]
    assert found == []


def test_the_torch_checker_sees_a_module_level_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import numpy\nimport torch.nn\nif True:\n    from torch import Tensor\n"
                      "def f():\n    import torch\n")
    assert _module_level_torch(module) == [2, 4]


def test_run_and_use_are_siblings_that_do_not_import_each_other():
    assert "use" not in _allowed("run") and "run" not in _allowed("use")


def test_the_checker_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from stoker.run.controller import Controller\nimport stoker.common.files\n")
    assert _stoker_imports(module) == [(1, "run"), (1, "run"), (2, "common")]


def test_the_engine_and_the_loader_take_at_most_eight_parameters():
    import inspect

    from stoker.pipeline.engine import Engine
    from stoker.use.loader import Loader

    for cls in (Engine, Loader):
        parameters = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        assert len(parameters) <= 8, (cls.__name__, parameters)


def test_no_module_imports_one_that_imports_it():
    """Module-level and TYPE_CHECKING imports between stoker's modules form no cycle."""
    modules = {".".join(m.relative_to(PACKAGE.parent).with_suffix("").parts): m for m in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("stoker."):
                targets |= {t for t in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if t in modules}
        graph[name] = targets - {name}
    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a in graph.get(b, ()) and a < b)
    assert cycles == []
