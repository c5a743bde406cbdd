"""JupyterLab server for the browser tests: galata's test setup, local only, no update checks.

Started by ui-tests/playwright.config.ts (`npm run test:e2e`), which passes the port and
the notebook directory (a fresh temp dir) on the command line / in the environment, and a random
token for this run in `MPNB_E2E_TOKEN`. galata's own setup turns authentication and XSRF checks
off; this server keeps both: it listens on 127.0.0.1 only and wants the token on every request.
Started by hand without `MPNB_E2E_TOKEN`, Jupyter makes a token and prints the URL with it.
Besides mpnb's own extension it loads the test-only chart benchmark extension
(ui-tests/chart-benchmark, built by `npm run build:test-extension`), which no other
JupyterLab sees.
"""

import os
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
# galata sets an empty token and no XSRF check ("never use this in production"): any local user,
# or any web page the machine's browser opens, could run code through the test server's kernels.
if os.environ.get("MPNB_E2E_TOKEN"):
    c.IdentityProvider.token = os.environ["MPNB_E2E_TOKEN"]
else:
    c.IdentityProvider.pop("token", None)  # Jupyter's default: a generated token, printed
c.ServerApp.disable_check_xsrf = False
# The notebook folder is a fresh temp dir: deleted test files need not pile up in the user's trash.
c.FileContentsManager.delete_to_trash = False
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
