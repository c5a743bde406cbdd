"""The first ZeRO cell on fresh engines: one progress line, no compiler/linker/warning lines, fast.

DeepSpeed's op probe (a C compile and a link against libaio, which fails here: `ld: cannot find
-laio`), its shm op message and torch's FutureWarnings go to each engine's log instead
(`mpnb.engine.quiet`); `%%distributed --verbose` shows library output again.
"""

from __future__ import annotations

import re
import time

import pytest
from IPython.utils.capture import capture_output

from mpnb.cluster import logs
from mpnb.execution.output import strip_ansi

pytestmark = pytest.mark.timeout(300)

NOISE = re.compile(r"ld:|collect2|warning|error|ninja|built successfully", re.IGNORECASE)
ZERO3_CELL = """\
%%distributed
from mpnb.models import tiny_gpt, synthetic_batches
model = tiny_gpt(seed=0)
trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       config={"strategy": "zero", "zero_stage": 3, "micro_batch_size": 2})
for batch in synthetic_batches(batch_size=2 * world_size, steps=2, seed=0):
    loss = trainer.step(batch)
print("trained", float(loss) > 0)
"""


def run(ip, source: str) -> tuple[bool, str]:
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result.success, strip_ansi(cap.stdout + cap.stderr)


@pytest.fixture(scope="module")
def ip(ipython, cluster):
    return ipython


def test_first_zero_cell_says_what_it_does_and_nothing_else(ip, cluster):
    t0 = time.perf_counter()
    ok, out = run(ip, ZERO3_CELL)  # the first DeepSpeed use on these engines
    took = time.perf_counter() - t0
    assert ok, out
    assert "mpnb: preparing ZeRO-3 (DeepSpeed) ..." in out
    assert "trained True" in out
    noisy = [line for line in out.splitlines() if NOISE.search(line)]
    assert not noisy, out
    assert took < 60, took  # nothing compiled in the cell (ops built by `make install`)
    # what the cell did not show is in each engine's own log, whose path the sidebar gets
    rows = cluster.rank_status()
    assert [row["log"] for row in rows] == [r.log for r in cluster.ranks]
    for info in cluster.ranks:
        assert info.log == logs.engine_log_path(info.pid)
        text = logs.tail(info.log, 400)
        assert "DeepSpeed" in text or "deprecated" in text, text


def test_verbose_cell_shows_library_output_that_a_plain_cell_logs(ip, cluster):
    cell = "import warnings\nwarnings.warn('`old_call` is deprecated', FutureWarning)\nprint('ran')\n"
    ok, out = run(ip, "%%distributed\n" + cell)
    assert ok, out
    assert "ran" in out and "old_call" not in out
    assert "old_call" in logs.tail(cluster.ranks[0].log, 50)
    ok, out = run(ip, "%%distributed --verbose\n" + cell.replace("old_call", "older_call"))
    assert ok, out
    assert "FutureWarning: `older_call` is deprecated" in out
