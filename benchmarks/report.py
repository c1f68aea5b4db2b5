"""How the benchmarks report: a markdown table on stdout, the measurements as JSON on request."""

from __future__ import annotations

import json


def table(columns: list[str], rows: list[list]) -> str:
    """A markdown table: a header of ``columns``, then a line per row of cells."""
    return "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in (columns, ["---"] * len(columns), *rows))


def print_table(columns: list[str], rows: list[list]) -> None:
    print(table(columns, rows))


def failure(e: BaseException, limit: int = 300) -> str:
    """How a table records what failed: the exception's type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}"


def save_json(path: str | None, measurements) -> None:
    """``measurements`` as JSON at ``path``, when one is given (``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump(measurements, f, indent=1)
