"""Each rank's random number generator states, so dropout and sampling continue where they stopped."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return states


def restore(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
