"""What the memory chart plots (issue 13, items 4-5), in this process: no engines, no browser.

The activation tracker on a real model and optimizer step, the sample's categories on CPU
and CUDA, the estimate sent the moment `mpnb.prepare` runs, and the static PNG's time axis.
"""

from __future__ import annotations

import io

import pytest

from mpnb.monitoring import protocol


def _sample(device_kind: str, used: int, parts: dict[str, int]) -> dict:
    return protocol.make_sample(rank=0, t=1.7e9, busy=True, device_kind=device_kind, used=used, reserved=used,
                                peak=used, capacity=8 * 2**30, device_used=None, oom_count=0, parts=parts)


def test_cpu_rss_is_not_stacked_as_other_but_cuda_allocated_is():
    parts = {"parameters": 2**20, "gradients": 2**20, "optimizer": 2**21, "activations": 2**22}
    cpu = _sample("cpu", 400 * 2**20, parts)
    assert cpu["other"] == 0 and cpu["used"] == 400 * 2**20  # RSS: the chart's separate line
    assert all(cpu[key] == value for key, value in parts.items())
    cuda = _sample("cuda", 100 * 2**20, parts)
    assert cuda["other"] == 100 * 2**20 - 8 * 2**20
    assert protocol.valid_sample(cpu) == cpu  # the kernel keeps the new category


def test_activation_tracker_counts_saved_tensors_and_frees_them_in_backward():
    import torch

    import mpnb
    from mpnb.engine import state
    from mpnb.engine.activations import ActivationTracker
    from mpnb.models import synthetic_batches, tiny_gpt

    tracker = ActivationTracker()
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with tracker.step():
        y = torch.relu(layer(x))  # relu saves its 64 KiB output; the weight is not counted
        assert tracker.current >= 64 * 256 * 4
        y.sum().backward()
        assert tracker.current == 0  # backward handed every saved storage back
    assert tracker.last_peak >= 64 * 256 * 4 and tracker.last_peak < 4 * 64 * 256 * 4

    model = tiny_gpt()
    before = state.estimate_version
    trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    # the estimate line is announced by prepare itself, for this model (not a panel default)
    assert state.estimate_version == before + 1
    assert state.last_estimate.by_rank() == mpnb.estimate(model, mpnb.Config(), 1).by_rank()
    assert trainer.memory_breakdown()["activations"] == 0
    trainer.step(next(iter(synthetic_batches(batch_size=8, steps=1))))
    got = trainer.memory_breakdown()
    assert got["activations"] > got["parameters"] > 0  # batch 8 x 64 tokens: activations dominate


def test_static_chart_draws_cpu_samples_with_the_cell_start_as_time_zero():
    pytest.importorskip("matplotlib")
    from PIL import Image

    from mpnb.monitoring.chart_image import render_png

    parts = {"parameters": 2**20, "gradients": 2**20, "optimizer": 2**21, "activations": 2**22}
    samples = [{**_sample("cpu", (400 + i) * 2**20, parts), "t": 1000.0 + i / 10} for i in range(30)]
    png = render_png(samples, {0: 9 * 2**20}, t0=999.0)
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.width > 200
    assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 10
