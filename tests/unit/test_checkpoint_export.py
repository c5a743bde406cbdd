"""`mpnb.export_checkpoint`: sharded checkpoints (and DeepSpeed's) as weights plain torch / transformers load.

The checkpoints are real: `mpnb.prepare` outside a cluster (world size 1) and
`trainer.save`, and DeepSpeed's own `engine.save_checkpoint` in a subprocess
(a one-rank gloo group of its own, so this process stays without one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mpnb
from mpnb.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


def _trained(net: torch.nn.Module, batches: list, path: Path) -> dict[str, torch.Tensor]:
    """Train `net` on `batches` with AdamW, save to `path`; returns the trained weights."""
    trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), config={"strategy": "ddp"})
    for batch in batches:
        trainer.step(batch)
    trainer.save(path)
    return {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    from mpnb.models import synthetic_batches, tiny_gpt

    path = tmp_path_factory.mktemp("gpt") / "ckpt"
    return path, _trained(tiny_gpt(0), list(synthetic_batches(batch_size=8, steps=3)), path)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny GPT-2 (its LM head tied to the token embedding) trained two steps and saved."""
    from mpnb.hf_models import text_batches, tiny_transformer

    net = tiny_transformer("gpt2")
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    _trained(net, list(text_batches(net, steps=2)), path)
    return path, net


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_safetensors_export_loads_strictly_into_a_fresh_model(gpt, tmp_path: Path) -> None:
    from mpnb.models import tiny_gpt

    path, trained = gpt
    out = mpnb.export_checkpoint(path, tmp_path / "w" / "gpt.safetensors")  # the folder is created
    assert out == tmp_path / "w" / "gpt.safetensors" and out.is_file()
    assert _leftovers(out.parent) == []
    fresh = tiny_gpt(0)
    assert any(not torch.equal(fresh.state_dict()[k], v) for k, v in trained.items())  # training moved them
    fresh.load_state_dict(load_file(out), strict=True)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert set(load_file(out)) == set(trained)  # weights only: no optimizer state, no "model." prefix

    folder = mpnb.export_checkpoint(path, tmp_path / "plain")  # not transformers: a folder, same weights
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    assert load_file(folder / "model.safetensors").keys() == load_file(out).keys()


def test_a_plain_torch_process_loads_the_export(gpt, tmp_path: Path) -> None:
    """No mpnb, no torch.distributed: just torch, safetensors and the model's class."""
    path, trained = gpt
    out = mpnb.export_checkpoint(path, tmp_path / "gpt.safetensors")
    torch.save(trained, tmp_path / "trained.pt")
    code = textwrap.dedent(f"""
        import sys, torch
        from safetensors.torch import load_file
        sys.modules["mpnb"] = None  # importing mpnb would fail: the export must not need it
        sd = load_file({str(out)!r})
        trained = torch.load({str(tmp_path / 'trained.pt')!r})
        assert sd.keys() == trained.keys() and all(torch.equal(sd[k], trained[k]) for k in sd)
        assert not torch.distributed.is_initialized()
        print("ok", len(sd))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", str(len(trained))]


def test_transformers_export_round_trips_through_from_pretrained(hf, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mpnb.hf_models import text_batches, tiny_transformer

    path, trained = hf
    assert json.loads((path / "mpnb.json").read_text())["tied"] == ["lm_head.weight"]
    out = mpnb.export_checkpoint(path, tmp_path / "gpt2")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" not in load_file(out / "model.safetensors")  # from_pretrained ties it again
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    batch = next(text_batches(trained, steps=1, seed=5))
    trained.eval()
    with torch.no_grad():
        want = trained(input_ids=batch["input_ids"]).logits
        got = loaded(input_ids=batch["input_ids"]).logits
    assert torch.equal(got, want)
    assert not torch.equal(tiny_transformer("gpt2")(input_ids=batch["input_ids"]).logits, want)

    single = mpnb.export_checkpoint(path, tmp_path / "gpt2.safetensors")  # one file keeps the tied head
    fresh = tiny_transformer("gpt2", seed=1)
    fresh.load_state_dict(load_file(single), strict=True)
    assert torch.equal(fresh.lm_head.weight, trained.lm_head.weight)

    again = mpnb.export_checkpoint(path, out)  # an earlier export at `out` is replaced
    assert again == out and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert _leftovers(tmp_path) == []


def test_what_cannot_be_exported_is_a_checkpoint_error(gpt, tmp_path: Path) -> None:
    import shutil

    path, _ = gpt
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    cases = {
        tmp_path / "nothing": "does not exist",
        tmp_path / "notes": "has no mpnb.json",
    }
    for source, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            mpnb.export_checkpoint(source, tmp_path / "out.safetensors")
    with pytest.raises(CheckpointError, match="is not an earlier export"):
        mpnb.export_checkpoint(path, tmp_path / "notes")
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="into itself"):
        mpnb.export_checkpoint(path, path / "inside.safetensors")

    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    shard = next(damaged.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, other bytes: the checksum catches it before anything is written
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"damaged \(__0_.*checksum differs"):
        mpnb.export_checkpoint(damaged, tmp_path / "d.safetensors")
    assert not (tmp_path / "d.safetensors").exists() and _leftovers(tmp_path) == []


DEEPSPEED_SAVE = """
import os, sys, torch, deepspeed
from mpnb.models import synthetic_batches, tiny_gpt
import torch.nn.functional as F
net = tiny_gpt(0)
engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2),
    config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}})
