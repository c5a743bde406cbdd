"""JupyterLab server for the browser tests: galata's test setup, local only, no update checks.

Started by ui-tests/playwright.config.ts (`npm run test:e2e`), which passes the port and
the notebook directory (a fresh temp dir) on the command line / in the environment.
Besides mpnb's own extension it loads the test-only chart benchmark extension
(ui-tests/chart-benchmark, built by `npm run build:test-extension`), which no other
JupyterLab sees.
"""

from pathlib import Path

from jupyterlab.galata import configure_jupyter_server

c = get_config()  # type: ignore[name-defined]  # noqa: F821
configure_jupyter_server(c)
# galata sets this to its own helper extension's folder (a string); keep that one.
galata_extensions = c.LabServerApp.extra_labextensions_path
c.LabServerApp.extra_labextensions_path = [
    *([galata_extensions] if isinstance(galata_extensions, str) else galata_extensions),
    str(Path(__file__).parent / "chart-benchmark" / "build"),
]
c.ServerApp.ip = "127.0.0.1"
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
