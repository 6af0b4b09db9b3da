"""The package's shape (docs/design.md): no import cycles, between modules or between packages, counting
imports inside functions too (a lazy import that holds a cycle together is still a cycle); no
module over 500 lines and no function over 60 (a screen: code split into readable pieces rather
than squeezed under a cap); no developer tool (the GPU runbook) in the installed package."""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "megarl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """megarl modules ``path`` imports anywhere (``from megarl.x import y`` counts megarl.x.y if
    that is a module, else megarl.x)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, name, set(files)) for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_packages():
    """megarl.engine never imports megarl.spec while spec imports engine, and so on: the layers of
    docs/design.md (pure pieces, then engine / trainer / sched, then the stages, then train.py)."""
    pkg = lambda m: ".".join(m.split(".")[:2])  # noqa: E731 - megarl.<package> (or a top-level module)
    graph = defaultdict(set)
    for mod, deps in _graph().items():
        graph[pkg(mod)] |= {pkg(d) for d in deps if pkg(d) != pkg(mod)}
    assert _cycles(dict(graph)) == []


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MODULE_LINES = 500
FUNCTION_LINES = 60


def test_modules_are_small():
    big = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert big == {}, f"modules over {MODULE_LINES} lines (split them by idea): {big}"


def _long_functions(source: str, limit: int) -> dict[str, int]:
    """Functions and methods of ``source`` longer than ``limit`` lines, from the ``def`` line to the
    last, docstring and nested definitions included, by qualified name."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                    out[name] = n
                visit(child, name + ".")
    visit(ast.parse(source), "")
    return out


def test_functions_fit_a_screen():
    found = {f"{p.relative_to(ROOT.parent)}:{name}": n for p in sorted(ROOT.rglob("*.py"))
             for name, n in _long_functions(p.read_text(), FUNCTION_LINES).items()}
    assert found == {}, f"functions over {FUNCTION_LINES} lines (split them into named steps): {found}"


def test_the_function_check_counts_nested_code():
    """A 59-line function passes; a method whose nested function makes it 61 lines does not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(58))
    nested = body.replace("    ", "            ")
    src = f"def short():\n{body}\n\nclass C:\n    def long(self):\n        def inner():\n{nested}\n        return inner\n"
    assert _long_functions(src, 60) == {"C.long": 61}


def _imported_roots(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_no_gpu_runbook_module_in_the_installed_package():
    """The GPU runbook is a developer tool (benchmarks/gpu/runbook/, docs/gpu/README.md): none of
    its modules ships in ``megarl``, and no ``megarl`` module imports the top-level ``benchmarks``."""
    runbook = {p.stem for p in (ROOT.parent / "benchmarks" / "gpu" / "runbook").glob("*.py")}
    assert {"runner", "parts", "runs", "identity", "child", "profiles", "rows", "report"} <= runbook
    shipped = [str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
               if p.stem == "gpu" or p.stem.startswith("gpu_") or "benchmarks" in _imported_roots(p)]
    assert shipped == []


def test_no_tracker_numbers_in_code_or_docs():
    """Code and docs cite docs/design.md sections for their reasons, never a tracker's numbers,
    which mean nothing to a reader of the repository."""
    import re
    pattern = re.compile(r"\bissues? \d+", re.IGNORECASE)
    repo = ROOT.parent
    files = [*ROOT.rglob("*.py"), *(repo / "tests").rglob("*.py"), *(repo / "benchmarks").rglob("*.py"),
             *(repo / "docs").rglob("*.md"), repo / "README.md"]
    found = [f"{p.relative_to(repo)}:{i}" for p in sorted(files)
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, f"tracker numbers: {found}"


def test_readme_stays_a_users_page():
    """The README is for users (what megarl is, how to run, train, convert, submit); measurement
    logs and details belong in docs/. Under 400 lines keeps it readable end to end."""
    lines = (ROOT.parent / "README.md").read_text().count("\n")
    assert lines < 400, f"README.md has {lines} lines: move details to docs/"
