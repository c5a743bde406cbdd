"""What `mpnb.compare` returns: one row per config and rank, a verdict, a DataFrame, an HTML table.

Memory is what each rank held after its last measured step, by category
(`trainer.memory_breakdown()`), beside `mpnb.estimate`'s prediction; on a GPU
`peak` is the allocator's high-water mark over the run. Step time is the median
of the measured steps and their spread (min to max). Bytes are those handed
to collectives in one step (`mpnb.engine.comm_count`), by kind, beside the
estimator's `comm_bytes_per_step`. Losses are compared with the first config
that ran: the same seeds and batches should give the same losses under every
strategy, to float rounding (`LOSS_RTOL`).
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass, field
from typing import Any

from mpnb.planning.comm_estimate import volume
from mpnb.units import format_bytes

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")
LOSS_RTOL = 1e-4  # fp32 losses of different strategies differ in summation order only


@dataclass
class ConfigRun:
    """One config's run of the cell: per-rank measurements (`mpnb.engine.measure`), or why it has none."""

    label: str
    summary: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""  # the cell failed under this config: the first rank's error
    status: str = "ok"  # ok, failed, stopped, not run

    @property
    def measured(self) -> bool:
        return self.status == "ok" and bool(self.ranks) and all(r["times"] for r in self.ranks)

    def memory(self, rank: dict[str, Any]) -> int:
        return sum((rank.get("memory") or {}).values())

    def busiest(self) -> dict[str, Any]:
        return max(self.ranks, key=lambda r: (self.memory(r), -r["rank"]))

    def slowest(self) -> dict[str, Any]:
        """The rank with the longest median step: a step ends when every rank has finished it."""
        return max(self.ranks, key=lambda r: statistics.median(r["times"]))

    def step_time(self) -> float:
        return statistics.median(self.slowest()["times"])

    def bytes_per_step(self) -> float:
        """The most bytes any rank handed to collectives in one step."""
        return max(sum(k["bytes"] for k in r["comm"].values()) for r in self.ranks)

    def losses(self) -> list[float]:
        return self.ranks[0]["losses"] if self.ranks else []


