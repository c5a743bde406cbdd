"""JupyterLab server for the browser tests: galata's test setup, local only, no update checks.

Started by ui-tests/playwright.config.ts (`npm run test:e2e`), which passes the port and
the notebook directory (a fresh temp dir) on the command line / in the environment.
"""

from jupyterlab.galata import configure_jupyter_server

c = get_config()  # type: ignore[name-defined]  # noqa: F821
configure_jupyter_server(c)
c.ServerApp.ip = "127.0.0.1"
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
