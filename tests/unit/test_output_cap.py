"""The per-rank output caps (pure: `OutputCap` feeding a `RankMerger`, as `CellRun` does)."""

from __future__ import annotations

import time

from mpnb.execution.output import RankMerger
from mpnb.execution.output_cap import (
    MAX_CHARS_PER_RANK,
    MAX_DISPLAYS_PER_RANK,
    MAX_LINE_CHARS,
    OutputCap,
)


def shown(chunks: list[tuple[str, str]], displays: int = 0) -> list[tuple[str, str]]:
    """What rank 0 shows for these (stream, text) messages and `displays` display() calls."""
    cap, merger = OutputCap(), RankMerger([0])
    for stream, text in chunks:
        kept = cap.admit(0, stream, text)
        if kept:
            merger.add_text(0, stream, kept, 0.0)
    for i in range(displays):
        content = {"data": {"text/plain": f"item {i}"}, "metadata": {}}
        if cap.admit_display(0, content):
            merger.add_display(0, content, 0.0)
    cap.add_note(0, merger, 0.0)
    merger.finish(0, 0.0)
    return [
        (item.kind, item.payload if item.kind != "display" else "") for _, item in merger.drain(0.0, True)
    ]


def test_a_normal_cell_is_untouched():
    chunks = [
        ("stdout", "epoch 0 loss 1.0\n"),
        ("stderr", "warning\n"),
        ("stdout", "epoch 1 "),
        ("stdout", "end"),
    ]
    assert shown(chunks, displays=3) == [
        ("stdout", "epoch 0 loss 1.0"),
        ("stderr", "warning"),
        ("display", ""),
        ("display", ""),
        ("display", ""),
        ("stdout", "epoch 1 end"),
    ]


def test_megabytes_without_a_newline_and_long_lines_are_cut_with_notes():
    mib = "x" * 2**20
    chunks = (
        [("stdout", mib)] * 200
        + [("stdout", "\n")]
        + [("stdout", f"long {i} " + "y" * 100_000 + "\n") for i in range(2000)]
    )
    t0 = time.perf_counter()
    out = shown(chunks)
    assert time.perf_counter() - t0 < 5
    total = sum(len(text) for _, text in out)
    assert total < MAX_CHARS_PER_RANK + 12 * (MAX_LINE_CHARS + 100), total  # was 295 MiB
    first = out[0][1]
    assert (
        first
        == "x" * MAX_LINE_CHARS
        + f" [mpnb: {200 * 2**20 - MAX_LINE_CHARS:,} more characters of this line not shown]"
    )
    assert out[1][1].startswith("long 0 yyy") and out[1][1].endswith(
        "[mpnb: 90,007 more characters of this line not shown]"
    )
    notes = [text for _, text in out if text.startswith("mpnb: ")]
    assert (
        len(notes) == 1
        and "more lines (" in notes[0]
        and "MiB) not shown (the first 2.0 MiB of each rank" in notes[0]
    )
    assert notes[0].endswith("; the last 10:")
    assert out[-1][1].startswith("long 1999 yyy") and out[-1][1].endswith(
        "more characters of this line not shown]"
    )


def test_an_unfinished_long_line_says_what_was_cut_when_the_rank_ends():
    out = shown([("stdout", "z" * (MAX_LINE_CHARS + 5))])
    assert out == [("stdout", "z" * MAX_LINE_CHARS + " [mpnb: 5 more characters of this line not shown]")]


def test_the_line_cap_and_its_note_are_unchanged():
    out = shown(
        [
            ("stdout", "".join(f"flood line {i}\n" for i in range(j, j + 1000)))
            for j in range(0, 100_000, 1000)
        ]
    )
    assert out[999] == ("stdout", "flood line 999")
    assert out[1000][1] == (
        "mpnb: 99,000 more lines not shown (the first 1,000 lines of each rank are; "
        "write long logs to a file); the last 10:"
    )
    assert out[-1] == ("stdout", "flood line 99999") and len(out) == 1000 + 1 + 10


def test_progress_redraws_do_not_count_towards_the_caps():
    bar = "".join(f"\r{i}/9000 |{'#' * (i // 200)}" for i in range(9000))  # ~0.5 MiB of redraws per bar
    chunks = [("stderr", bar[k : k + 4000]) for k in range(0, len(bar), 4000)] + [("stderr", "\n")]
    out = shown(chunks * 10 + [("stdout", "done\n")])
    assert out == [("stderr", "8999/9000 |" + "#" * 44)] * 10 + [("stdout", "done")]


def test_thousands_of_displays_are_capped_with_a_note():
    out = shown([("stdout", "start\n")], displays=3000)
    assert [kind for kind, _ in out].count("display") == MAX_DISPLAYS_PER_RANK
    note = out[-1][1]
    assert note.startswith(f"mpnb: {3000 - MAX_DISPLAYS_PER_RANK:,} more displays (") and "not shown" in note
