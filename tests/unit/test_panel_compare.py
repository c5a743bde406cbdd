"""The panel's "Compare strategies" tab: the ZeRO paper's figure apart from activations and buffers.

Issue 13: drawn together, DeepSpeed's reduce bucket and the activations made ZeRO-1/2
look bigger than DDP under a caption promising the paper's Figure 1.
"""

from __future__ import annotations

import re

import pytest

import mpnb
from mpnb.widgets.panel import ConfigPanel
from mpnb.widgets.panel_compare import PAPER_GB, paper_example


def _rows(text: str, kind: str) -> dict[str, int]:
    found = re.finditer(rf'data-{kind}="([^"]+)" data-total="(\d+)"', text)
    return {m.group(1): int(m.group(2)) for m in found}


@pytest.fixture
def panel():
    p = mpnb.config_panel(world_size=8, device_kind="cuda", capacity_gib=80)  # GPT-2 small by default
    yield p
    p.close()


def test_estimator_reproduces_the_papers_figure_1_in_decimal_gb() -> None:
    ours = paper_example()
    assert {name: round(b / 1e9, 1) for name, b in ours.items()} == PAPER_GB == {
        "DDP": 120.0, "ZeRO-1": 31.4, "ZeRO-2": 16.6, "ZeRO-3": 1.9}


def test_model_states_shrink_stage_by_stage_apart_from_buckets(panel: ConfigPanel) -> None:
    text = panel.compare.value
    states = _rows(text, "states")
    compared = panel.compare_estimates()
    assert states == {name: est.model_states for name, est in compared.items()}
    assert states["DDP"] >= states["ZeRO-1"] >= states["ZeRO-2"] >= states["ZeRO-3"]
    # the state bars draw only parameters, gradients and optimizer state
    section = text[:text.index('class="mpnb-panel-paper"')]
    assert "mpnb-panel-seg-buffers" not in section and "mpnb-panel-seg-activations" not in section
    # activations and buffers apart, DeepSpeed's bucket named with the setting that changes it
    other = _rows(text, "other")
    assert other == {name: est.activations + est.buffers for name, est in compared.items()}
    # the fp32 reduce bucket, allocated whole: DeepSpeed's 5e8 elements capped at the model's size
    assert other["ZeRO-1"] - other["DDP"] == compared["DDP"].parameters == 4 * 124_000_000
    for setting in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "zero_optimization"):
        assert setting in text
    # the totals still add up to what each rank holds
    assert _rows(text, "strategy") == {name: est.total for name, est in compared.items()}


def test_paper_caption_says_its_numbers_are_decimal_gb(panel: ConfigPanel) -> None:
    paper = re.search(r'<div class="mpnb-panel-paper".*?</table></div>', panel.compare.value).group(0)
    assert "decimal GB" in paper and "GiB" in paper
    for gb in ("120 GB", "31.4 GB", "16.6 GB", "1.9 GB"):
        assert gb in paper


def test_memory_is_in_binary_units_outside_the_paper_caption(panel: ConfigPanel) -> None:
    panel.strategy.value = "zero"
    panel.zero_stage.value = 2
    outside = re.sub(r'<div class="mpnb-panel-paper".*?</table></div>', "", panel.compare.value)
    for text in (outside, panel.bars.value, panel.summary.value, panel.message.value):
        assert not re.search(r"\d\s*GB\b", text), text
    assert "GiB" in outside and "GiB" in panel.bars.value


def test_every_line_has_a_legend_entry(panel: ConfigPanel) -> None:
    for text in (panel.compare.value, panel.bars.value):
        assert "mpnb-panel-capacity" in text  # the red dashed line is drawn ...
        assert 'data-category="capacity"' in text  # ... and named in a legend
    panel.capacity_gib.value = 0  # no capacity: no line, no legend entry for it
    assert 'data-category="capacity"' not in panel.bars.value


def test_apply_looks_enabled_only_when_it_is_and_the_learning_rate_is_asked_for_when_needed(
        panel: ConfigPanel) -> None:
    assert panel.apply_button.disabled and panel.apply_button.button_style == ""
    assert "nothing to apply" in panel.apply_status.value
    assert panel._lr_box.layout.display == "none"  # no unexplained "learning rate 0" beside Apply
    panel.precision.value = "bf16"  # a change that keeps the global batch
    assert not panel.apply_button.disabled and panel.apply_button.button_style == "primary"
    assert panel._lr_box.layout.display == "none"
    panel.micro_batch_size.value = 16  # the global batch changes: the learning-rate advice needs the rate
    assert panel._lr_box.layout.display != "none"
    assert "rescaling" in panel._lr_box.children[1].value


def test_the_training_cell_is_the_newest_distributed_cell_that_prepares_and_steps() -> None:
    from types import SimpleNamespace

    from mpnb.widgets.panel_measured import training_cell

    train = "trainer = mpnb.prepare(net, opt)\nfor b in batches:\n    trainer.step(b)"
    history = ["", f"%%distributed\n{train}", "%%distributed\nprint(1)", f"%%distributed --rank 0\n{train}",
               "x = 1"]
    shell = SimpleNamespace(history_manager=SimpleNamespace(input_hist_raw=history))
    assert training_cell(shell) == ("In [1]", train)
    assert training_cell(SimpleNamespace(history_manager=SimpleNamespace(input_hist_raw=history[:1]))) is None
    compared = SimpleNamespace(cell="run()\n", origin="")
    assert training_cell(None, compared) == ("the last compared cell", "run()\n")


def test_without_a_cluster_measure_these_says_what_to_do_first(panel: ConfigPanel) -> None:
    assert panel.measure_button.disabled
    assert "%mpnb start" in panel.measure_status.value
    assert "Nothing measured yet" in panel.measured.value
