"""What `%%distributed` was asked for: `CellOptions`, and the `--ranks` / `--rank` / `--timeout` checks.

Every check here runs before any engine work, most before a cluster is even
looked for; `--ranks` is checked as (low, high) spans against the world before
any list is built, so `--ranks 0-999999999` costs nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from mpnb.cluster.launch import check_timeout
from mpnb.errors import ConfigError

OUTPUT_MODES = ("grouped", "all", "rank0")
CELL_TIMEOUT_EXAMPLE = "`%%distributed --timeout 600` (seconds; leave it out for no bound)"


@dataclass
class CellOptions:
    ranks: list[int] | None = None  # None: every rank
    output: str = "grouped"
    quiet: bool = False
    verbose: bool = False  # show library chatter (compilers, DeepSpeed, deprecations) instead of logging it
    timeout: float | str | None = None  # seconds (text as typed: `check` makes it a float); None: no bound
    monitor: bool = True

    def check(self) -> None:
        """What needs no cluster to check: output mode, --quiet/--verbose, the timeout (made a float)."""
        if self.output not in OUTPUT_MODES:
            raise ConfigError(f"--output must be one of {', '.join(OUTPUT_MODES)}, not {self.output!r}.")
        if self.quiet and self.verbose:
            raise ConfigError("Give either --quiet (only errors) or --verbose (everything, library output "
                              "included), not both.")
        if self.timeout is not None:
            self.timeout = check_timeout(self.timeout, example=CELL_TIMEOUT_EXAMPLE)

    def validate(self, world_size: int) -> None:
        """Everything, against a world of `world_size` ranks (`ranks` is a list by now)."""
        self.check()
        if self.ranks is not None:
            if not self.ranks:
                raise ConfigError("--ranks is empty. Give ranks like `--ranks 0,1`, or leave it out for all.")
            bad = [r for r in self.ranks if not 0 <= r < world_size]
            if bad:
                raise _no_such_ranks(", ".join(map(str, bad)), len(bad) > 1, world_size)
            if len(set(self.ranks)) != len(self.ranks):
                raise ConfigError(f"--ranks lists a rank twice ({self.ranks}). Give each rank once.")


def _no_such_ranks(which: str, several: bool, world_size: int) -> ConfigError:
    world = f"ranks 0-{world_size - 1}" if world_size > 1 else "only rank 0"
    return ConfigError(
        f"Rank{'s' if several else ''} {which} {'do' if several else 'does'} not exist: "
        f"this cluster has {world}. Pick ranks from that range."
    )


def rank_spans(ranks: str | None, rank: int | None) -> list[tuple[int, int]] | None:
    """`--ranks` / `--rank` of `%%distributed` -> the (low, high) spans asked for, or None for all.

    Only the syntax is checked here, so it needs no cluster; `expand_ranks` then checks the spans
    against the world before building any list, so `--ranks 0-999999999` costs nothing."""
    if ranks is not None and rank is not None:
        raise ConfigError("Give either --ranks or --rank, not both.")
    if rank is not None:
        return [(rank, rank)]
    if ranks is None:
        return None
    spans: list[tuple[int, int]] = []
    for part in ranks.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            span = (int(lo), int(hi)) if dash else (int(part), int(part))
        except ValueError:
            raise ConfigError(f"--ranks takes rank numbers like `0,2` or `0-3`, not {ranks!r}.") from None
        if span[0] > span[1]:
            raise ConfigError(f"--ranks {part}: a range goes low-high, e.g. {span[1]}-{span[0]}.")
        spans.append(span)
    return spans


def expand_ranks(spans: list[tuple[int, int]] | None, world_size: int) -> list[int] | None:
    """The ranks of `spans`, in the order given, once every span lies inside a world of `world_size`."""
    if spans is None:
        return None
    if not spans:
        raise ConfigError("--ranks is empty. Give ranks like `--ranks 0,1`, or leave it out for all.")
    outside: list[tuple[int, int]] = []  # the parts of spans past either end of the world
    for lo, hi in spans:
        if lo < 0:
            outside.append((lo, min(hi, -1)))
        if hi >= world_size:
            outside.append((max(lo, world_size), hi))
    if outside:
        which = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in outside)
        raise _no_such_ranks(which, len(outside) > 1 or outside[0][0] != outside[0][1], world_size)
    for (_, prev_hi), (lo, _) in itertools.pairwise(sorted(spans)):
        if lo <= prev_hi:
            raise ConfigError(f"--ranks lists rank {lo} twice. Give each rank once.")
    return [r for lo, hi in spans for r in range(lo, hi + 1)]


def parse_ranks(text: str, world_size: int) -> list[int]:
    """'0,2' or '0-3' or '0,2-3' -> those ranks, in the order given, checked against the world."""
    ranks = expand_ranks(rank_spans(text, None), world_size)
    assert ranks is not None
    return ranks


def ranks_from_args(ranks: str | None, rank: int | None, world_size: int) -> list[int] | None:
    """`--ranks` / `--rank` of `%%distributed` -> the ranks to run on, or None for all."""
    return expand_ranks(rank_spans(ranks, rank), world_size)


__all__: Sequence[str] = [
    "OUTPUT_MODES",
    "CellOptions",
    "expand_ranks",
    "parse_ranks",
    "rank_spans",
    "ranks_from_args",
]
