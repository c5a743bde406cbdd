"""Reads a package's source with `ast` (nothing is imported) and finds what tests/unit/test_architecture.py
forbids: import cycles, uses of another module's `_private` names, oversized modules and classes, kernel-side
modules that load torch when imported, and imports in subpackage `__init__` files.

Every check takes the parsed package and returns one precise message per problem (file, line, what to do).
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Each of these imports torch itself.
TORCH_LOADING = frozenset({"torch", "deepspeed", "transformers"})
ALLOW_LISTS = "tests/unit/test_architecture.py"

TOP_LEVEL = "at module level"
UNDER_TYPE_CHECKING = "under `if TYPE_CHECKING:`"


@dataclass(frozen=True)
class Import:
    """A dependency of `importer` on `target` (an mpnb module or a torch-loading one), from one import."""

    importer: str
    target: str
    path: str  # the importer's file, relative to the package's parent: mpnb/cluster/session.py
    line: int
    where: str  # TOP_LEVEL, UNDER_TYPE_CHECKING or "inside def name"
    names: tuple[str, ...] = ()  # what `from target import ...` takes from the module itself

    @property
    def runs_on_import(self) -> bool:
        """Executed when the importer is imported (not deferred to a function, not for type checkers)."""
        return self.where == TOP_LEVEL

    def describe(self) -> str:
        return f"{self.path}:{self.line} ({self.where}) imports {self.target}"


@dataclass(frozen=True)
class SizeLimits:
    module_lines: int
    class_lines: int
    long_modules: dict[str, str]  # module name -> why it may stay longer
    long_classes: dict[str, str]  # "module.Class" -> why it may stay longer


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    lines: int
    is_package: bool
    imports: list[Import] = field(default_factory=list)


def load_package(package_dir: Path) -> dict[str, Module]:
    """Every module under `package_dir`, parsed, with its imports resolved to module names."""
    root = package_dir.name
    modules: dict[str, Module] = {}
    for file in sorted(package_dir.rglob("*.py")):
        parts = file.relative_to(package_dir.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        source = file.read_text()
        path = file.relative_to(package_dir.parent).as_posix()
        modules[name] = Module(name, path, ast.parse(source, path), len(source.splitlines()), is_package)
    lazy = _lazy_table(modules.get(root))
    for module in modules.values():
        module.imports = list(_imports(module, modules, lazy, root))
    return modules


def _lazy_table(init: Module | None) -> dict[str, str]:
    """The root package's `_LAZY` {public name: module}: `from mpnb import start` depends on that module."""
    if init is None:
        return {}
    for node in init.tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "_LAZY" and node.value is not None:
            return ast.literal_eval(node.value)
    return {}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it sits; class bodies run on import, function bodies do not."""

    def visit(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, where
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, f"inside def {child.name}" if where == TOP_LEVEL else where)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), UNDER_TYPE_CHECKING)
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), where)
            else:
                yield from visit(child, where)

    yield from visit(tree, TOP_LEVEL)


def _from_base(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module name a `from ... import` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: Module, modules: dict[str, Module], lazy: dict[str, str], root: str) -> Iterator[Import]:
    def dependency(target: str, node: ast.stmt, where: str, names: tuple[str, ...] = ()) -> Import:
        return Import(module.name, target, module.path, node.lineno, where, names)

    for node, where in _import_nodes(module.tree):
        if where == UNDER_TYPE_CHECKING and module.name == root:
            continue  # the root's names for type checkers: the lazy table is what runs
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.partition(".")[0]
                if alias.name in modules:
                    yield dependency(alias.name, node, where)
                elif top in TORCH_LOADING:
                    yield dependency(top, node, where)
            continue
        base = _from_base(module, node)
        if base.partition(".")[0] in TORCH_LOADING:
            yield dependency(base.partition(".")[0], node, where)
            continue
        if base not in modules:
            continue
        taken: list[str] = []
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in modules:
                yield dependency(submodule, node, where)
            elif base == root and alias.name in lazy and lazy[alias.name] in modules:
                yield dependency(lazy[alias.name], node, where, (alias.name,))
            else:
                taken.append(alias.name)
        if taken:
            yield dependency(base, node, where, tuple(taken))


def _depends(imp: Import) -> bool:
    """A dependency between two modules: not on itself, and not on a package it lives in (importing
    mpnb.cluster.session runs mpnb/__init__ and mpnb/cluster/__init__ anyway)."""
    return imp.target != imp.importer and not imp.importer.startswith(imp.target + ".")


# ------------------------------------------------------------------------------------------- checks


def import_cycles(modules: dict[str, Module]) -> list[str]:
    """Each import cycle as a readable path, with the line of every import in it."""
    edges: dict[str, dict[str, Import]] = {name: {} for name in modules}
    for module in modules.values():
        for imp in module.imports:
            if imp.target in modules and _depends(imp):
                edges[module.name].setdefault(imp.target, imp)  # the first import of a target names it
    cycles: set[tuple[str, ...]] = set()
    for component in _strongly_connected(edges):
        for start in sorted(component):
            cycle = _shortest_cycle(edges, component, start)
            turn = cycle.index(min(cycle))
            cycles.add(tuple(cycle[turn:] + cycle[:turn]))
    problems = []
    for cycle in sorted(cycles, key=lambda c: (len(c), c)):
        ring = [*cycle, cycle[0]]
        lines = [f"import cycle: {' -> '.join(ring)}"]
        lines += [f"    {edges[a][b].describe()}" for a, b in itertools.pairwise(ring)]
        problems.append("\n".join(lines))
    return problems


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm; only the components that hold a cycle (more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def _shortest_cycle(edges: dict[str, dict[str, Import]], component: set[str], start: str) -> list[str]:
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(edges[node]):
            if nxt not in component:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is in a cycle but none leads back to it")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(modules: dict[str, Module]) -> list[str]:
    """`from mpnb.x import _name` and `x._name` on an imported mpnb module, from any other module."""
    problems = []
    for module in modules.values():
        for imp in module.imports:
            if imp.target == module.name or imp.target not in modules:
                continue
            for name in filter(_is_private, imp.names):
                problems.append(f"{imp.path}:{imp.line} imports {name} from {imp.target}: " + _make_public(
                    modules[imp.target]))
        for line, target, name in _private_attribute_reads(module, modules):
            problems.append(f"{module.path}:{line} reads {target}.{name}: " + _make_public(modules[target]))
    return problems


def _make_public(owner: Module) -> str:
    return f"give it a public name in {owner.path} (no leading underscore) or move the code needing it there"


def _private_attribute_reads(module: Module, modules: dict[str, Module]) -> Iterator[tuple[int, str, str]]:
    aliases: dict[str, str] = {}  # local name -> the mpnb module it is bound to
    for node, _ in _import_nodes(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    bound = alias.asname or alias.name.partition(".")[0]
                    aliases[bound] = alias.name if alias.asname else bound
        else:
            base = _from_base(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            target = _module_of(node.value, aliases, modules)
            if target is not None and target != module.name and f"{target}.{node.attr}" not in modules:
                yield node.lineno, target, node.attr


def _module_of(expr: ast.expr, aliases: dict[str, str], modules: dict[str, Module]) -> str | None:
    """The mpnb module `expr` names (`session`, `mpnb.cluster.session`), or None."""
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id)
    if isinstance(expr, ast.Attribute):
        parent = _module_of(expr.value, aliases, modules)
        if parent is not None and f"{parent}.{expr.attr}" in modules:
            return f"{parent}.{expr.attr}"
    return None


def oversized(modules: dict[str, Module], limits: SizeLimits) -> tuple[list[str], list[str]]:
    """(modules over the line limit, classes over theirs), leaving out the listed ones."""
    long_modules, long_classes = [], []
    for module in modules.values():
        if module.lines > limits.module_lines and module.name not in limits.long_modules:
            long_modules.append(
                f"{module.path} has {module.lines} lines (at most {limits.module_lines}): split it by "
                f"concern, or add {module.name!r} to LONG_MODULES in {ALLOW_LISTS} with the reason "
                "(the same one-line reason as the comment at the top of the module)"
            )
        for key, cls, size in classes(module):
            if size > limits.class_lines and key not in limits.long_classes:
                long_classes.append(
                    f"{module.path}:{cls.lineno} class {cls.name} has {size} lines (at most "
                    f"{limits.class_lines}): move a concern into its own class or module, or add {key!r} to "
                    f"LONG_CLASSES in {ALLOW_LISTS} with the reason (also as a comment at the module's top)"
                )
    return long_modules, long_classes


def classes(module: Module) -> Iterator[tuple[str, ast.ClassDef, int]]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield f"{module.name}.{node.name}", node, node.end_lineno - first + 1


def kernel_side_torch_imports(modules: dict[str, Module], engine_side: Callable[[str], bool]) -> list[str]:
    """Kernel-side modules whose import loads torch: directly, or through an mpnb module that does."""
    chains: dict[str, list[Import]] = {}  # module -> the imports, run when it is imported, that end in torch
    changed = True
    while changed:  # until no module newly turns out to load torch (import cycles need the repeats)
        changed = False
        for name, module in modules.items():
            if name in chains:
                continue
            for imp in filter(lambda i: i.runs_on_import, module.imports):
                if imp.target in TORCH_LOADING:
                    chains[name] = [imp]
                elif imp.target != name and imp.target in chains:
                    chains[name] = [imp, *chains[imp.target]]
                else:
                    continue
                changed = True
                break

    problems = []
    for module in modules.values():
        if engine_side(module.name):
            continue
        chain = chains.get(module.name)
        if chain is None:
            continue
        first, rest = chain[0], chain[1:]
        steps = ", ".join(f"{i.path}:{i.line} imports {i.target}" for i in rest)
        through = f", which loads torch ({steps})"
        problems.append(
            f"{first.path}:{first.line} imports {first.target} at module level{through if rest else ''}, so "
            f"importing {module.name} loads torch in the notebook kernel: import it inside the function "
            "that needs it"
        )
    return problems


def package_re_exports(modules: dict[str, Module], root: str) -> list[str]:
    """Imports in a subpackage's `__init__`: importing any module of the package would run them."""
    problems = []
    for module in modules.values():
        if not module.is_package or module.name == root:
            continue
        for node in module.tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__":
                problems.append(
                    f"{module.path}:{node.lineno} imports in a subpackage's __init__: import the names from "
                    "the module that defines them, and leave the __init__ its docstring"
                )
    return problems
