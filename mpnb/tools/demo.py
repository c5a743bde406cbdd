"""`make demo` / `python -m mpnb.tools.demo OUT_DIR`: run the quickstart headlessly and keep what it shows.

Executes `notebooks/01_quickstart.ipynb` in a real kernel (nbclient), which
starts its own 2-rank cluster, trains, and stops it. Writes the executed
notebook and the memory chart its `%%distributed` training cell left behind
as a PNG, then prints where they are.

`execute_notebook` is also what the notebook tests use: whatever happens in
the notebook, every process the kernel started (ipcontroller, ipengines) is
gone when it returns, found by pid from the kernel's process tree.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
QUICKSTART = NOTEBOOKS / "01_quickstart.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Engines inherit the kernel's environment: one thread per CPU rank, DeepSpeed on CPU, a shared JIT cache.
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "mpnb" / "torch_extensions"),
}


class NotebookRun:
    """An executed notebook (`nb`), the error that stopped it (or None), how long it took, and the
    processes the kernel started that were still alive after it shut down (`leftovers`, "pid command")."""

    def __init__(self, nb: Any, error: BaseException | None, seconds: float, leftovers: list[str]) -> None:
        self.nb, self.error, self.seconds, self.leftovers = nb, error, seconds, leftovers


def execute_notebook(
    path: str | os.PathLike[str], timeout: float = 300, cwd: str | None = None
) -> NotebookRun:
    """Run every cell of `path` in a fresh python3 kernel; never raises for a failing cell.

    Cells tagged `raises-exception` may fail; any other error stops the run and
    is returned in `NotebookRun.error`. Leftover processes of the kernel are
    killed by pid before returning, so a notebook that failed before its
    `%mpnb stop` leaves no engines behind.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in ENGINE_ENV.items()}}
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": cwd or str(Path(path).resolve().parent)}},
        env=env,
    )
    t0 = time.perf_counter()
    error: BaseException | None = None
    children: set[int] = set()
    with client.setup_kernel(env=env):
        kernel_pid = _kernel_pid(client)
        try:
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
                children |= _descendants(kernel_pid)
        except Exception as exc:  # CellExecutionError, timeouts, a dead kernel: report, do not raise
            error = exc
        children |= _descendants(kernel_pid)
    leftovers = _kill_leftovers(children)
    return NotebookRun(nb, error, time.perf_counter() - t0, leftovers)


def _kernel_pid(client: Any) -> int | None:
    provisioner = getattr(client.km, "provisioner", None)
    process = getattr(provisioner, "process", None)
    return getattr(process, "pid", None)


def _descendants(pid: int | None) -> set[int]:
    import psutil

    if pid is None:
        return set()
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _kill_leftovers(pids: set[int], grace: float = 15.0) -> list[str]:
    """Processes in `pids` still running `grace` s after the kernel left: terminated, then killed.

    The grace is generous because an engine's nanny lingers up to 3 s after its
    engine exits (it tells the controller), longer on a busy machine.

    Returns "pid command" for each of them (empty when the notebook cleaned up after itself).
    """
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=grace)  # stopping engines may take a moment to exit
    described = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.terminate()
    _, still = psutil.wait_procs(alive, timeout=5)
    for proc in still:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return described


def images(cell: Any) -> list[bytes]:
    """The PNG images in a code cell's outputs (display data and execute results), decoded."""
    found = []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if "image/png" in data:
            found.append(base64.b64decode(data["image/png"]))
    return found


def memory_chart_png(nb: Any) -> bytes:
    """The memory chart left under the notebook's last `%%distributed` cell that trained (has a PNG)."""
    for cell in reversed(nb.cells):
        if cell.cell_type == "code" and cell.source.lstrip().startswith("%%distributed"):
            pngs = images(cell)
            if pngs:
                return pngs[-1]
    raise RuntimeError(
        "No memory chart found under any %%distributed cell of the executed notebook: "
        "did the memory monitor (mpnb.monitoring) start, and did the cell run without --no-monitor?"
    )


def run_demo(
    out_dir: str | os.PathLike[str], notebook: str | os.PathLike[str] = QUICKSTART, timeout: float = 300
) -> dict[str, Any]:
    """Execute the quickstart; write `<name>.ipynb` (executed) and `memory_chart.png` into `out_dir`.

    Returns the two paths (`notebook`, `memory_chart`) and the `NotebookRun` (`run`).
    """
    import nbformat

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = execute_notebook(notebook, timeout=timeout)
    executed = out / Path(notebook).name
    nbformat.write(run.nb, executed)
    if run.error is not None:
        raise RuntimeError(f"{Path(notebook).name} failed (partial output in {executed}):\n{run.error}")
    png = out / "memory_chart.png"
    png.write_bytes(memory_chart_png(run.nb))
    return {"notebook": executed, "memory_chart": png, "run": run}  # type: ignore[dict-item]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpnb.tools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="build/demo")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per cell")
    args = parser.parse_args(argv)
    print(f"mpnb demo: running {QUICKSTART.name} on a 2-rank cluster (about a minute)...", flush=True)
    try:
        result = run_demo(args.out_dir, timeout=args.timeout)
    except RuntimeError as exc:
        print(f"mpnb demo failed: {exc}", file=sys.stderr)
        return 1
    print(f"executed notebook: {Path(result['notebook']).resolve()}")
    print(f"memory chart:      {Path(result['memory_chart']).resolve()}")
    print(f"took {result['run'].seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
