"""`mpnb.compare`: run one training cell under several configs in turn on the live cluster, measured.

Each config is made the session's active one (so the cell's `mpnb.prepare`
applies it), every rank is armed (`mpnb.engine.measure`) with the same seeds,
and the cell runs as `%%distributed --quiet --no-monitor` would: its own output
is hidden, a failure becomes that config's row and the comparison goes on. The
stop button ends the whole comparison: the configs measured so far stay in the
table. The session's config is put back at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from mpnb.comparison.result import Comparison, ConfigRun
from mpnb.comparison.specs import ConfigSpec, parse_specs
from mpnb.errors import ConfigError, MpnbError
from mpnb.planning.config import Config

FUNCTION_NAME = "_mpnb_compare_fn"  # where a function to compare is pushed on the engines
WARMUP, STEPS = 2, 3  # untimed steps (the last counts collectives), then timed steps, per config


def compare(configs: str | Sequence[Any], cell: str | Callable[[], Any], *, warmup: int = WARMUP,
            steps: int = STEPS, seed: int = 0, chart: bool = True, origin: str = "") -> Comparison:
    """Run `cell` (engine code, or a function called on every rank) under each of `configs`; measure it.

    `configs` is text like "ddp, zero stage=2, fsdp, tensor, pipeline schedule=1f1b" (see
    `mpnb.comparison.specs`) or a list of such strings, dicts or `mpnb.Config`s. The cell must build its
    model and call `mpnb.prepare` and `trainer.step` at least `warmup + steps` times: the first
    `warmup` steps are not timed (the last of them counts the collectives), the next `steps` are.
    Returns a `Comparison` (`.table` is a DataFrame); with `chart`, a bar chart is drawn too. `origin`
    names the cell for people (the config panel shows "measured with In [7]").
    """
    from mpnb.cluster import session as cluster

    _check_counts(warmup, steps)
    if not (isinstance(cell, str) and cell.strip()) and not callable(cell):
        raise ConfigError("mpnb.compare needs the training cell's code (a string) or a function to run on "
                          "every rank; the cell must call mpnb.prepare and trainer.step.")
    sess = cluster.session()
    original = sess.config or Config()
    specs = parse_specs(configs, original, sess.world_size, sess.device_kind)  # all checked before any runs
    code = cell if isinstance(cell, str) else _push_function(sess, cell)
    result = Comparison([ConfigRun(s.label, s.config.summary(sess.world_size)) for s in specs], warmup, steps,
                        world_size=sess.world_size, cell=code, origin=origin)
    sess.comparison, sess.comparing = result, True
    index = 0
    try:
        for index, (spec, run) in enumerate(zip(specs, result.runs, strict=True)):
            _say(f"[{index + 1}/{len(specs)}] {spec.label} ...")
            if not _run_one(sess, spec, run, code, warmup, steps, seed):
                _stop_after(result, index)
                break
            _say(f"      {_outcome(run)}")
    except KeyboardInterrupt:  # the stop button outside the cell itself: keep what was measured
        _stop_after(result, index)
    finally:
        try:
            sess.set_config(original)
        finally:
            sess.comparing = False
    result.capacity = next((r.get("capacity") for run in result.runs for r in run.ranks if r.get("capacity")),
                           None)
    sess.notify("comparison")
    if chart and result.measured():
        from mpnb.comparison.chart import show_chart

        show_chart(result)
    return result


def _run_one(sess: Any, spec: ConfigSpec, run: ConfigRun, code: str, warmup: int, steps: int,
             seed: int) -> bool:
    """Run the cell under one config into `run`; False if the user stopped it (the comparison ends)."""
    from mpnb.engine import measure
    from mpnb.execution.cell_run import run_cell
    from mpnb.execution.options import CellOptions
    from mpnb.execution.report import CellFailedError, CellStopped

    sess.set_config(spec.config)
    view = sess.view()
    view.apply_sync(measure.arm, warmup, steps, seed)
    go_on = True
    try:
        run_cell(sess, code, CellOptions(quiet=True, monitor=False), label=f"compare: {spec.label}")
    except CellFailedError as exc:
        run.status, run.error = "failed", str(exc)
    except CellStopped:
        run.status, go_on = "stopped", False
    finally:
        try:
            collected = view.apply_sync(measure.collect)
        except Exception as exc:  # a rank died under this config: its row says so, the rest is kept
            collected, run.status = [], "failed"
            run.error = run.error or f"the measurements could not be collected: {exc}"
    run.ranks = sorted((r for r in collected if r is not None), key=lambda r: r["rank"])
    if run.status == "ok":
        short = min((r["taken"] for r in run.ranks), default=0)
        if short < warmup + steps:
            run.status = "failed"
            run.error = (f"the cell took {short} training steps; the comparison needs warmup + steps = "
                         f"{warmup + steps}: call trainer.step more often, or pass fewer steps")
    return go_on


def _stop_after(result: Comparison, index: int) -> None:
    """The comparison was stopped during config `index`: it and the ones after it were not measured."""
    result.stopped = True
    if result.runs[index].status == "ok" and not result.runs[index].ranks:
        result.runs[index].status = "stopped"
    for later in result.runs[index + 1:]:
        later.status = "not run"
    _say("stopped: the table keeps the configs measured so far")


def _outcome(run: ConfigRun) -> str:
    if not run.measured:
        return f"{run.status}: {run.error}"
    return f"{run.step_time() * 1e3:.1f} ms/step, {run.bytes_per_step() / 1e6:.2f} MB sent per step"


def _say(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


def _push_function(sess: Any, fn: Callable[[], Any]) -> str:
    sess.view().push({FUNCTION_NAME: fn}, block=True)
    return f"{FUNCTION_NAME}()\n"


def _check_counts(warmup: Any, steps: Any) -> None:
    for name, value, least in (("warmup", warmup, 1), ("steps", steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{name} must be a whole number >= {least} (got {value!r}): warm-up steps "
                              "are not timed and the last of them counts the collectives; measured "
                              "steps are timed.")
    if warmup + steps > 10_000:
        raise MpnbError(f"warmup + steps = {warmup + steps} is more than a comparison needs; "
                        "use a few of each.")
