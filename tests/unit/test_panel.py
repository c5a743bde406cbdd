"""The config panel while planning (no cluster): set widget values, check the Config, estimates, messages."""

from __future__ import annotations

import datetime
import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mpnb
from mpnb import Config, estimate
from mpnb.widgets.panel import ConfigPanel, parse_count


def _row_totals(html_text: str, kind: str = "rank") -> dict[str, int]:
    """{label: data-total} for every bar row in the panel's HTML."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(rf'data-{kind}="([^"]+)" data-total="(\d+)"', html_text)}


def _visible(box) -> bool:
    return box.layout.display != "none"


@pytest.fixture
def panel():
    from mpnb.cluster import session as cluster

    assert cluster.current() is None  # these tests plan without a cluster
    p = mpnb.config_panel(world_size=4, device_kind="cuda", capacity_gb=80)
    yield p
    p.close()


def test_strategy_shows_only_its_options(panel: ConfigPanel) -> None:
    expected = {  # strategy -> (zero, fsdp, pipeline, tensor, offload) boxes visible
        "ddp": (False, False, False, False, False),
        "zero": (True, False, False, False, True),
        "fsdp": (False, True, False, False, True),
        "pipeline": (False, False, True, False, False),
        "tensor": (False, True, False, True, False),  # TP 2 x dp 2: FSDP options apply to the dp part
    }
    for strategy, flags in expected.items():
        panel.strategy.value = strategy
        boxes = (panel._zero_box, panel._fsdp_box, panel._pipeline_box, panel._tensor_box, panel._offload_box)
        assert tuple(_visible(b) for b in boxes) == flags, strategy
    panel.tensor_parallel.value = 4  # pure tensor parallelism: nothing left for FSDP
    assert not _visible(panel._fsdp_box)
    assert list(panel.pipeline_stages.options) == [2, 4]  # bounded by the world size
    panel.world.value = 8
    assert list(panel.pipeline_stages.options) == [2, 4, 8]


def test_form_edits_the_config_and_the_bars_follow(panel: ConfigPanel) -> None:
    panel.strategy.value = "zero"
    panel.zero_stage.value = 2
    panel.precision.value = "bf16"
    panel.micro_batch_size.value = 4
    expected_cfg = Config(strategy="zero", zero_stage=2, precision="bf16", micro_batch_size=4)
    assert panel.pending_config() == expected_cfg
    assert panel.apply_button.disabled is False and panel.message.value == ""
    est = estimate(124_000_000, expected_cfg, 4, n_layer=12, hidden=768, n_head=12, vocab_size=50257,
                   seq_len=1024)
    assert panel.last_estimate == est
    assert _row_totals(panel.bars.value) == {"rank 0-3": est.total}
    for key in ("parameters", "gradients", "optimizer", "activations"):
        assert f'mpnb-panel-seg-{key}" data-bytes="{getattr(est, key)}"' in panel.bars.value
    before = _row_totals(panel.bars.value)["rank 0-3"]
    panel.zero_stage.value = 3
    assert _row_totals(panel.bars.value)["rank 0-3"] != before  # the bars change with the stage
    assert "ZeRO-3" in panel.summary.value


def test_hidden_options_are_neutral(panel: ConfigPanel) -> None:
    panel.strategy.value = "zero"
    panel.zero_stage.value = 3
    panel.offload.value = "parameters"
    panel.strategy.value = "ddp"  # zero_stage and offload hidden: not carried into a DDP config
    cfg = panel.pending_config()
    assert (cfg.strategy, cfg.zero_stage, cfg.offload) == ("ddp", 0, "none")
    assert panel.message.value == ""
    panel.strategy.value = "zero"  # the hidden values come back
    assert panel.pending_config().zero_stage == 3


@pytest.mark.parametrize(("changes", "words"), [
    ({"device": "cpu", "precision": "fp16"}, "fp16 is not supported on CPU"),
    ({"strategy": "pipeline", "pipeline_stages": 4, "microbatches": 2}, "fewer than the 4 pipeline stages"),
    ({"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 3}, "equal microbatches"),
    ({"strategy": "zero", "zero_stage": 0, "offload": "optimizer"}, "needs ZeRO stage 1, 2 or 3"),
    ({"strategy": "fsdp", "offload": "optimizer"}, "CPUOffloadPolicy"),
    ({"device": "cpu", "strategy": "fsdp", "offload": "parameters"}, "needs an accelerator"),
    ({"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2, "grad_accum_steps": 2},
     "raise microbatches"),
])
def test_impossible_combination_shows_the_message_and_disables_apply(panel: ConfigPanel, changes: dict,
                                                                     words: str) -> None:
    for name, value in changes.items():
        getattr(panel, name).value = value
    assert words in panel.message.value.replace("&#x27;", "'")
    assert panel.apply_button.disabled is True
    assert "Fix the settings" in panel.bars.value
    with pytest.raises(mpnb.ConfigError, match=re.escape(words)):
        panel.pending_config().validate(panel.world_size(), panel.device_kind())


def test_does_not_fit_warning_and_capacity_marker(panel: ConfigPanel) -> None:
    panel.num_params.value = "7.5B"
    panel.n_layer.value, panel.hidden.value, panel.n_head.value = 32, 4096, 32
    panel.seq_len.value, panel.micro_batch_size.value = 1024, 1
    panel.activation_checkpointing.value = True
    panel.world.value = 64
    assert "Does not fit" in panel.bars.value
    assert 'class="mpnb-panel-capacity" data-bytes="80000000000"' in panel.bars.value
    panel.strategy.value = "zero"
    panel.zero_stage.value = 3
    assert "Does not fit" not in panel.bars.value and "Fits" in panel.bars.value
    assert panel.last_estimate is not None and panel.last_estimate.total < 80e9


def test_compare_view_is_the_zero_figure_for_this_model(panel: ConfigPanel) -> None:
    panel.num_params.value = "7.5B"
    panel.world.value = 64
    panel.precision.value = "bf16"
    compared = panel.compare_estimates()
    assert list(compared) == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP"]
    states = [compared[k].model_states for k in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert states == sorted(states, reverse=True)
    # bf16 DeepSpeed keeps 2 + 2 + 12 bytes: the ZeRO paper's numbers
    assert [round(s / 1e9, 1) for s in states[1:]] == [31.4, 16.6, 1.9]
    totals = _row_totals(panel.compare.value, kind="strategy")
    assert totals == {k: v.worst.total for k, v in compared.items()}


def test_apply_reports_changes_and_suggests_learning_rates(panel: ConfigPanel) -> None:
    panel.lr.value = 3e-4
    panel.strategy.value = "zero"
    panel.zero_stage.value = 2
    panel.micro_batch_size.value = 32
    applied = panel.apply()
    assert applied == panel.config == Config(strategy="zero", zero_stage=2, micro_batch_size=32)
    text = panel.changes.value
    assert "zero_stage</code>: 0 → 2" in text and "micro_batch_size</code>: 8 → 32" in text
    assert "32 → 128" in text  # global batch on 4 ranks
    assert "0.0012" in text and "0.0006" in text  # linear x4, square root x2
    assert panel.apply_button.disabled is True  # nothing left to apply
    panel.lr.value = 1e-3  # entered later: the suggestion follows
    assert "0.004" in panel.changes.value and "0.002" in panel.changes.value
    panel.precision.value = "bf16"
    panel.apply()
    assert "global batch size changed" not in panel.changes.value


def test_apply_button_click(panel: ConfigPanel) -> None:
    panel.strategy.value = "fsdp"
    panel.apply_button.click()
    assert panel.config.strategy == "fsdp"


def test_export_text_and_files(panel: ConfigPanel, tmp_path: Path) -> None:
    panel.strategy.value = "zero"
    panel.zero_stage.value = 3
    panel.offload.value = "parameters"
    cfg = panel.pending_config()
    assert json.loads(panel.ds_text.value) == cfg.to_deepspeed(4)
    assert panel.code_text.value == cfg.to_code(4, "cuda")
    compile(panel.code_text.value, "panel-code", "exec")
    panel.ds_path.value = str(tmp_path / "ds_config.json")
    panel.save_ds_button.click()
    assert json.loads((tmp_path / "ds_config.json").read_text()) == cfg.to_deepspeed(4)
    assert "Saved" in panel.io_message.value
    panel.code_path.value = str(tmp_path / "train.py")
    panel.save_code_button.click()
    assert "deepspeed.initialize" in (tmp_path / "train.py").read_text()
    panel.strategy.value = "tensor"
    assert panel.ds_text.value.startswith("//") and "no ds_config" in panel.ds_text.value
    panel.ds_path.value = str(tmp_path / "none.json")
    panel.save_ds_button.click()
    assert not (tmp_path / "none.json").exists() and "Nothing to save" in panel.io_message.value
    panel.code_path.value = str(tmp_path / "missing-dir" / "x.py")
    panel.save_code_button.click()
    assert "Cannot write" in panel.io_message.value


def test_import_from_path_and_upload(panel: ConfigPanel, tmp_path: Path) -> None:
    source = Config(strategy="zero", zero_stage=3, offload="parameters", precision="bf16", micro_batch_size=2,
                    grad_accum_steps=4)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(source.to_deepspeed(4)))
    panel.import_path.value = str(path)
    panel.load_button.click()
    assert panel.pending_config() == source
    assert panel.config == Config()  # loaded into the form, not applied
    assert "Loaded" in panel.io_message.value and not panel.apply_button.disabled

    other = Config(strategy="zero", zero_stage=1).to_deepspeed(4)
    content = json.dumps(other).encode()
    panel.upload.value = ({"name": "upload.json", "type": "application/json", "size": len(content),
                           "content": memoryview(content),
                           "last_modified": datetime.datetime.now(datetime.timezone.utc)},)
    assert panel.pending_config() == Config(strategy="zero", zero_stage=1)

    panel.import_path.value = str(tmp_path / "nope.json")
    panel.load_button.click()
    assert "Cannot read" in panel.io_message.value
    path.write_text("{not json")
    panel.import_path.value = str(path)
    panel.load_button.click()
    assert "not valid JSON" in panel.io_message.value
    assert panel.pending_config() == Config(strategy="zero", zero_stage=1)  # the form kept its values


@pytest.mark.parametrize(("text", "named"), [
    ('{"train_micro_batch_size_per_gpu": 0, "train_batch_size": 32}', "train_micro_batch_size_per_gpu"),
    ('{"train_micro_batch_size_per_gpu": "abc", "train_batch_size": 32}', "train_micro_batch_size_per_gpu"),
    ('{"train_micro_batch_size_per_gpu": NaN, "train_batch_size": 32}', "train_micro_batch_size_per_gpu"),
    ('{"train_micro_batch_size_per_gpu": Infinity}', "train_micro_batch_size_per_gpu"),
    ('{"train_micro_batch_size_per_gpu": [8], "train_batch_size": 32}', "train_micro_batch_size_per_gpu"),
    ('{"train_batch_size": 1e400, "train_micro_batch_size_per_gpu": 4}', "train_batch_size"),
    ('{"zero_optimization": {"stage": "two"}}', "zero_optimization.stage"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"train_micro_batch_size_per_gpu": 5000000}', "micro_batch_size=5000000 is outside what the form"),
])
def test_import_shows_why_a_malformed_ds_config_is_refused(panel: ConfigPanel, tmp_path: Path, text: str,
                                                           named: str) -> None:
    panel.strategy.value = "fsdp"  # the form before the import; it must keep these values
    before = panel.pending_config()
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    panel.import_path.value = str(path)
    panel.load_button.click()
    assert named in html.unescape(panel.io_message.value) and "color" in panel.io_message.value
    assert panel.pending_config() == before

    content = text.encode()
    panel.io_message.value = ""
    panel.upload.value = ({"name": "upload.json", "type": "application/json", "size": len(content),
                           "content": memoryview(content),
                           "last_modified": datetime.datetime.now(datetime.timezone.utc)},)
    assert named in html.unescape(panel.io_message.value)
    assert panel.pending_config() == before


def test_import_reads_a_bounded_prefix_of_a_wrong_path(panel: ConfigPanel, tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    for path, named in [(binary, "not valid JSON"), (Path("/dev/zero"), "characters long"),
                        (tmp_path, "Cannot read")]:
        panel.import_path.value = str(path)
        panel.load_button.click()
        assert named in panel.io_message.value, path


def test_panel_with_a_module() -> None:
    from mpnb.models import tiny_gpt

    model = tiny_gpt()
    p = mpnb.config_panel(model, world_size=2, device_kind="cpu", capacity_gb=1)
    try:
        assert p.num_params.disabled and p.num_params.value == f"{model.num_parameters():,}"
        assert p.seq_len.value == model.config.seq_len
        p.strategy.value = "fsdp"
        assert p.last_estimate == estimate(model, Config(strategy="fsdp"), 2, seq_len=model.config.seq_len)
        assert "Fits" in p.bars.value
    finally:
        p.close()


def test_parse_count() -> None:
    assert parse_count("124M") == 124_000_000
    assert parse_count("7.5B") == 7_500_000_000
    assert parse_count("1e9") == 1_000_000_000
    assert parse_count("350,000") == 350_000
    with pytest.raises(mpnb.ConfigError, match="124M"):
        parse_count("lots")


def test_bad_parameter_count_is_a_message(panel: ConfigPanel) -> None:
    panel.num_params.value = "lots"
    assert "Cannot read the parameter count" in panel.bars.value


def test_panel_imports_no_torch() -> None:
    code = ("import sys, mpnb; p = mpnb.config_panel(7_000_000_000, world_size=8);"
            "p.strategy.value = 'zero'; p.zero_stage.value = 3; p.apply();"
            "assert 'torch' not in sys.modules, 'torch imported'; print(p.config.summary())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("ZeRO-3")


def test_the_activation_formula_is_one_line_in_the_panel_and_whole_on_hover():
    from mpnb.models import tiny_gpt
    from mpnb.widgets.bars import estimate_html

    est = mpnb.estimate(tiny_gpt(), {"strategy": "ddp"}, 2)
    note = r'<div class="mpnb-panel-note"( title="[^"]*")? [^>]*>([^<]*)</div>'
    notes = re.findall(note, estimate_html(est, 2**30))
    formula = [(title, text) for title, text in notes if text.startswith("activations:")]
    assert formula == [(f' title="{html.escape("activations: " + est.activation_formula)}"',
                        "activations: GPT-style transformer (hover: formula)")]
