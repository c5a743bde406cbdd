"""The browser tests' JupyterLab (ui-tests/): loopback only, a token on every request, XSRF checks on.

galata's `configure_jupyter_server` turns authentication and XSRF checks off; the config file
must turn them back on. Loaded here the way `jupyter lab --config=...` loads it. The running
server is checked from the browser side too (ui-tests/tests/server-security.spec.ts).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

UI_TESTS = Path(__file__).resolve().parents[2] / "ui-tests"
SERVER_CONFIG = UI_TESTS / "jupyter_server_test_config.py"
PLAYWRIGHT_CONFIG = UI_TESTS / "playwright.config.ts"


def load_server_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token: str | None) -> Config:
    # galata's setup makes temp folders and files: keep them in this test's folder.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("JUPYTERLAB_GALATA_ROOT_DIR", str(tmp_path))
    if token is None:
        monkeypatch.delenv("MPNB_E2E_TOKEN", raising=False)
    else:
        monkeypatch.setenv("MPNB_E2E_TOKEN", token)
    return PyFileConfigLoader(SERVER_CONFIG.name, str(SERVER_CONFIG.parent)).load_config()


def test_server_binds_loopback_with_the_runs_token_and_xsrf_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    c = load_server_config(monkeypatch, tmp_path, "ab" * 32)
    assert c.ServerApp.ip == "127.0.0.1"
    assert c.IdentityProvider.token == "ab" * 32
    assert c.ServerApp.disable_check_xsrf is False


def test_server_without_a_token_from_playwright_lets_jupyter_make_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    c = load_server_config(monkeypatch, tmp_path, None)
    # No empty token from galata left behind: Jupyter's default (JUPYTER_TOKEN or a generated one) applies.
    assert "token" not in c.IdentityProvider
    assert c.ServerApp.ip == "127.0.0.1"
    assert c.ServerApp.disable_check_xsrf is False


def test_playwright_makes_a_token_per_run_and_keeps_it_off_the_command_line() -> None:
    text = PLAYWRIGHT_CONFIG.read_text()
    assert "randomBytes(32)" in text and "process.env.MPNB_E2E_TOKEN" in text
    assert "extraHTTPHeaders: { Authorization: `token ${process.env.MPNB_E2E_TOKEN}` }" in text
    assert "'--ServerApp.ip=127.0.0.1'" in text
    command = re.search(r"webServer: \{\s*command: \[(.*?)\]\.join", text, re.S)
    assert command is not None
    # /proc/<pid>/cmdline is readable by every local user; the environment is not.
    assert "token" not in command.group(1).lower()
