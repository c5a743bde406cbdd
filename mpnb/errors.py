"""Errors a user can cause. Each message names the problem and the fix."""

from __future__ import annotations


class MpnbError(Exception):
    """Base class for every error mpnb raises on purpose.

    The magics show these as one short message instead of a traceback, so the
    message itself must say what went wrong and what to run instead.
    """


class NoClusterError(MpnbError):
    """An operation needs a running cluster and there is none."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "No mpnb cluster is running. Start one with `%mpnb start` (or `mpnb.start()`), "
            "or attach to an existing one with `%mpnb connect --profile NAME`."
        )


class ClusterError(MpnbError):
    """Starting, connecting to or stopping a cluster failed."""


class ConfigError(MpnbError):
    """A setting or combination of settings is impossible."""


class RankError(MpnbError):
    """A cell failed, hung or lost a rank; the message says which and what to do."""


class CheckpointError(MpnbError):
    """A checkpoint cannot be written, read or resumed here; the message says why and what to use."""
