"""Module attributes loaded on first use (PEP 562), for facades whose names live in heavier modules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

GetAttr = Callable[[str], Any]
Dir = Callable[[], list[str]]


def lazy_exports(module_name: str, table: dict[str, str]) -> tuple[GetAttr, Dir]:
    """`__getattr__` and `__dir__` for module `module_name`: each name in `table` is imported from
    the module it maps to when first read, then cached on the facade."""

    def __getattr__(name: str) -> Any:
        source = table.get(name)
        if source is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(table))

    return __getattr__, __dir__
