"""`memory_report()`: each rank's peak bytes by category, as a table or as data.

Reads the session's `MemoryStore`; needs neither widgets nor matplotlib.
No torch here: this runs in the notebook kernel.
"""

from __future__ import annotations

from typing import Any

from mpnb.units import format_bytes


class MemoryReport:
    """Per-rank peak bytes by category; shows as a table, `.data` for your own plots."""

    COLUMNS = (
        "parameters", "gradients", "optimizer", "activations", "other", "used", "peak", "capacity", "estimate"
    )

    def __init__(self, peaks: dict[int, dict[str, int]], estimate: dict[int, int] | None) -> None:
        self.rows: list[dict[str, Any]] = []
        for rank, row in sorted(peaks.items()):
            entry: dict[str, Any] = {"rank": rank}
            for column in self.COLUMNS[:-1]:
                entry[column] = row.get(column, 0)
            entry["estimate"] = (estimate or {}).get(rank)
            if row.get("device_used") is not None and "device_used" in row:
                entry["device_used"] = row["device_used"]
            self.rows.append(entry)

    def to_dict(self) -> dict[int, dict[str, Any]]:
        return {row["rank"]: {k: v for k, v in row.items() if k != "rank"} for row in self.rows}

    @property
    def data(self) -> Any:
        """A pandas DataFrame indexed by rank if pandas is installed, else `to_dict()`."""
        try:
            import pandas as pd
        except ImportError:
            return self.to_dict()
        return pd.DataFrame(self.rows).set_index("rank") if self.rows else pd.DataFrame()

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>mpnb memory report: no samples yet.</p>"
        columns = [c for c in (*self.COLUMNS, "device_used") if any(c in row for row in self.rows)]
        head = "".join(f"<th>{c}</th>" for c in ("rank", *columns))
        body = "".join(
            "<tr>"
            + f"<td>{row['rank']}</td>"
            + "".join(f"<td>{format_bytes(row.get(c))}</td>" for c in columns)
            + "</tr>"
            for row in self.rows
        )
        return (
            "<table class='mpnb-memory-report'><caption>peak memory per rank</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )

    def __repr__(self) -> str:
        lines = ["rank " + " ".join(f"{c:>11}" for c in self.COLUMNS)]
        for row in self.rows:
            lines.append(
                f"{row['rank']:>4} " + " ".join(f"{format_bytes(row.get(c)):>11}" for c in self.COLUMNS)
            )
        return "\n".join(lines)


def memory_report(session: Any | None = None, since: float | None = None) -> MemoryReport:
    """Per rank, the peak of each category (and of total use) over the kept history or since `since`."""
    if session is None:
        from mpnb.cluster.session import session as current_session

        session = current_session()
    store = session.memory
    return MemoryReport(store.peaks(since=since), store.estimate)
