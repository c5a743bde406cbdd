"""`%mpnb checkpoint save|load|list|info` on a real 2-rank cluster: the active trainer on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mpnb.errors import CheckpointError

TRAIN = """
import torch, mpnb
from mpnb.models import synthetic_batches, tiny_gpt
net = tiny_gpt(0)
trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), config={"strategy": "fsdp"})
batches = list(synthetic_batches(batch_size=8, steps=6))
losses = [trainer.step(b) for b in batches[:3]]
"""


@pytest.fixture(scope="module")
def magics(ipython: Any, cluster: Any) -> Any:
    return ipython.magics_manager.registry["MpnbMagics"]


def test_save_then_load_through_the_magic_goes_on_from_the_saved_step(
    magics: Any, cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    view = cluster.view()
    with pytest.raises(CheckpointError, match="no trainer to save"):  # before mpnb.prepare ran
        magics.mpnb(f"checkpoint save {tmp_path / 'early'}")
    view.execute(TRAIN, block=True)
    path = tmp_path / "step3"
    magics.mpnb(f"checkpoint save {path}")
    assert f"mpnb: saved step 3 to {path}" in capsys.readouterr().out
    info = magics.mpnb(f"checkpoint info {path}")
    assert (info.step, info.world_size, len(info.ranks)) == (3, 2, 2) and info.can_resume()
    view.execute("after = [trainer.step(b) for b in batches[3:]]", block=True)
    want = view.pull("after", block=True)[0]
    magics.mpnb(f"checkpoint load {path}")
    assert f"mpnb: loaded step 3 from {path}" in capsys.readouterr().out
    view.execute("steps_now = trainer.steps; again = [trainer.step(b) for b in batches[3:]]", block=True)
    assert view.pull("steps_now", block=True) == [3, 3]
    assert view.pull("again", block=True)[0] == pytest.approx(want, rel=1e-5)

    later = tmp_path / "later"
    magics.mpnb(f"checkpoint save {later} --background")
    assert "in the background" in capsys.readouterr().out
    view.execute("trainer.wait_for_save()", block=True)
    assert magics.mpnb(f"checkpoint info {later} --verify").step == 6

    magics.mpnb(f"checkpoint list {tmp_path}")
    row = capsys.readouterr().out.splitlines()[2].split()  # newest first: "later", then "step3"
    assert row[:2] == ["step3", "3"] and "fsdp" in row[2].lower() and row[3] == "2"  # label or plain name


def test_a_rank_error_comes_back_as_one_message(magics: Any, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        magics.mpnb(f"checkpoint load {tmp_path / 'nothing'}")
    message = str(caught.value)
    assert message.startswith("`%mpnb checkpoint load` failed on rank 0, 1: No checkpoint at")
    assert "Traceback" not in message
