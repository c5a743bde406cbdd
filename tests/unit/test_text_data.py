"""The text notebook 09 trains on, as bytes: shipped with the repo, round-trips, causal-LM batches."""

from __future__ import annotations

import pytest
import torch

from mpnb.text_data import DEVILS_DICTIONARY, VOCAB, byte_batches, decode, encode, read_text


def test_the_text_ships_as_plain_text_without_dictd_markup() -> None:
    text = read_text()
    assert DEVILS_DICTIONARY.stat().st_size == len(text.encode("utf-8")) < 400_000
    assert text.isascii() and "00-database" not in text and "\r" not in text
    assert "Public Domain Text, Copyright Expired" in text  # the edition's notice is kept
    assert "\nCYNIC, n.  A blackguard whose faulty vision sees things as they are," in text
    assert text.rstrip().endswith("sheds its horn every two years.")
    assert all(line == line.rstrip() for line in text.splitlines())


def test_bytes_round_trip_any_text() -> None:
    for text in (read_text()[:5000], "naïve café, 1 € — ∑"):
        ids = encode(text)
        assert ids.dtype == torch.int64 and int(ids.max()) < VOCAB
        assert decode(ids) == text
    assert len(encode("€")) == 3  # one id per byte, not per character
    assert decode(encode("€")[:2]) == "\ufffd"  # a cut character shows as the replacement mark


def test_batches_are_deterministic_windows_of_the_text_with_labels() -> None:
    ids = encode(read_text())
    first = list(byte_batches(ids, batch_size=4, seq_len=32, steps=3, seed=7))
    again = list(byte_batches(ids, batch_size=4, seq_len=32, steps=3, seed=7))
    other = next(byte_batches(ids, batch_size=4, seq_len=32, steps=1, seed=8))
    assert len(first) == 3
    for batch, same in zip(first, again, strict=True):
        assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
        assert batch["input_ids"].shape == (4, 32)
        assert torch.equal(batch["labels"], batch["input_ids"]) and batch["labels"] is not batch["input_ids"]
        assert bool(batch["attention_mask"].eq(1).all())
        assert all(torch.equal(batch[k], same[k]) for k in batch)
    assert not torch.equal(first[0]["input_ids"], other["input_ids"])
    row = decode(first[0]["input_ids"][0])
    assert row in read_text()  # a window of the text itself
    with pytest.raises(ValueError, match="no window of 64 tokens"):
        next(byte_batches(ids[:10], seq_len=64))
