"""`%mpnb ...` (cluster lifecycle, config, pull/push), `%%distributed` (run a cell on ranks), `%%compare`.

Registered by `%load_ext mpnb`. Every error a user can cause is an `MpnbError`,
shown as one short message (`_show_mpnb_error`) instead of a traceback; a cell
that failed on ranks shows one traceback per distinct error; a stopped cell, one
line at most (`CellStopped`). Either way the exception still propagates, so
the notebook marks the cell failed and "Run All" stops there.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, NoReturn

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from mpnb.cluster import host_reach, launch, lifecycle
from mpnb.cluster import session as cluster
from mpnb.errors import ConfigError, MpnbError, NoClusterError
from mpnb.execution.cell_run import run_cell
from mpnb.execution.options import CellOptions, expand_ranks, rank_spans
from mpnb.execution.report import CellFailedError, CellStopped
from mpnb.monitoring import dashboard

MPNB_USAGE = """\
%mpnb start [-n N] [--devices 0,1,...] [--backend nccl|gloo] [--timeout SECONDS] [--port PORT] [--no-spares]
%mpnb start --ssh HOST:N,HOST:N [--ssh-args "OPTIONS"] [--python PATH] [--backend ...] [--timeout ...]
%mpnb connect --profile NAME_OR_DIR [--cluster-id ID] [--backend nccl|gloo] [--timeout SECONDS]
%mpnb status | restart | heal | stop
%mpnb config [--model NAME] [key=value ...]
%mpnb pull NAME [--rank R]
%mpnb push NAME
%mpnb run [--keep] [--timeout S] [--output MODE] [--quiet|--verbose] [--no-monitor] SCRIPT [ARGS...]
    (runs a torchrun script on every rank, as torchrun would; --keep merges its globals into the
    engines' namespace, like IPython's %run)
%mpnb checkpoint info PATH [--verify] | list [DIR]
%mpnb checkpoint save PATH [--background] | load PATH [--no-optimizer]"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises a ConfigError naming the usage instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(
            f"{self.prog}: {message}. Usage: {self.format_usage().strip().removeprefix('usage: ')}"
        )


def _parser(name: str) -> _Parser:
    return _Parser(prog=f"%mpnb {name}", add_help=False)


def _build_parsers() -> dict[str, _Parser]:
    p: dict[str, _Parser] = {}
    start = p["start"] = _parser("start")
    start.add_argument("-n", type=int, default=None, help="CPU engines to start (default 2), or GPUs to use")
    start.add_argument("--devices", default=None, help="GPU indices, e.g. 0,1")
    start.add_argument("--backend", choices=launch.BACKENDS, default=None)
    start.add_argument("--timeout", type=launch.check_timeout, default=launch.DEFAULT_PG_TIMEOUT_S)
    start.add_argument("--port", type=int, default=None, help="MASTER_PORT on rank 0 (default: a free one)")
    start.add_argument(
        "--no-spares", dest="spares", action="store_false", help="keep no warm engines for a quick restart"
    )
    start.add_argument("--ssh", default=None, metavar="HOST:N,...", help="engines on these hosts, over SSH")
    start.add_argument("--ssh-args", default=None, help="extra ssh options, quoted, e.g. \"-i ~/.ssh/key\"")
    start.add_argument("--python", default=None, help="--ssh: the Python with mpnb on the hosts")
    connect = p["connect"] = _parser("connect")
    connect.add_argument("--profile", default="default", help="ipyparallel profile name or directory")
    connect.add_argument("--cluster-id", default=None)
    connect.add_argument("--backend", choices=launch.BACKENDS, default=None)
    connect.add_argument("--timeout", type=launch.check_timeout, default=launch.DEFAULT_PG_TIMEOUT_S)
    for name in ("status", "restart", "heal", "stop"):
        p[name] = _parser(name)
    p["config"] = _parser("config")
    p["config"].add_argument("assignments", nargs="*", metavar="key=value")
    p["config"].add_argument("--model", default=None, metavar="NAME",
                             help="a model in the notebook: say which strategies it can run, refuse others")
    pull = p["pull"] = _parser("pull")
    pull.add_argument("name")
    pull.add_argument("--rank", type=int, default=None)
    push = p["push"] = _parser("push")
    push.add_argument("name")
    run = p["run"] = _parser("run")
    run.add_argument("--keep", action="store_true", help="merge the script's globals into the engines' names")
    run.add_argument("--timeout", default=None, help="interrupt the script after this many seconds")
    run.add_argument("--output", default="grouped", help="grouped (default), all, rank0")
    run.add_argument("--quiet", action="store_true", help="show only errors")
    run.add_argument("--verbose", action="store_true", help="also show library output (engines' logs)")
    run.add_argument("--no-monitor", action="store_true", help="no live memory chart under this run")
    run.add_argument("script", help="the script, relative to the notebook's directory")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments, passed on verbatim")
    ckpt = p["checkpoint"] = _parser("checkpoint")
    ckpt.add_argument("action", choices=("info", "list", "save", "load"))
    ckpt.add_argument("path", nargs="?", default=None, help="the checkpoint (list: the folder to look in)")
    ckpt.add_argument("--verify", action="store_true", help="info: also compare every file's checksum")
    ckpt.add_argument("--background", action="store_true", help="save: write while training goes on")
    ckpt.add_argument("--no-optimizer", action="store_true", help="load: the weights only")
    return p


