"""A real text to train language models on: Bierce's "The Devil's Dictionary" (1911), as bytes.

The text ships with the repository (`notebooks/data/`, public domain; provenance in
its README). Bytes are the tokenizer: 256 ids, nothing to download or train, and
any text round-trips (`decode(encode(t)) == t`). torch is imported inside the
functions, so the notebook kernel can import this module without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DATA_DIR = Path(__file__).resolve().parents[1] / "notebooks" / "data"
DEVILS_DICTIONARY = DATA_DIR / "devils_dictionary.txt"
VOCAB = 256  # one id per byte value


def read_text(path: str | Path = DEVILS_DICTIONARY) -> str:
    """The text at `path` (UTF-8), by default The Devil's Dictionary."""
    return Path(path).read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    """Token ids of `text`: its UTF-8 bytes, as a 1-D int64 tensor."""
    import torch

    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids: Iterable[int] | torch.Tensor) -> str:
    """The text of byte ids (a cut in the middle of a multi-byte character shows as U+FFFD)."""
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return bytes(int(i) for i in values).decode("utf-8", errors="replace")


def byte_batches(
    ids: torch.Tensor, batch_size: int = 16, seq_len: int = 64, steps: int = 100, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """`steps` global batches of `batch_size` windows of `seq_len` ids each, taken at seeded random offsets.

    Each batch is a dict as a transformers collator yields it for a causal LM:
    `labels` equals `input_ids` (the model shifts them by one position itself),
    and no padding, so every row has the same number of predicted tokens.
    The same seed gives the same batches on every rank and in every run.
    """
    import torch

    if ids.numel() <= seq_len:
        raise ValueError(f"a text of {ids.numel()} tokens has no window of {seq_len} tokens")
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=generator)
        rows = torch.stack([ids[s: s + seq_len] for s in starts.tolist()])
        yield {"input_ids": rows, "attention_mask": torch.ones_like(rows), "labels": rows.clone()}
