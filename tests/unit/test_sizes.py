"""Sizes a reader can hold in their head: no class over 400 lines, no function over 50 (the C extension's included),
and the controller, the loop that conducts a run, importing from at most 20 modules."""

import ast
import re
from pathlib import Path

import stoker

PACKAGE = Path(stoker.__file__).parent
CLASS_LINES = 400
FUNCTION_LINES = 50
CONTROLLER_MODULES = 20
# a C function's head starts a line with its type (not a comment, a directive or a `struct` block) and has a `(`; its
# body ends at the first `}` that starts a line
C_HEAD = re.compile(r"^(?:static\s+)?[A-Za-z_][\w\s\*]*\b\w+\s*\(")


def python_sizes(source: str) -> list[tuple[str, str, int]]:
    """(kind, name, lines) of every class and function in `source`, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            found.append((kind, node.name, node.end_lineno - first + 1))
    return found


def c_function_sizes(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function defined in a C file, its head to its closing brace."""
    lines, found = source.splitlines(), []
    for index, line in enumerate(lines):
        if not C_HEAD.match(line):
            continue
        opened = next(at for at in range(index, len(lines)) if "{" in lines[at] or lines[at].rstrip().endswith(";"))
        if "{" not in lines[opened]:  # a declaration
            continue
        one_line = lines[opened].rstrip().endswith("}")
        close = opened if one_line else next(at for at in range(opened + 1, len(lines)) if lines[at].startswith("}"))
        found.append((re.findall(r"(\w+)\s*\(", line)[0], close - index + 1))
    return found


def test_no_class_over_400_lines_and_no_function_over_50():
    too_long = [f"{path.relative_to(PACKAGE)}: {kind} {name}, {lines} lines"
                for path in sorted(PACKAGE.rglob("*.py"))
                for kind, name, lines in python_sizes(path.read_text())
                if lines > (CLASS_LINES if kind == "class" else FUNCTION_LINES)]
    assert too_long == []


def test_no_c_function_over_50_lines():
    sources = sorted(PACKAGE.rglob("*.c"))
    assert sources, "the C extension's source was not found"
    sizes = [(path, name, lines) for path in sources for name, lines in c_function_sizes(path.read_text())]
    assert {"decode", "restart_every_mcu"} <= {name for _, name, _ in sizes}  # the entry points are seen
    too_long = [(str(path.relative_to(PACKAGE)), name, lines) for path, name, lines in sizes if lines > FUNCTION_LINES]
    assert too_long == []


def test_the_controller_imports_from_at_most_20_modules():
    tree = ast.parse((PACKAGE / "run" / "controller.py").read_text())
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert len(modules) <= CONTROLLER_MODULES, sorted(modules)


def test_the_size_readers_count_what_they_should():
    python = ("@decorated\ndef long():\n" + "    x = 1\n" * 50 + "\nclass Small:\n    def method(self):\n"
              "        return 1\n")
    assert python_sizes(python) == [("function", "long", 52), ("class", "Small", 3), ("function", "method", 2)]
    c = ("/* a comment (with parentheses) */\n#include <x.h>\nstruct point {\n    int x;\n};\n"
         "static int one(int a) { return a; }\n"
         "static void *split(int a,\n                   int b) {\n    call(a);\n    if (b) {\n        call(b);\n"
         "    }\n}\n\nint declared(int a);\n")
    assert c_function_sizes(c) == [("one", 1), ("split", 7)]