for x, y in synthetic_batches(batch_size=8, steps=2):
    loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(sys.argv[1])
torch.save({k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}, sys.argv[2])
# exported here, where deepspeed is imported already (and a process group exists: export needs none)
import mpnb
tag = open(os.path.join(sys.argv[1], "latest")).read().strip()
for source in (sys.argv[1], os.path.join(sys.argv[1], tag)):  # the folder, or one tag in it
    mpnb.export_checkpoint(source, os.path.join(sys.argv[3], os.path.basename(source) + ".safetensors"))
"""


def test_a_deepspeed_zero_checkpoint_converts_the_same_way(tmp_path: Path) -> None:
    from mpnb.models import tiny_gpt

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}
    ds_dir, ref, out_dir = tmp_path / "ds", tmp_path / "ref.pt", tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", DEEPSPEED_SAVE, str(ds_dir), str(ref), str(out_dir)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    tag = (ds_dir / "latest").read_text().strip()
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(["ds.safetensors", f"{tag}.safetensors"])
    trained = torch.load(ref)
    assert any(not torch.equal(tiny_gpt(0).state_dict()[k], v) for k, v in trained.items())
    for out in out_dir.iterdir():
        fresh = tiny_gpt(1)
        fresh.load_state_dict(load_file(out), strict=True)
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, trained[name]), name


def test_an_untied_llama_round_trips_too(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mpnb.hf_models import text_batches, tiny_transformer

    net = tiny_transformer("llama")
    _trained(net, list(text_batches(net, steps=1)), tmp_path / "ckpt")
    out = mpnb.export_checkpoint(tmp_path / "ckpt", tmp_path / "llama")
    assert set(load_file(out / "model.safetensors")) == set(net.state_dict())  # nothing tied: all kept
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = next(text_batches(net, steps=1, seed=3))["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, net.eval()(input_ids=ids).logits)


FULL_DISK = """
import resource, signal, sys
from mpnb.checkpoints.export import export_checkpoint
from mpnb.errors import CheckpointError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    export_checkpoint(sys.argv[1], sys.argv[2])
except CheckpointError as e:
    print("CheckpointError:", e)
"""


def test_a_full_disk_leaves_the_earlier_export_whole(gpt, tmp_path: Path) -> None:
    path, _ = gpt
    out = mpnb.export_checkpoint(path, tmp_path / "gpt.safetensors")
    before = out.read_bytes()
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(path), str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"CheckpointError: Writing the export to {out} failed (")
    assert "the checkpoint itself is unchanged" in done.stdout
    assert out.read_bytes() == before and _leftovers(tmp_path) == []