@magics_class
class MpnbMagics(Magics):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self._parsers = _build_parsers()
        self._config: Any = None  # config set with `%mpnb config` before a cluster exists

    # ------------------------------------------------------------------ %mpnb
    @line_magic
    def mpnb(self, line: str) -> Any:
        """Manage the mpnb cluster. Subcommands:

        %mpnb start [-n N] [--devices 0,1,...] [--backend nccl|gloo] [--timeout SECONDS] [--port PORT]
                    [--no-spares]
        %mpnb start --ssh HOST:N,HOST:N [--ssh-args "OPTIONS"] [--python PATH] [--backend ...] [--timeout ...]
        %mpnb connect --profile NAME_OR_DIR [--cluster-id ID] [--backend nccl|gloo] [--timeout SECONDS]
        %mpnb status | restart | heal | stop
        %mpnb config [--model NAME] [key=value ...]
        %mpnb pull NAME [--rank R]
        %mpnb push NAME
        %mpnb run [--keep] [--timeout S] [--output MODE] [--quiet|--verbose] [--no-monitor] SCRIPT [ARGS...]
        %mpnb checkpoint info PATH [--verify] | list [DIR]
        %mpnb checkpoint save PATH [--background] | load PATH [--no-optimizer]

        `%mpnb run` runs a torchrun-style script on every rank, as `torchrun --nproc_per_node N` would;
        everything after the script's path is its arguments. `--keep` merges the script's globals into
        the engines' namespace afterwards, like IPython's `%run`.
        """
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise ConfigError(f"Could not parse `%mpnb {line}`: {exc}. Usage:\n{MPNB_USAGE}") from None
        if not words:
            raise ConfigError(f"`%mpnb` needs a subcommand. Usage:\n{MPNB_USAGE}")
        command, rest = words[0], words[1:]
        parser = self._parsers.get(command)
        if parser is None:
            raise ConfigError(f"Unknown subcommand `%mpnb {command}`. Usage:\n{MPNB_USAGE}")
        args = parser.parse_args(rest)
        return getattr(self, f"_cmd_{command}")(args)

    def _cmd_start(self, args: argparse.Namespace) -> None:
        lifecycle.start(
            args.n,
            devices=args.devices,
            backend=args.backend,
            timeout=args.timeout,
            port=args.port,
            config=self._config,
            spares=args.spares,
            ssh=args.ssh,
            ssh_args=args.ssh_args,
            python=args.python,
        )

    def _cmd_connect(self, args: argparse.Namespace) -> None:
        lifecycle.connect(
            args.profile, args.cluster_id, backend=args.backend, timeout=args.timeout, config=self._config
        )

    def _cmd_status(self, args: argparse.Namespace) -> None:
        sess = cluster.current()
        if sess is None:
            print(NoClusterError().args[0])
            return
        rows = sess.rank_status(fresh=True, cut_off=host_reach.unreachable(sess, range(sess.world_size)))
        header = ("rank", "host", "pid", "device", "alive", "busy")
        table = [header] + [tuple(str(row[k]) for k in header) for row in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        print(f"{sess.world_size} ranks · backend {sess.backend} · {sess.source}")
        for r in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())

    def _cmd_restart(self, args: argparse.Namespace) -> None:
        lifecycle.restart()

    def _cmd_heal(self, args: argparse.Namespace) -> None:
        if cluster.current() is None:
            raise NoClusterError(
                "No mpnb cluster is running, so there is no process group to heal. "
                "Start one with `%mpnb start`."
            )
        lifecycle.heal(cluster.session())

    def _cmd_stop(self, args: argparse.Namespace) -> None:
        lifecycle.stop(verbose=True)

    def _cmd_config(self, args: argparse.Namespace) -> None:
        from mpnb.planning import model_support
        from mpnb.planning.config import Config

        sess = cluster.current()
        world = sess.world_size if sess is not None else None
        model = self._notebook_model(args.model) if args.model else None
        current = sess.config if sess is not None else (self._config or Config())
        if args.assignments:
            new = current.update_from_strings(args.assignments)
            if model is not None:
                model_support.check_config(model, new, world)  # refused before anything reaches a rank
            if sess is not None:
                sess.set_config(new)  # validates for this world and pushes to every rank
            self._config = new
            current = new
        print(current.summary(world))
        if model is not None:
            print(model_support.describe_support(model, world))
            problem = model_support.config_problem(model, current, world)
            if problem:
                print(f"The config above cannot run {type(model).__name__}: {problem}")

    def _notebook_model(self, name: str) -> Any:
        """The model `--model NAME` names in the notebook's namespace."""
        if name not in self.shell.user_ns:
            raise ConfigError(f"`%mpnb config --model {name}`: {name!r} is not defined in the notebook. "
                              "Build the model in a notebook cell first, or leave --model out.")
        model = self.shell.user_ns[name]
        if not hasattr(model, "named_modules"):
            raise ConfigError(f"`%mpnb config --model {name}`: {name!r} is of type {type(model).__name__}, "
                              "not a torch model (nn.Module). Name the model itself.")
        return model

    def _cmd_pull(self, args: argparse.Namespace) -> Any:
        sess = cluster.session()
        ranks = [args.rank] if args.rank is not None else list(range(sess.world_size))
        for r in ranks:
            sess.engine_id(r)  # a clear error for a rank that does not exist
        try:
            values = sess.view(ranks).pull(args.name, block=True)
        except Exception as exc:
            raise ConfigError(
                f"Could not pull {args.name!r} from {', '.join(map(str, ranks))}: {_remote_message(exc)}. "
                "Define it in a %%distributed cell first, and make sure it can be pickled."
            ) from None
        by_rank = dict(zip(ranks, values, strict=True))
        return by_rank[args.rank] if args.rank is not None else by_rank

    def _cmd_push(self, args: argparse.Namespace) -> None:
        sess = cluster.session()
        if args.name not in self.shell.user_ns:
            raise ConfigError(
                f"{args.name!r} is not defined in the notebook. "
                f"Assign it first, then `%mpnb push {args.name}`."
            )
        try:
            sess.view().push({args.name: self.shell.user_ns[args.name]}, block=True)
        except Exception as exc:
            raise ConfigError(
                f"Could not push {args.name!r} to the ranks: {_remote_message(exc)}. "
                "Only values that can be pickled can be pushed."
            ) from None

    def _cmd_run(self, args: argparse.Namespace) -> None:
        from mpnb.execution.script import run

        run(
            args.script,
            args.args,
            keep=args.keep,
            timeout=args.timeout,
            output=args.output,
            quiet=args.quiet,
            verbose=args.verbose,
            monitor=not args.no_monitor,
        )

    def _cmd_checkpoint(self, args: argparse.Namespace) -> Any:
        from mpnb.checkpoints.magic import checkpoint_command

        return checkpoint_command(args.action, args.path, verify=args.verify, background=args.background,
                                  optimizer=not args.no_optimizer,
                                  execution_count=getattr(self.shell, "execution_count", None))

    # ------------------------------------------------------------------ %%distributed
    @magic_arguments()
    @argument("--ranks", default=None, help="ranks to run on, e.g. 0,2 or 0-3 (default: all)")
    @argument("--rank", type=int, default=None, help="run on this one rank")
    @argument("--output", default="grouped", help="grouped (default): identical output once; all; rank0")
    @argument("--quiet", action="store_true", help="show only errors")
    @argument("--verbose", action="store_true",
              help="also show library output (compilers, DeepSpeed, deprecations) kept in the engines' logs")
    @argument("--timeout", default=None, help="interrupt the cell after this many seconds")
    @argument("--no-monitor", action="store_true", help="no live memory chart under this cell")
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on every rank (or --ranks/--rank) at once, streaming grouped output."""
        try:
            args = parse_argstring(self.distributed, line)
        except UsageError as exc:
            raise ConfigError(
                f"%%distributed: {exc}. Usage: {self.distributed.__doc__.splitlines()[0]}"
            ) from None
        options = CellOptions(
            output=args.output,
            quiet=args.quiet,
            verbose=args.verbose,
            timeout=args.timeout,
            monitor=not args.no_monitor,
        )
        options.check()  # bad input is refused before a cluster is even looked for
        spans = rank_spans(args.ranks, args.rank)
        sess = cluster.session()
        options.ranks = expand_ranks(spans, sess.world_size)  # checked against the world, then listed
        return run_cell(
            sess, cell, options, execution_count=getattr(self.shell, "execution_count", None), magic_line=line
        )

    # ------------------------------------------------------------------ %%compare
    @cell_magic
    def compare(self, line: str, cell: str) -> Any:
        """%%compare CONFIG, CONFIG, ... [--warmup N] [--steps M] [--no-chart]: the cell under each config."""
        from mpnb.comparison.runner import compare

        configs, options = _split_compare_line(line)
        count = getattr(self.shell, "execution_count", None)
        return compare(configs, cell, origin=f"In [{count}]" if count else "", **options)


_COMPARE_USAGE = "%%compare ddp, fsdp, zero stage=2, tensor [--warmup 2] [--steps 3] [--no-chart]"


def _split_compare_line(line: str) -> tuple[str, dict[str, Any]]:
    """`%%compare`'s line: the configs (everything before the first --option) and the options."""
    configs, _, rest = line.partition("--")
    options: dict[str, Any] = {}
    words = shlex.split("--" + rest) if rest else []
    while words:
        word = words.pop(0)
        if word == "--no-chart":
            options["chart"] = False
        elif word in ("--warmup", "--steps") and words and words[0].isdigit():
            options[word[2:]] = int(words.pop(0))
        else:
            raise ConfigError(f"%%compare: cannot read {word!r}. Usage: {_COMPARE_USAGE}")
    return configs.strip(), options


