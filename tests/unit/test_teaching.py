"""The notebooks' measuring helpers on known inputs: bubble arithmetic and the live-activation meter."""

from __future__ import annotations

import pytest
import torch

from mpnb.engine.teaching import LiveActivationMeter, SavedTensorMeter
from mpnb.widgets.timeline import Events, bubble_table, expected_bubble, formula_bubble, idle_share


def gpipe_events(m: int, f: list[float], b: list[float]) -> Events:
    """An ideal 2-stage GPipe step, no communication: stage s takes f[s] per forward, b[s] per backward."""
    events: Events = {0: [], 1: []}
    end0 = [0.0] * m
    t0 = 0.0
    for i in range(m):  # stage 0 forwards back to back
        events[0].append(("F", i, t0, t0 + f[0]))
        end0[i] = t0 + f[0]
        t0 += f[0]
    t1 = 0.0
    for i in range(m):  # stage 1 forward i waits for stage 0's forward i
        start = max(t1, end0[i])
        events[1].append(("F", i, start, start + f[1]))
        t1 = start + f[1]
    back1 = []
    for i in reversed(range(m)):  # stage 1 backwards, then stage 0's as each gradient arrives
        events[1].append(("B", i, t1, t1 + b[1]))
        t1 += b[1]
        back1.append(t1)
    t0 = max(t0, back1[0])
    for i, ready in zip(reversed(range(m)), back1, strict=True):
        start = max(t0, ready)
        events[0].append(("B", i, start, start + b[0]))
        t0 = start + b[0]
    return events


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_equal_stages_give_the_formula(m):
    events = gpipe_events(m, f=[1.0, 1.0], b=[2.0, 2.0])
    assert idle_share(events) == pytest.approx(formula_bubble(2, m))
    assert expected_bubble(events) == pytest.approx(formula_bubble(2, m))
    assert [r["busy s"] for r in bubble_table(events)] == [3.0 * m, 3.0 * m]


def test_unequal_stages_idle_more_and_expected_bubble_predicts_it():
    events = gpipe_events(8, f=[1.0, 1.5], b=[2.0, 3.0])  # stage 1 is 1.5x slower: stage 0 waits for it
    assert idle_share(events) > formula_bubble(2, 8) + 0.05
    assert expected_bubble(events) == pytest.approx(idle_share(events), abs=0.02)


def test_formula_bubble_falls_with_microbatches():
    assert formula_bubble(2, 2) == pytest.approx(1 / 3)
    assert formula_bubble(4, 4) == pytest.approx(3 / 7)
    assert formula_bubble(2, 8) < formula_bubble(2, 4) < formula_bubble(2, 2)
    assert idle_share({}) == 0.0 and expected_bubble({}) == 0.0


def test_live_meter_follows_backwards_and_keeps_the_peak():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with SavedTensorMeter() as once:
        net(x).sum().backward()
    with LiveActivationMeter() as live:
        first = net(x).sum()
        one = live.bytes
        second = net(x).sum()
        two = live.bytes
        first.backward()
        after_first = live.bytes
        second.backward()
    assert one == once.bytes > 0, "one forward saves what SavedTensorMeter counts"
    input_bytes = x.numel() * x.element_size()
    assert two == 2 * one - input_bytes, "two forwards, their shared input counted once"
    assert after_first == one, "a backward frees its forward's activations"
    assert live.bytes == 0 and live.peak_bytes == two
