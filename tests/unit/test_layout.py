"""The package's folders are its architecture: each role's modules import only their own role and the roles below."""

import ast
import os
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
    """Sections and specs are handed down whole: no constructor of the feed takes its settings one by one (the
    Loader's keywords past its first eight are keyword-only, each a setting of its own)."""
    import inspect

    from stoker.pipeline.driver import EngineDriver
    from stoker.pipeline.engine import Engine, EngineSpec, ProducerCounts
    from stoker.use.loader import Loader

    for function in (Engine.__init__, EngineDriver.__init__, EngineSpec.from_sections, ProducerCounts.from_sections):
        parameters = [p for p in inspect.signature(function).parameters if p != "self"]
        assert len(parameters) <= 8, (function.__qualname__, parameters)
    positional = [p.name for p in inspect.signature(Loader).parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert len(positional) <= 8, positional


def test_the_loader_s_signature_names_every_setting_it_takes_with_its_default():
    """`help(stoker.Loader)` and an IDE show every keyword: none hides behind **settings, and each setting's
    default is the one `stoker train` has."""
    import inspect

    from stoker.common.config import default_of
    from stoker.use.loader import LOADER_SETTINGS, Loader

    parameters = inspect.signature(Loader).parameters
    assert not [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert set(parameters) == {*LOADER_SETTINGS, "data", "device", "metrics_file"}
    defaults = {name: parameters[name].default for name in LOADER_SETTINGS if name != "batch_size"}
    assert defaults == {name: default_of(name) for name in defaults}


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path) -> dict[str, Path]:
    return {_module_name(path, package): path for path in package.rglob("*.py")}


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """The nodes that run when the module is imported: not inside a function or a class, nor under
    TYPE_CHECKING."""
    return [inner for node in tree.body
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
            for inner in ast.walk(node)]


def _imports_graph(package: Path, module_level_only: bool) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of it that it imports (`from a.b import c` names a.b.c where c is
    a module, else a.b). `module_level_only`: the imports that run as it is imported, and the packages above
    each, whose __init__ runs first; else every import in the file, also inside functions and TYPE_CHECKING."""
    modules = _modules(package)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in _module_level(tree) if module_level_only else ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = {f"{node.module}.{alias.name}" for alias in node.names}  # a module, or a name in one
                targets |= {t if t in modules else node.module for t in named}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        if module_level_only:
            targets |= {".".join(t.split(".")[:i]) for t in set(targets) for i in range(1, t.count(".") + 1)}
            targets |= {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # its own packages
        graph[name] = {t for t in targets if t in modules} - {name}
    return graph


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def _torch_reached_from(package: Path, folders: list[str]) -> list[str]:
    """'module -> importer of torch' for each module of `folders` whose import, followed through every module it
    imports as it is imported, reaches a module-level `import torch`."""
    modules = _modules(package)
    graph = _imports_graph(package, module_level_only=True)
    importers = {name for name, path in modules.items() if _module_level_torch(path)}
    return sorted(f"{name} -> {', '.join(sorted(_reached(graph, name) & importers))}"
                  for name in modules if name.split(".")[1:2] and name.split(".")[1] in folders
                  and _reached(graph, name) & importers)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds a cycle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_producer_side_never_reaches_torch_through_what_it_imports():
    """A direct `import torch` is not the only way in: `pipeline/scheduler.py` once imported a checkpoint module
    that imported torch, and every producer paid 2 s for it."""
    assert _torch_reached_from(PACKAGE, TORCH_FREE) == []


def test_importing_the_driver_leaves_torch_out():
    """What the layout checker reads, checked by the interpreter itself."""
    import subprocess
    import sys

    code = "import sys, stoker.pipeline.driver, stoker.pipeline.producer; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_torch_checker_follows_imports_through_other_modules_and_packages(tmp_path):
    package = _package(tmp_path, {
        "low/__init__.py": "", "low/a.py": "from pkg.low import b\n", "low/b.py": "import pkg.mid.c\n",
        "mid/__init__.py": "import torch\n", "mid/c.py": "def f():\n    import torch\n",
        "low/lazy.py": "def f():\n    from pkg.low import heavy\n", "low/heavy.py": "import torch\n"})
    assert _torch_reached_from(package, ["low"]) == ["pkg.low.a -> pkg.mid", "pkg.low.b -> pkg.mid",
                                                     "pkg.low.heavy -> pkg.low.heavy"]


def test_the_cycle_checker_finds_a_cycle_of_any_length(tmp_path):
    package = _package(tmp_path, {
        "a.py": "from pkg import b\n", "b.py": "import pkg.c\n", "c.py": "def f():\n    from pkg.a import x\n",
        "d.py": "from pkg import a\n", "e.py": "import pkg.f\n", "f.py": "import pkg.e\n"})
    assert _cycles(_imports_graph(package, module_level_only=False)) == [["pkg.a", "pkg.b", "pkg.c"],
                                                                          ["pkg.e", "pkg.f"]]


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
    """No cycle of any length among stoker's modules, counting every import (in functions and TYPE_CHECKING
    blocks too: a cycle there is a layering that runs both ways)."""
    assert _cycles(_imports_graph(PACKAGE, module_level_only=False)) == []
