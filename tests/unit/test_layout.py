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


def test_the_engine_its_driver_and_the_loader_take_at_most_eight_parameters():
    """Sections and specs are handed down whole: no constructor of the feed takes its settings one by one."""
    import inspect

    from stoker.pipeline.driver import EngineDriver
    from stoker.pipeline.engine import Engine, EngineSpec, ProducerCounts
    from stoker.use.loader import Loader

    for function in (Engine.__init__, EngineDriver.__init__, EngineSpec.from_sections, ProducerCounts.from_sections,
                     Loader.__init__):
        parameters = [p for p in inspect.signature(function).parameters if p != "self"]
        assert len(parameters) <= 8, (function.__qualname__, parameters)


def _names(source: Path, name: str) -> list[int]:
    """Lines where `source` names `name`: imports it, or uses it in code or an annotation."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source.read_text()))
                   if isinstance(node, ast.Name) and node.id == name
                   or isinstance(node, ast.alias) and (node.asname or node.name).split(".")[-1] == name})


def test_the_drivers_reach_the_engine_only_through_its_driver():
    """The controller and the Loader drive the engine through `pipeline/driver.py`, its only face."""
    named = {module: _names(PACKAGE / module, "Engine") for module in ("run/controller.py", "use/loader.py")}
    assert named == {"run/controller.py": [], "use/loader.py": []}


def test_the_name_finder_sees_an_import_and_an_annotation(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from stoker.pipeline.engine import Engine\nx: Engine | None = None\nEngineSpec = 1\n")
    assert _names(module, "Engine") == [1, 2]


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
