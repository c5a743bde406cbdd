"""The public API: every lazy name resolves, and importing mpnb stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import mpnb


def test_all_lists_every_lazy_name() -> None:
    assert set(mpnb._LAZY) <= set(mpnb.__all__)


def test_every_public_name_resolves() -> None:
    for name in mpnb.__all__:
        assert getattr(mpnb, name) is not None, name


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        mpnb.no_such_thing  # noqa: B018
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:
        raise AssertionError("expected AttributeError")


def test_kernel_side_import_does_not_import_torch() -> None:
    code = (
        "import sys, mpnb\n"
        "mpnb.Config; mpnb.estimate; mpnb.start; mpnb.config_panel; mpnb.memory_plot; mpnb.run\n"
        "import mpnb.magics\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
