"""Make the next cell raise an exception that a `pre_run_cell` hook caught.

IPython logs what a pre_run_cell hook raises and runs the cell anyway. A hook
that must stop the cell (the stop button while DeepSpeed warms up, a process
group that could not form again) hands the exception here: the cell's code is
replaced, once, by raising it, so the user sees it as the cell's own error.
"""

from __future__ import annotations

import ast

_pending: BaseException | None = None


def raise_in_next_cell(exc: BaseException) -> None:
    """The next cell raises `exc` instead of running; outside IPython, raise it now."""
    global _pending
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise exc
    _pending = exc
    shell.ast_transformers.append(_RaiseInCell())


def raise_pending() -> None:
    global _pending
    __tracebackhide__ = True  # the user's traceback: the cause and the error, not this frame
    exc, _pending = _pending, None
    if exc is not None:
        raise exc


class _RaiseInCell(ast.NodeTransformer):
    """One-shot AST transformer: the cell's code becomes `raise_pending()`."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        from IPython import get_ipython

        get_ipython().ast_transformers.remove(self)
        body = ast.parse("__import__('mpnb.engine.cell_raise', fromlist=['_']).raise_pending()").body
        return ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
