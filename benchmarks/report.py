"""How the benchmarks report: a markdown table on stdout, the measurements as JSON on request."""

from __future__ import annotations

import json


def print_table(columns: list[str], rows: list[list]) -> None:
    """A markdown table: a header of ``columns``, then a line per row of cells."""
    for cells in (columns, ["---"] * len(columns), *rows):
        print("| " + " | ".join(map(str, cells)) + " |")


def save_json(path: str | None, measurements) -> None:
    """``measurements`` as JSON at ``path``, when one is given (``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump(measurements, f, indent=1)