@dataclass
class Comparison:
    """The measured comparison: `runs` in the order given, `warmup`/`steps` as run, `stopped` if cut short."""

    runs: list[ConfigRun]
    warmup: int
    steps: int
    stopped: bool = False
    capacity: int | None = None  # bytes of device memory per rank (GPU), None on CPU
    world_size: int = 0
    cell: str = ""  # the engine code that ran under each config (the panel re-measures with it)
    origin: str = ""  # where that code came from, for people: "In [7]"

    @property
    def num_params(self) -> int | None:
        """Ψ of the model the cell prepared (from the estimate `mpnb.prepare` made), None if none did."""
        return next((r["num_params"] for run in self.runs for r in run.ranks if r.get("num_params")), None)

    # ------------------------------------------------------------------ derived
    def measured(self) -> list[ConfigRun]:
        return [run for run in self.runs if run.measured]

    def reference_losses(self) -> list[float]:
        first = next(iter(self.measured()), None)
        return first.losses() if first else []

    def losses_match(self, run: ConfigRun) -> bool:
        ref, got = self.reference_losses(), run.losses()
        n = min(len(ref), len(got))
        return n > 0 and all(abs(a - b) <= LOSS_RTOL * max(abs(a), 1e-12) for a, b in zip(ref[:n], got[:n],
                                                                                        strict=True))

    def verdict(self) -> str:
        runs = self.measured()
        if not runs:
            return "Nothing was measured: every config failed or the comparison stopped before the first."
        fits = [r for r in runs if self.capacity is None or r.memory(r.busiest()) <= self.capacity]
        fastest = min(fits or runs, key=ConfigRun.step_time)
        smallest = min(runs, key=lambda r: r.memory(r.busiest()))
        quietest = min(runs, key=ConfigRun.bytes_per_step)
        where = "that fits" if self.capacity is not None else "(all fit: CPU ranks)"
        parts = [f"fastest {where}: {fastest.label} ({fastest.step_time() * 1e3:.1f} ms/step)",
                 f"least memory: {smallest.label} ({format_bytes(smallest.memory(smallest.busiest()))} "
                 "on its busiest rank)",
                 f"fewest bytes sent: {quietest.label} ({format_bytes(quietest.bytes_per_step())}/step)"]
        differ = [r.label for r in runs if not self.losses_match(r)]
        if differ:
            parts.append(f"losses differ from {runs[0].label}'s under: {', '.join(differ)}")
        return "; ".join(parts) + "."

    # ------------------------------------------------------------------ rows
    def rows(self) -> list[dict[str, Any]]:
        """One plain dict per config and rank (a config that did not run: one row saying why)."""
        out = []
        kinds = sorted({k for run in self.runs for r in run.ranks for k in r["comm"]})
        for run in self.runs:
            if not run.ranks:
                out.append({"config": run.label, "rank": None, "status": run.status, "error": run.error})
                continue
            for r in run.ranks:
                est = r.get("estimate") or {}
                memory = r.get("memory") or {}
                row: dict[str, Any] = {"config": run.label, "rank": r["rank"], "status": run.status,
                                       "error": run.error}
                for cat in MEMORY_CATEGORIES:
                    row[f"{cat}_bytes"] = memory.get(cat)
                    row[f"predicted_{cat}_bytes"] = est.get(cat)
                row["memory_bytes"] = sum(memory.values()) if memory else None
                row["predicted_bytes"] = est.get("total")
                row["peak_allocated_bytes"] = r.get("peak_allocated")
                times = r["times"]
                row["step_s"] = statistics.median(times) if times else None
                row["step_min_s"], row["step_max_s"] = (min(times), max(times)) if times else (None, None)
                for kind in kinds:
                    row[f"{kind}_bytes"] = r["comm"].get(kind, {}).get("bytes", 0)
                sent = {k: v["bytes"] for k, v in r["comm"].items()}
                row["comm_bytes"] = sum(sent.values())
                row["comm_volume"] = volume(sent)
                row["predicted_comm_bytes"] = sum(r.get("estimate_comm", {}).values())
                row["comm_s"] = sum(v["seconds"] for v in r["comm"].values())
                row["losses"] = list(r["losses"])
                row["losses_match"] = self.losses_match(run) if run.measured else None
                out.append(row)
        return out

    @property
    def table(self) -> Any:
        """`rows()` as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.rows())

    # ------------------------------------------------------------------ display
    def _repr_html_(self) -> str:
        head = ("<tr><th>config</th><th>rank</th><th>memory (measured)</th><th>predicted</th>"
                "<th>params / grads / optim / act / buffers</th><th>step (median, min-max)</th>"
                "<th>sent per step</th><th>predicted</th><th>losses</th></tr>")
        body = []
        for row in self.rows():
            name = html.escape(row["config"])
            if row["status"] != "ok" or row["step_s"] is None:
                why = html.escape(row["error"] or row["status"])
                body.append(f"<tr><td>{name}</td><td>{'' if row['rank'] is None else row['rank']}</td>"
                            f"<td colspan='7'>{html.escape(row['status'])}: {why}</td></tr>")
                continue
            cats = " / ".join(format_bytes(row[f"{c}_bytes"] or 0) for c in MEMORY_CATEGORIES)
            match = {True: "same as the first", False: "<b>differ</b>", None: ""}[row["losses_match"]]
            body.append(
                f"<tr><td>{name}</td><td>{row['rank']}</td><td>{format_bytes(row['memory_bytes'])}</td>"
                f"<td>{format_bytes(row['predicted_bytes'])}</td><td>{cats}</td>"
                f"<td>{row['step_s'] * 1e3:.1f} ms "
                f"({row['step_min_s'] * 1e3:.1f}-{row['step_max_s'] * 1e3:.1f})</td>"
                f"<td>{format_bytes(row['comm_bytes'])}</td><td>{format_bytes(row['predicted_comm_bytes'])}</td>"
                f"<td>{match}</td></tr>")
        note = " (stopped: the configs after it did not run)" if self.stopped else ""
        return (f"<table class='mpnb-compare'>{head}{''.join(body)}</table>"
                f"<p>{html.escape(self.verdict())}{note}</p>")

    def __repr__(self) -> str:
        lines = [f"Comparison of {len(self.runs)} configs "
                 f"({self.warmup} warm-up + {self.steps} measured steps)"]
        for run in self.runs:
            if not run.measured:
                lines.append(f"  {run.label}: {run.status}{': ' + run.error if run.error else ''}")
                continue
            busiest = run.busiest()
            lines.append(f"  {run.label}: {format_bytes(run.memory(busiest))} on rank {busiest['rank']}, "
                         f"{run.step_time() * 1e3:.1f} ms/step, "
                         f"{format_bytes(run.bytes_per_step())} sent/step")
        lines.append(self.verdict())
        return "\n".join(lines)
