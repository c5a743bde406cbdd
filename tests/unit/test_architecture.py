"""The package's shape, checked on its source (tests/unit/architecture.py reads it with `ast`).

- no import cycle between mpnb modules, imports inside functions and under TYPE_CHECKING included;
- no module imports another module's `_private` names;
- modules stay within MAX_MODULE_LINES and classes within MAX_CLASS_LINES, unless listed with a reason;
- kernel-side modules load no torch when they are imported, directly or through another mpnb module;
- subpackage `__init__.py` files import nothing (re-exports there create import cycles).

The tests at the end prove on a small made-up package that each check finds what it is meant to find.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from .architecture import (
    Module,
    SizeLimits,
    classes,
    import_cycles,
    kernel_side_torch_imports,
    load_package,
    oversized,
    package_re_exports,
    private_imports,
)

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "mpnb"

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250

# module name -> why it may stay longer than MAX_MODULE_LINES (also the one-line comment at its top)
LONG_MODULES: dict[str, str] = {}
# "module.Class" -> why it may stay longer than MAX_CLASS_LINES
LONG_CLASSES: dict[str, str] = {}

LIMITS = SizeLimits(MAX_MODULE_LINES, MAX_CLASS_LINES, LONG_MODULES, LONG_CLASSES)

# Engine-side code runs where torch is loaded anyway; everything else runs in the notebook kernel.
ENGINE_SIDE = ("mpnb.engine", "mpnb.models", "mpnb.hf_models")


def is_engine_side(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ENGINE_SIDE) or "teaching" in name.split(".")


# ------------------------------------------------------------------------------------- on mpnb itself

MODULES = load_package(PACKAGE_DIR)


def _report(problems: list[str], what: str) -> str:
    return f"{what} ({len(problems)}):\n" + "\n".join(problems)


def test_the_walk_sees_the_package() -> None:
    assert {"mpnb", "mpnb.magics", "mpnb.errors", "mpnb.cluster.session"} <= set(MODULES)
    assert any(imp.target == "mpnb.errors" for m in MODULES.values() for imp in m.imports)


def test_no_import_cycles() -> None:
    cycles = import_cycles(MODULES)
    assert not cycles, _report(cycles, "import cycles (function-level and TYPE_CHECKING imports count) "
                                       "- move what both sides need into a module both can import")


def test_no_module_imports_another_modules_private_names() -> None:
    problems = private_imports(MODULES)
    assert not problems, _report(problems, "uses of another module's _private names")


def test_modules_and_classes_stay_readable() -> None:
    long_modules, long_classes = oversized(MODULES, LIMITS)
    problems = long_modules + long_classes
    assert not problems, _report(problems, "modules or classes over the size limit")


def test_size_allow_lists_are_current() -> None:
    sizes = {key: size for m in MODULES.values() for key, _, size in classes(m)}
    stale = [f"LONG_MODULES[{name!r}]: no such module, or within {MAX_MODULE_LINES} lines: remove the entry"
             for name in LONG_MODULES if name not in MODULES or MODULES[name].lines <= MAX_MODULE_LINES]
    stale += [f"LONG_CLASSES[{key!r}]: no such class, or within {MAX_CLASS_LINES} lines: remove the entry"
              for key in LONG_CLASSES if sizes.get(key, 0) <= MAX_CLASS_LINES]
    stale += [f"{key}: the reason is empty" for key, why in {**LONG_MODULES, **LONG_CLASSES}.items()
              if not why.strip()]
    assert not stale, _report(stale, "stale size allow-list entries")


def test_kernel_side_modules_do_not_import_torch_on_import() -> None:
    problems = kernel_side_torch_imports(MODULES, is_engine_side)
    assert not problems, _report(problems, "kernel-side modules that load torch when imported")


def test_subpackage_inits_re_export_nothing() -> None:
    problems = package_re_exports(MODULES, "mpnb")
    assert not problems, _report(problems, "imports in subpackage __init__ files")


# ----------------------------------------------------------- the checks find what they look for


def _fake_package(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for name, source in files.items():
        file = tmp_path / "mpnb" / name
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(textwrap.dedent(source))
    return load_package(tmp_path / "mpnb")


FAKE = {
    "__init__.py": """
        from typing import TYPE_CHECKING
        from mpnb import errors
        _LAZY = {"start": "mpnb.cluster.lifecycle"}
        if TYPE_CHECKING:
            from mpnb.cluster.lifecycle import start
    """,
    "errors.py": '"""Errors."""\n',
    "cluster/__init__.py": '"""Cluster."""\n',
    "cluster/session.py": """
        from typing import TYPE_CHECKING
        import mpnb.cluster
        from mpnb import errors
        if TYPE_CHECKING:
            from mpnb.cluster.lifecycle import Plan
        def current():
            from mpnb.cluster import lifecycle
            return lifecycle._plan
    """,
    "cluster/lifecycle.py": """
        from mpnb.cluster.session import _Registry, current
        def start():
            from mpnb.tools import demo
    """,
    "tools/__init__.py": "from mpnb.tools.demo import run\n",
    "tools/demo.py": """
        import torch.distributed
        from mpnb import start
        def run():
            pass
    """,
}


def test_a_function_level_cycle_and_a_type_checking_cycle_are_found(tmp_path: Path) -> None:
    cycles = import_cycles(_fake_package(tmp_path, FAKE))
    assert len(cycles) == 2, cycles
    session_cycle = next(c for c in cycles if "session" in c)
    assert session_cycle.splitlines() == [
        "import cycle: mpnb.cluster.lifecycle -> mpnb.cluster.session -> mpnb.cluster.lifecycle",
        "    mpnb/cluster/lifecycle.py:2 (at module level) imports mpnb.cluster.session",
        "    mpnb/cluster/session.py:6 (under `if TYPE_CHECKING:`) imports mpnb.cluster.lifecycle",
    ]
    # `from mpnb import start` is the lazy table's mpnb.cluster.lifecycle
    demo_cycle = next(c for c in cycles if "demo" in c)
    assert demo_cycle.splitlines()[0] == (
        "import cycle: mpnb.cluster.lifecycle -> mpnb.tools.demo -> mpnb.cluster.lifecycle"
    )
    assert "mpnb/cluster/lifecycle.py:4 (inside def start) imports mpnb.tools.demo" in demo_cycle


def test_private_names_found_in_from_imports_and_attribute_reads(tmp_path: Path) -> None:
    problems = private_imports(_fake_package(tmp_path, FAKE))
    assert any(p.startswith("mpnb/cluster/lifecycle.py:2 imports _Registry from mpnb.cluster.session")
               for p in problems)
    assert any("mpnb/cluster/session.py:9 reads mpnb.cluster.lifecycle._plan" in p for p in problems)
    assert len(problems) == 2, problems


def test_torch_through_another_module_and_re_exports_are_found(tmp_path: Path) -> None:
    modules = _fake_package(tmp_path, FAKE)
    torch_problems = kernel_side_torch_imports(modules, is_engine_side)
    assert any(p.startswith("mpnb/tools/demo.py:2 imports torch at module level") for p in torch_problems)
    # the fake tools/__init__ re-exports demo, so importing the package loads torch too
    assert (
        "mpnb/tools/__init__.py:1 imports mpnb.tools.demo at module level, which loads torch "
        "(mpnb/tools/demo.py:2 imports torch), so importing mpnb.tools loads torch in the notebook kernel"
    ) in "\n".join(torch_problems)
    assert len(torch_problems) == 2, torch_problems
    assert package_re_exports(modules, "mpnb") == [
        "mpnb/tools/__init__.py:1 imports in a subpackage's __init__: import the names from the module that "
        "defines them, and leave the __init__ its docstring"
    ]


def test_sizes_over_the_limits_are_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    modules = _fake_package(tmp_path, {"__init__.py": "", "big.py": f"@decorated\nclass Big:\n{body}\n"
                                       + "\n" * MAX_MODULE_LINES})
    long_modules, long_classes = oversized(modules, LIMITS)
    assert [p.split(" ")[0] for p in long_modules] == ["mpnb/big.py"]
    assert long_classes[0].startswith(f"mpnb/big.py:2 class Big has {MAX_CLASS_LINES + 2} lines")
    listed = SizeLimits(MAX_MODULE_LINES, MAX_CLASS_LINES, {"mpnb.big": "table"}, {"mpnb.big.Big": "table"})
    assert oversized(modules, listed) == ([], [])
