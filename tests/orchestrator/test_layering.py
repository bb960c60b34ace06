"""The orchestrator's folders and the one direction of their imports (docs/design.md, "The
orchestrator's folders"), read from the source with `ast`, every import counted: at the top of
a module, inside a function, or under TYPE_CHECKING.

- Every module under orchestrator/ belongs to one unit of LAYERS.
- A module imports modules of its own unit and of units in lower layers only: never one of a
  higher layer, nor another unit of its own layer.
- No two modules import each other, directly or through others (within a unit too).
- specdec/, draft_service/ and target_service/ never import orchestrator: the orchestrator is
  built on them, not they on it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top. A unit is a module or a package (with its subpackages); `orchestrator` is the
# package's own __init__ only.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("orchestrator", "orchestrator.config", "orchestrator.core"),
    ("orchestrator.web", "orchestrator.launch"),
    ("orchestrator.server",),
    ("orchestrator.demo",),
    ("orchestrator.cli",),
    ("orchestrator.__main__",),
)
BELOW_THE_ORCHESTRATOR = ("specdec", "draft_service", "target_service")

Edges = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Every module of `package` (its __init__ as the package's name) and its file."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imported(name: str, source: str, known: Iterable[str], is_package: bool = False) -> set[str]:
    """The modules that module `name` (a package's __init__ if `is_package`) imports:
    `from a import b` is a.b where a.b is a module in `known`, else a; relative imports are
    resolved."""
    known = set(known)
    package = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds `name`
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return out


def import_graph(package: str, root: Path = ROOT) -> Edges:
    """Module -> the modules of `package` it imports."""
    files = modules_under(package, root)
    known = set(files)
    graph: Edges = {}
    for name, path in files.items():
        targets = imported(name, path.read_text(), known, path.name == "__init__.py")
        graph[name] = {t for t in targets if t == package or t.startswith(package + ".")}
    return graph


def unit_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[int, str] | None:
    """(layer, unit) of `module`: the longest unit that is the module or a package above it."""
    best: tuple[int, str] | None = None
    for layer, units in enumerate(layers):
        for unit in units:
            top = "." not in unit  # the root package holds only its own __init__
            inside = module == unit or (not top and module.startswith(unit + "."))
            if inside and (best is None or len(unit) > len(best[1])):
                best = (layer, unit)
    return best


def layering_errors(
    graph: Mapping[str, set[str]], layers: tuple[tuple[str, ...], ...]
) -> list[str]:
    errors = []
    for module in sorted(graph):
        if unit_of(module, layers) is None:
            errors.append(f"{module} is in no unit of LAYERS (add it there and to docs/design.md)")
    for module, targets in sorted(graph.items()):
        here = unit_of(module, layers)
        for target in sorted(targets):
            there = unit_of(target, layers)
            if here is None or there is None:
                if target not in graph:
                    errors.append(f"{module} imports {target}, which is no module")
                continue
            if here[1] == there[1] or there[0] < here[0]:
                continue
            way = "up" if there[0] > here[0] else "sideways"
            errors.append(
                f"{module} ({here[1]}, layer {here[0]}) imports {target} ({there[1]}, layer "
                f"{there[0]}): an import {way} the layers"
            )
    return errors


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, and modules importing
    themselves (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return sorted(found)


def test_every_import_points_down_the_layers() -> None:
    errors = layering_errors(import_graph("orchestrator"), LAYERS)
    assert not errors, "\n".join(errors)


def test_no_import_cycle_between_modules() -> None:
    found = cycles(import_graph("orchestrator"))
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_lower_packages_never_import_the_orchestrator() -> None:
    errors = []
    for package in BELOW_THE_ORCHESTRATOR:
        files = modules_under(package)
        for name, path in files.items():
            source, is_package = path.read_text(), path.name == "__init__.py"
            for target in sorted(imported(name, source, files, is_package)):
                if target.split(".")[0] == "orchestrator":
                    errors.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not errors, "\n".join(errors)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """A tree with an upward import, a sideways one, a cycle and a module in no unit."""
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from pkg.high import b\n",  # up
        "pkg/low/c.py": "def f():\n    from . import d\n",  # c -> d -> c, relative
        "pkg/low/d.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.low.c\n",
        "pkg/side.py": "import pkg.low.a\nfrom pkg import other\n",  # sideways
        "pkg/high.py": "from pkg.low import a\n",
        "pkg/other.py": "",
        "pkg/stray.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    layers = (("pkg", "pkg.low"), ("pkg.side", "pkg.other"), ("pkg.high",))
    graph = import_graph("pkg", tmp_path)
    assert layering_errors(graph, layers) == [
        "pkg.stray is in no unit of LAYERS (add it there and to docs/design.md)",
        "pkg.low.a (pkg.low, layer 0) imports pkg.high (pkg.high, layer 2): an import up the "
        "layers",
        "pkg.side (pkg.side, layer 1) imports pkg.other (pkg.other, layer 1): an import "
        "sideways the layers",
    ]
    assert cycles(graph) == [["pkg.high", "pkg.low.a"], ["pkg.low.c", "pkg.low.d"]]
