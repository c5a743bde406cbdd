"""How mpnb writes byte counts for people: binary units (KiB, MiB, GiB, TiB) everywhere.

Device memory is sized in powers of two (an "80 GB" A100 holds 80 GiB), so charts,
reports, the config panel's bars and estimates all use these units. Standard library only.
"""

from __future__ import annotations

_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int | float | None) -> str:
    """'1.75 GiB', '300.0 MiB', '12.0 KiB', '512 B'; '-' when the number is unknown."""
    if n is None:
        return "-"
    value = float(n)
    for unit, size in _BINARY_UNITS:
        if abs(value) >= size:
            # two decimals where one unit is a lot of memory, one below
            return f"{value / size:.2f} {unit}" if size >= 2**30 else f"{value / size:.1f} {unit}"
    return f"{int(value)} B"
