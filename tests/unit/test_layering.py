"""The house's floors, from the ground up: ced/ (the library; its command lines in ced/cli/),
evals/ (the measuring tools: they run models and write per-example results), analysis/ (reads
those results and publishes), and experiments/ and benchmarks/ on top. An import points down or
sideways, never up, and no two modules import each other through any chain: no import cycle
anywhere in the tree, not even lazily inside a function. Read with `ast`, so an import in any
branch counts, executed or not."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UPPER_FLOORS = ("experiments", "evals", "analysis", "benchmarks")
PROJECT = ("ced", "evals", "analysis", "experiments", "benchmarks")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, at any depth of the tree."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def module_name(path: Path, root: Path = ROOT) -> str:
    """`ced/train/__init__.py` -> `ced.train`, `evals/suites/runner.py` -> `evals.suites.runner`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_targets(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project modules `path` (module `name`) imports, at any depth of its tree: `from P
    import m` names the module P.m where that is one, else P; a relative import is resolved
    against the module's package. A module's own ancestor packages are left out (Python
    imports them before the module, whatever the module says)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value))
    targets = set()
    for target in found:
        while target and target not in modules:      # `import a.b.c` of a name inside a.b
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            targets.add(target)
    return targets


def import_graph(root: Path = ROOT, folders: tuple[str, ...] = PROJECT) -> dict[str, set[str]]:
    """{module: the project modules it imports} over every .py file under `folders`."""
    paths = {module_name(p, root): p for folder in folders for p in (root / folder).rglob("*.py")}
    return {name: imported_targets(path, name, set(paths)) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as its path [a, b, ..., a], or None (depth-first search)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_fabricated_cycle(tmp_path):
    for folder, text in {"ced": "", "evals": "", "analysis": ""}.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text(text)
    (tmp_path / "ced" / "lib.py").write_text("import json\n")
    (tmp_path / "evals" / "tool.py").write_text("from ced import lib\n")
    (tmp_path / "analysis" / "a.py").write_text("from evals.tool import x\n"
                                                 "def f():\n    from . import b\n")
    (tmp_path / "analysis" / "b.py").write_text("from analysis.c import y\n")
    (tmp_path / "analysis" / "c.py").write_text("def g():\n    import analysis.a\n")
    graph = import_graph(tmp_path, ("ced", "evals", "analysis"))
    assert graph["evals.tool"] == {"ced.lib"} and graph["analysis.a"] == {"evals.tool",
                                                                         "analysis.b"}
    assert find_cycle(graph) == ["analysis.a", "analysis.b", "analysis.c", "analysis.a"]
    (tmp_path / "analysis" / "c.py").write_text("import evals.tool\n")
    assert find_cycle(import_graph(tmp_path, ("ced", "evals", "analysis"))) is None


def test_no_import_cycle_anywhere_in_the_tree():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("path", sorted((ROOT / "evals").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_evals_imports_nothing_from_analysis_or_above(path):
    upward = [f"{path.relative_to(ROOT)}:{line}: {module}"
              for line, module in imported_modules(path)
              if module.split(".")[0] in ("analysis", "experiments", "benchmarks")]
    assert not upward, ("evals/ measures; analysis/ reads what it wrote and sits above it: "
                        + "; ".join(upward))


@pytest.mark.parametrize("path", sorted((ROOT / "analysis").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_analysis_imports_nothing_from_the_drivers_above(path):
    upward = [f"{path.relative_to(ROOT)}:{line}: {module}"
              for line, module in imported_modules(path)
              if module.split(".")[0] in ("experiments", "benchmarks")]
    assert not upward, "analysis/ sits below experiments/ and benchmarks/: " + "; ".join(upward)


# `python -m ced.train`, `python -m ced.cost` and `python -m ced.tracking` run these: entry
# points of the command line, which they import; no library module imports them.
ENTRY_POINTS = ("ced/train/__main__.py", "ced/cost/__main__.py", "ced/tracking/__main__.py")


@pytest.mark.parametrize("path", sorted((ROOT / "ced").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_does_not_import_its_command_line(path):
    relative = str(path.relative_to(ROOT))
    if relative.startswith("ced/cli/") or relative in ENTRY_POINTS:
        return
    found = [f"{relative}:{line}: {module}" for line, module in imported_modules(path)
             if module == "ced.cli" or module.startswith("ced.cli.")]
    relative_cli = [f"{relative}:{node.lineno}: .{node.module}"
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.level
                    and (node.module or "").split(".")[0] == "cli"]
    assert not found + relative_cli, ("ced/ is the library; ced/cli/ is its command line "
                                      "and sits above it: " + "; ".join(found + relative_cli))


# The one library module that asks Hydra something: a relative data path is read against the
# directory the run started in, should a user turn Hydra's chdir back on (the apps set it off).
HYDRA_IN_THE_LIBRARY = {"ced/data/corpora.py"}


def test_the_library_parses_no_command_line():
    """argparse lives in ced/cli/ only, and Hydra too but for HYDRA_IN_THE_LIBRARY: a library
    module that parses arguments or reads the app's overrides is a command line that has not
    moved up yet."""
    found = [f"{rel}:{line}: {module}"
             for path in sorted((ROOT / "ced").rglob("*.py"))
             if not (rel := str(path.relative_to(ROOT))).startswith("ced/cli/")
             for line, module in imported_modules(path)
             if module == "argparse" or (module.split(".")[0] == "hydra"
                                         and rel not in HYDRA_IN_THE_LIBRARY)]
    assert not found, "the command line's imports outside ced/cli/: " + "; ".join(found)


def test_the_command_line_borrows_no_private_name_from_the_library():
    borrowed = []
    for path in sorted((ROOT / "ced" / "cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ced"):
                borrowed += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}"
                             for a in node.names if a.name.startswith("_")]
    assert not borrowed, "ced/cli/ imports private names: " + "; ".join(borrowed)


def test_the_scan_sees_lazy_and_dynamic_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from experiments.study import load_study\n"
                     "    import evals.modes\n"
                     "    importlib.import_module('benchmarks.peer')\n")
    assert [m for _, m in imported_modules(probe)] == ["experiments.study", "evals.modes",
                                                       "benchmarks.peer"]


@pytest.mark.parametrize("path", sorted((ROOT / "ced").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_ced_imports_nothing_from_the_floors_above(path):
    upward = [f"{path.relative_to(ROOT)}:{line}: {module}"
              for line, module in imported_modules(path)
              if module.split(".")[0] in UPPER_FLOORS]
    assert not upward, "ced/ is the library; these imports point up: " + "; ".join(upward)


# The one function allowed over 60 lines, and why: `attend` is the single attention function
# the contract names (docs/semantics.md); splitting it would spread the semantics over helpers.
LONG_FUNCTIONS_ALLOWED = {("ced/attention.py", "attend")}


def test_no_function_is_longer_than_sixty_lines_but_attend():
    long = []
    for folder in ("ced", "evals", "analysis", "experiments", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    key = (str(path.relative_to(ROOT)), node.name)
                    if length > 60 and key not in LONG_FUNCTIONS_ALLOWED:
                        long.append(f"{key[0]}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "functions over 60 lines: " + "; ".join(long)


def test_no_module_is_longer_than_eight_hundred_lines():
    """Size follows shape: a module past 800 lines has seams it should be split along (the
    study driver's steps, the trainer's run directory, the cost report were)."""
    long = [f"{path.relative_to(ROOT)} ({n} lines)"
            for folder in PROJECT for path in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 800]
    assert not long, "modules over 800 lines: " + "; ".join(long)


def uncommented_function_imports(path: Path) -> list[int]:
    """The lines of the imports inside a function body of `path` that give no reason: an
    import is explained by a comment on its own line(s), on the line directly above it, or on
    the line directly above the run of consecutive import statements it belongs to (one
    comment over a group of lazy imports at the start of a function covers the group)."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    inside = {id(node) for fn in ast.walk(tree)
              if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    run_head: dict[int, ast.stmt] = {}
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            head = None
            for stmt in block if isinstance(block, list) else []:
                is_import = isinstance(stmt, (ast.Import, ast.ImportFrom))
                head = (head or stmt) if is_import else None
                if is_import:
                    run_head[id(stmt)] = head

    def comment_above(stmt: ast.stmt) -> bool:
        return stmt.lineno > 1 and lines[stmt.lineno - 2].strip().startswith("#")

    found = set()
    for node in ast.walk(tree):
        if id(node) in inside:
            own = "#" in " ".join(lines[node.lineno - 1:node.end_lineno])
            if not (own or comment_above(node) or comment_above(run_head[id(node)])):
                found.add(node.lineno)
    return sorted(found)


def test_the_import_check_reads_comments_on_the_line_above_and_over_a_group(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json\n"                          # module level: not checked
                     "def a():\n    import os\n"              # 3: no reason
                     "def b():\n    import os  # lazy: x\n"
                     "def c():\n    # lazy: x\n    import os\n"
                     "def d():\n    # lazy: x\n    import os\n\n    from re import sub\n"
                     "    print()\n    import sys\n"          # 15: after the group: no reason
                     "def e():\n    if True:\n        # lazy: x\n        import os\n"
                     "    import re\n")                       # 20: another body
    assert uncommented_function_imports(probe) == [3, 15, 20]


def test_every_import_inside_a_function_says_why():
    """An import inside a function is lazy for a reason (start-up time: a heavy package the
    module does not otherwise need; a branch few runs take; an import cycle), and a comment
    beside it or above its group says which; any other import belongs at the module's top."""
    unexplained = []
    for folder in PROJECT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            unexplained += [f"{relative}:{line}" for line in uncommented_function_imports(path)]
    assert not unexplained, ("imports inside functions without a comment saying why they are "
                             "lazy (else move them to the top): " + "; ".join(unexplained))
