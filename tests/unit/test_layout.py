"""The package's folders are its architecture: each role's modules import only their own role and the roles below."""

import ast
from pathlib import Path

import stoker

PACKAGE = Path(stoker.__file__).parent
# Lowest first, as docs/design.md draws them.
LAYERS = ["common", "data", "pipeline", "training", "observe", "run"]


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
    assert folders == sorted([*LAYERS, "bench"])


def test_imports_run_only_downward():
    upward = []
    for layer_index, layer in enumerate(LAYERS):
        for module in sorted((PACKAGE / layer).rglob("*.py")):
            for line, target in _stoker_imports(module):
                allowed = target in LAYERS[: layer_index + 1]
                if not allowed:
                    upward.append(f"{module.relative_to(PACKAGE.parent)}:{line} imports stoker.{target}")
    assert upward == []


def test_the_checker_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from stoker.run.controller import Controller\nimport stoker.common.files\n")
    assert _stoker_imports(module) == [(1, "run"), (1, "run"), (2, "common")]