def _remote_message(exc: BaseException) -> str:
    inner = getattr(exc, "elist", None)
    if inner:  # CompositeError: (ename, evalue, traceback, engine_info) per engine
        return f"{inner[0][0]}: {inner[0][1]}"
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}"


# ---------------------------------------------------------------------- showing errors


def _show_mpnb_error(
    shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None
) -> list[str]:
    """One short message for mpnb errors; the per-rank tracebacks for a failed cell; a stopped cell's
    line (or none, when its output already said where the ranks stopped)."""
    if isinstance(value, CellStopped):
        stb = value.render()
        if not stb:  # the cell still fails (the reply's status is "error") but shows no error output
            shell._last_traceback = [str(value)]  # what ipykernel puts in that reply
            return stb
    elif isinstance(value, CellFailedError):
        stb = value.render()
    else:
        stb = [f"\x1b[1;31m{etype.__name__}\x1b[0m: {value}"]
    shell._showtraceback(etype, value, stb)
    return stb


def register(ipython: Any) -> None:
    ipython.register_magics(MpnbMagics)
    ipython.set_custom_exc((MpnbError, CellStopped), _show_mpnb_error)
    dashboard.register(ipython)  # the JupyterLab sidebar's comm


def unregister(ipython: Any) -> None:
    ipython.set_custom_exc((), None)
    magics = ipython.magics_manager.registry.pop("MpnbMagics", None)
    if magics is not None:
        for kind in ("line", "cell"):
            for name, fn in list(ipython.magics_manager.magics[kind].items()):
                if getattr(fn, "__self__", None) is magics:
                    del ipython.magics_manager.magics[kind][name]
    dashboard.unregister(ipython)  # close the sidebar's comms so frontends show "not loaded"
