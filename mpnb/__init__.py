"""mpnb: model parallelism from a Jupyter notebook.

Kernel side::

    %load_ext mpnb
    %mpnb start
    mpnb.config_panel()

Engine side (inside ``%%distributed`` cells)::

    trainer = mpnb.prepare(model, optimizer)

Public names are imported lazily so that ``import mpnb`` in the notebook kernel
stays cheap and never imports torch unless the user does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpnb._version import __version__
from mpnb.errors import ClusterError, ConfigError, MpnbError, NoClusterError, RankError
from mpnb.lazy_exports import lazy_exports

# public name -> module that defines it
_LAZY: dict[str, str] = {
    # cluster lifecycle (kernel side)
    "start": "mpnb.cluster.lifecycle",
    "connect": "mpnb.cluster.lifecycle",
    "stop": "mpnb.cluster.lifecycle",
    "restart": "mpnb.cluster.lifecycle",
    "session": "mpnb.cluster.session",
    "Session": "mpnb.cluster.session",
    "run": "mpnb.execution.script",  # a torchrun script on every rank (`%mpnb run`)
    # configuration and prediction (kernel side, no torch)
    "Config": "mpnb.planning.config",
    "estimate": "mpnb.planning.estimator",
    "compare": "mpnb.comparison.runner",  # one training cell under several configs, measured
    # widgets (kernel side)
    "config_panel": "mpnb.widgets.panel",
    "memory_plot": "mpnb.monitoring.chart",
    "memory_report": "mpnb.monitoring.report",
    # checkpoints, read in the kernel (torch only for an export)
    "checkpoint_info": "mpnb.checkpoints.info",
    "export_checkpoint": "mpnb.checkpoints.export",
    # engine side (imports torch)
    "prepare": "mpnb.engine.prepare",
    "Trainer": "mpnb.engine.trainer",
    "should_stop": "mpnb.engine.control",
}

# Every lazy name is public (tests/unit/test_public_api.py checks _LAZY against this list).
__all__ = [
    "ClusterError",
    "Config",
    "ConfigError",
    "MpnbError",
    "NoClusterError",
    "RankError",
    "Session",
    "Trainer",
    "__version__",
    "checkpoint_info",
    "compare",
    "config_panel",
    "connect",
    "estimate",
    "export_checkpoint",
    "load_ipython_extension",
    "memory_plot",
    "memory_report",
    "prepare",
    "restart",
    "run",
    "session",
    "should_stop",
    "start",
    "stop",
    "unload_ipython_extension",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext mpnb`: register `%mpnb` and `%%distributed`."""
    from mpnb.magics import register

    register(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from mpnb.magics import unregister

    unregister(ipython)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "mpnb"}]


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mpnb.checkpoints.export import export_checkpoint
    from mpnb.checkpoints.info import checkpoint_info
    from mpnb.cluster.lifecycle import connect, restart, start, stop
    from mpnb.cluster.session import Session, session
    from mpnb.engine.control import should_stop
    from mpnb.engine.prepare import prepare
    from mpnb.engine.trainer import Trainer
    from mpnb.execution.script import run
    from mpnb.monitoring.chart import memory_plot
    from mpnb.monitoring.report import memory_report
    from mpnb.planning.config import Config
    from mpnb.planning.estimator import estimate
    from mpnb.widgets.panel import config_panel
