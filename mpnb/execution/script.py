"""Kernel side of `%mpnb run script.py args` / `mpnb.run(path, args)`: a torchrun script on every rank.

Everything a user can get wrong (a missing file, a directory, a syntax error, arguments that are not
strings, a rank subset) is a `ConfigError` raised here, before any engine work. The run itself is an
ordinary cell (`run_cell`), so grouped output, the memory chart, the stop button, the watchdog and
`--timeout`, rank deaths and heal/restart all apply; its one generated line calls
`mpnb.engine.script_run.run_script` on each rank, and the sidebar names it by the script's file name.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpnb.cluster import session as cluster
from mpnb.errors import ConfigError
from mpnb.execution.cell_run import run_cell
from mpnb.execution.options import CellOptions, parse_ranks
from mpnb.execution.output import strip_ansi
from mpnb.execution.report import CellFailedError

RUNNER = "mpnb.engine.script_run"  # the engine module the generated line calls
RUNNER_FILE = os.path.join("mpnb", "engine", "script_run.py")  # its frames, as tracebacks name them


@dataclass(frozen=True)
class Script:
    path: str  # absolute, resolved against the notebook's directory
    typed: str  # as the user gave it: the script's sys.argv[0], as torchrun passes it on
    name: str  # its file name, for messages and the sidebar


def run(
    path: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    keep: bool = False,
    timeout: float | str | None = None,
    output: str = "grouped",
    quiet: bool = False,
    verbose: bool = False,
    monitor: bool = True,
    ranks: Any = None,
) -> None:
    """Run the torchrun-style script at `path` with `args` on every rank, as
    `torchrun --nproc_per_node N path args` would: `__name__ == "__main__"`, `sys.argv`, `__file__`, the
    script's directory on `sys.path`, the notebook's directory as the current one, and torchrun's
    environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...).

    The script's own `init_process_group` / `destroy_process_group` work: mpnb parks its group while
    the script runs and re-forms it afterwards. `sys.exit()` / `sys.exit(0)` is success; another exit
    code, a message or an exception fails the cell on the ranks concerned. The script runs in a fresh
    namespace; `keep=True` merges its globals into the engines' namespace afterwards (like IPython's
    `%run`), so a following `%%distributed` cell can inspect e.g. its `model`.
    `timeout`, `output`, `quiet`, `verbose` and `monitor` are `%%distributed`'s options.
    """
    script = check_script(path)
    argv = check_args(args)
    options = CellOptions(output=output, quiet=quiet, verbose=verbose, timeout=timeout, monitor=monitor)
    options.check()
    sess = cluster.session()
    check_all_ranks(ranks, sess.world_size)
    code = engine_line(script, argv, os.getcwd(), bool(keep), run_id=f"mpnb-{uuid.uuid4().hex[:12]}")
    try:
        run_cell(sess, code, options, execution_count=_execution_count(), magic_line=magic_line(script, argv),
                 label=script.name)
    except CellFailedError as exc:
        for failure in exc.failures:
            failure.traceback = without_runner(failure.traceback)
        raise


# ----------------------------------------------------------------------------- checks, before engine work


def check_script(path: Any) -> Script:
    """The script at `path` (relative to the notebook's directory), once it is a readable file that
    compiles."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"The script path must be a string or a pathlib.Path, not {type(path).__name__}: "
                          "e.g. `mpnb.run('train.py', args=['--epochs', '3'])`.")
    typed = os.fspath(path)
    if not typed:
        raise ConfigError("The script path is empty. Name the script: `%mpnb run train.py [args ...]`.")
    absolute = os.path.abspath(os.path.expanduser(typed))
    name = os.path.basename(absolute)
    if not os.path.exists(absolute):
        raise ConfigError(f"No script at {absolute} (the notebook's directory is {os.getcwd()}). "
                          "Check the name, or give the script's path relative to that directory.")
    if os.path.isdir(absolute):
        inside = sorted(f for f in os.listdir(absolute) if f.endswith(".py"))[:3]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise ConfigError(f"{absolute} is a directory{hint}. Give the script file in it, "
                          f"e.g. `%mpnb run {os.path.join(typed, inside[0] if inside else 'train.py')}`.")
    try:
        with open(absolute, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise ConfigError(f"Cannot read the script {absolute}: {exc.strerror or exc}. "
                          "Make it readable (e.g. `chmod u+r`), then run it again.") from None
    try:
        compile(source, absolute, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{name}:{exc.lineno}" if exc.lineno else name
        text = f"\n    {exc.text.strip()}" if exc.text and exc.text.strip() else ""
        raise ConfigError(f"{where}: {type(exc).__name__}: {exc.msg}{text}\n"
                          "Fix the script, then run it again (nothing ran on the ranks).") from None
    except ValueError as exc:  # e.g. null bytes: not a Python source file
        raise ConfigError(f"{absolute} is not a Python script ({exc}). Give the .py file to run.") from None
    return Script(absolute, typed, name)


def check_args(args: Any) -> list[str]:
    """The script's arguments: a list of strings, as a shell would pass them."""
    if isinstance(args, (str, bytes)):
        raise ConfigError(f"args must be a list of strings, not one string: e.g. args={args.split()!r} "
                          "(or `shlex.split(...)` for quoted words).")
    try:
        argv = list(args)
    except TypeError:
        raise ConfigError(f"args must be a list of strings, not {type(args).__name__}: "
                          "e.g. args=['--epochs', '3'].") from None
    bad = [a for a in argv if not isinstance(a, str)]
    if bad:
        raise ConfigError(f"Every argument must be a string, as on a command line: {bad[0]!r} is a "
                          f"{type(bad[0]).__name__}. Write e.g. args=['--epochs', '3'], or use str(...).")
    return argv


def check_all_ranks(ranks: Any, world_size: int) -> None:
    """A script runs on every rank: its process group needs all of them."""
    if ranks is None:
        return
    if isinstance(ranks, str):
        chosen = parse_ranks(ranks, world_size)
    else:
        chosen = [ranks] if isinstance(ranks, int) else list(ranks)
    if sorted(chosen) != list(range(world_size)):
        raise ConfigError(f"A script runs on every rank (its process group needs all {world_size}), "
                          f"not on ranks {ranks}. Leave `ranks` out; to try a script on fewer ranks, "
                          "start a smaller cluster (`%mpnb start -n N`).")


# ----------------------------------------------------------------------------- the generated cell


def engine_line(script: Script, argv: list[str], cwd: str, keep: bool, run_id: str) -> str:
    """The one line each engine runs. `repr` makes every string a literal, whatever characters it holds."""
    return (f"__import__({RUNNER!r}, fromlist=['run_script']).run_script({script.path!r}, {argv!r}, "
            f"{cwd!r}, {keep!r}, argv0={script.typed!r}, run_id={run_id!r})")


def magic_line(script: Script, argv: list[str]) -> str:
    """What the engine's first line (a comment) says ran; only printable characters, so it stays one line."""
    text = " ".join(["run", script.typed, *argv])
    return "".join(c if c.isprintable() else "?" for c in text)


def without_runner(traceback: list[str]) -> list[str]:
    """A rank's traceback from the script's own frames on: the generated line's frame, the note for the
    hidden runner frames under it, and a runner frame IPython shows because the error was raised there
    (`mp.spawn` refused) go. IPython formats one frame per entry."""
    kept: list[str] = []
    dropping = False
    for entry in traceback:
        plain = strip_ansi(entry).strip()
        if plain.startswith("Cell In[") and RUNNER in plain:
            dropping = True
            continue
        if plain.startswith("File ") and RUNNER_FILE in plain.split("\n", 1)[0]:
            continue
        if dropping and plain.startswith("[... skipping hidden"):
            dropping = False
            continue
        dropping = False
        kept.append(entry)
    return kept


def _execution_count() -> int | None:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "execution_count", None) if shell is not None else None


__all__: Sequence[str] = ["Script", "check_all_ranks", "check_args", "check_script", "engine_line",
                          "magic_line", "run", "without_runner"]
