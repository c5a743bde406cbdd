"""ipyparallel's SSH engine launcher, starting the engines side by side instead of one after another.

Each engine's start is four ssh round trips (the remote shell, its Python, the profile directory, the
engine itself), and `SSHEngineSetLauncher.start` makes them for one engine after another: 4 engines on
2 hosts took 16 s here, and a real cluster of 8 GPUs per node pays it 8 times per node. Here each
engine's start runs in a thread of its own; everything else (configuration, the engines' commands
and environment, stopping, signals, output) is ipyparallel's. Named in the cluster by its import
path, so `Cluster.from_file` finds it again.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

# Engines starting at once. Each start opens one ssh session after another, and sshd's default
# MaxStartups (10:30:100) begins to drop new sessions beyond 10 being authenticated on one host.
MAX_PARALLEL_STARTS = 8


class ConcurrentSSHEngineLauncher(SSHEngineLauncher):
    """One engine, started on its parent's thread pool: `start` returns once the start is under way."""

    def start(self, hostname: Any = None, user: Any = None, port: Any = None) -> None:
        parent = self.parent
        if not isinstance(parent, ParallelSSHEngineSetLauncher) or parent.start_pool is None:
            return super().start(hostname, user, port)
        self.loop  # noqa: B018 - read on the kernel's thread: the thread that waits for the engine uses it
        parent.starts.append(parent.start_pool.submit(super().start, hostname, user, port))
        return None


class ParallelSSHEngineSetLauncher(SSHEngineSetLauncher):
    """`SSHEngineSetLauncher` whose engines start at the same time; `start` returns when all have
    started, and raises the first engine's error if one could not be started."""

    launcher_class = ConcurrentSSHEngineLauncher
    start_pool: ThreadPoolExecutor | None = None
    starts: list[Future]

    def start(self, n: int) -> list[str]:
        self.starts = []
        with ThreadPoolExecutor(MAX_PARALLEL_STARTS, thread_name_prefix="mpnb-ssh-start") as pool:
            self.start_pool = pool
            try:
                started = super().start(n)
            finally:
                self.start_pool = None
        for start in self.starts:  # all have ended (the pool was shut down): raise the first failure
            start.result()
        return started
