"""What every ``kvflow bench ...``, the demo and ``kvflow pool stat`` share: an output folder, a table on the terminal,
JSON, a PNG.

    out = out_dir("pool", args.out)                     # runs/pool-20260101-120000/ unless given
    print_table("aggregate read bandwidth", rows)       # rows: list of dicts, one column per key
    write_json(out / "results.json", results)
    save_figure(out / "pool.png", draw, panels=2)       # draw(axes) fills a row of matplotlib axes (Agg backend)
    BenchRun(results, out, tables, footer).report(as_json)  # a finished benchmark: results.json, tables or JSON
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from rich.console import Console
from rich.table import Table


def out_dir(bench: str, out: str | Path | None = None) -> Path:
    path = Path(out) if out is not None else Path("runs") / f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_table(title: str, rows: Sequence[dict], columns: Sequence[str] | None = None,
                console: Console | None = None) -> None:
    columns = list(columns or (rows[0].keys() if rows else []))
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="left" if rows and isinstance(rows[0].get(c), str) else "right")
    for row in rows:
        table.add_row(*(fmt(row.get(c)) for c in columns))
    (console or Console(width=None if sys.stdout.isatty() else 160)).print(table)   # logs/pipes get whole rows


def write_json(path: str | Path, data) -> Path:
    path = Path(path)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def report(results: dict, folder: Path, tables, as_json: bool, footer: str) -> None:
    """Write ``folder/results.json``; print the results as JSON, or the ``(title, rows)`` tables and ``footer``."""
    write_json(folder / "results.json", results)
    if as_json:
        print(json.dumps(results, indent=2, default=str))
        return
    for title, rows in tables:
        print_table(title, rows)
    Console().print(footer)


@dataclass(slots=True)
class BenchRun:
    """A finished benchmark: ``results`` (its results.json), the ``folder`` holding them and its figures, the
    ``(title, rows)`` tables it prints and the ``footer`` line under them."""
    results: dict
    folder: Path
    tables: list[tuple[str, list[dict]]]
    footer: str

    def to_json(self) -> dict:
        return self.results

    def report(self, as_json: bool) -> None:
        report(self.results, self.folder, self.tables, as_json, self.footer)


def save_figure(path: str | Path, draw: Callable[[list], None], panels: int = 1, size=(5.0, 3.6)) -> Path:
    """One row of ``panels`` axes, filled by ``draw(axes)``, saved as PNG without a display."""
    from kvflow.extras import require
    matplotlib = require("plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(size[0] * panels, size[1]), squeeze=False)
    draw(list(axes[0]))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
