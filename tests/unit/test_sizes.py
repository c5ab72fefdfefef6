"""Sizes a reader can hold in their head: no class over 400 lines, no function over 50 (the C extension's included),
and the controller, the loop that conducts a run, importing from at most 20 of stoker's modules."""

import ast
import re

from tests.unit.test_layout import PACKAGE, _imports_graph

CLASS_LINES = 400
FUNCTION_LINES = 50
CONTROLLER_MODULES = 20
# what C's braces cannot be counted through: comments, strings, character constants, preprocessor lines (and their
# continuations)
C_NOT_CODE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|^[ \t]*#(?:[^\n]*\\\n)*[^\n]*',
                        re.DOTALL | re.MULTILINE)


def python_sizes(source: str) -> list[tuple[str, str, int]]:
    """(kind, name, lines) of every class and function in `source`, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            found.append((kind, node.name, (node.end_lineno or node.lineno) - first + 1))
    return found


def c_function_sizes(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function defined in a C file: a brace block at file level whose head (the code since
    the last `;` or `}` there) has a `(` and no `=` (an initializer), from the head's first line to the closing
    brace, braces counted outside comments, strings and preprocessor lines."""
    code = C_NOT_CODE.sub(lambda match: re.sub(r"[^\n]", " ", match.group()), source)
    found, depth, head_at, opened = [], 0, 0, None
    for at, char in enumerate(code):
        if char == "{":
            head = code[head_at:at]
            if depth == 0 and "(" in head and "=" not in head:
                opened = (head_at + len(head) - len(head.lstrip()), re.findall(r"(\w+)\s*\(", head)[0])
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                if opened is not None:
                    found.append((opened[1], code.count("\n", opened[0], at) + 1))
                opened, head_at = None, at + 1
        elif char == ";" and depth == 0:
            head_at = at + 1
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


def test_the_controller_imports_from_at_most_20_of_stoker_s_modules():
    """Counted as the layout test's import graph counts them: `from stoker.run import outcome, prestart` is two."""
    modules = _imports_graph(PACKAGE, module_level_only=False)["stoker.run.controller"]
    assert len(modules) <= CONTROLLER_MODULES, sorted(modules)


def test_the_size_readers_count_what_they_should():
    python = ("@decorated\ndef long():\n" + "    x = 1\n" * 50 + "\nclass Small:\n    def method(self):\n"
              "        return 1\n")
    assert python_sizes(python) == [("function", "long", 52), ("class", "Small", 3), ("function", "method", 2)]
    c = ("/* a comment { with a brace } and (parentheses) */\n#include <x.h>\n"
         "#define BLOCK(x) { \\\n    (x); }\n"
         "struct point {\n    int x;\n};\nstatic const int table[] = {1, 2};\n"
         "static int one(int a) { return a; }\n"
         "static int\nsplit(int a,\n      int b)\n{\n    call(\"}\", '{');\n    if (b) {\n        call(b);\n"
         "}\n    return 0;\n}\n\nint declared(int a);\n"
         "PyMODINIT_FUNC PyInit_x(void) { return make(&module); }\n")
    assert c_function_sizes(c) == [("one", 1), ("split", 10), ("PyInit_x", 1)]
