"""Figures, their baselines and targets, and the table that shows them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    """One figure of the table: what was measured, its baseline from the same run, the target.

    `ratio` is always measured / baseline. `met` is None where there is no target or no
    figure; otherwise the section decided it against the target's own rule.
    """

    key: str
    figure: str
    measured: float | None
    baseline: float | None
    unit: str
    target: str
    met: bool | None
    digits: int = 2
    baseline_unit: str | None = None

    @property
    def ratio(self) -> float | None:
        """Return measured / baseline, or None where that means nothing."""
        if self.measured is None or not self.baseline:
            return None
        return self.measured / self.baseline

    def as_json(self) -> dict[str, Any]:
        """Return the row as a JSON-ready dict."""
        return {
            "figure": self.figure,
            "measured": self.measured,
            "baseline": self.baseline,
            "unit": self.unit,
            "ratio": self.ratio,
            "target": self.target,
            "met": self.met,
        }


@dataclass
class Result:
    """What a section produced: table rows, notes for the reader, raw numbers for the JSON."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """Return the section as a JSON-ready dict."""
        out: dict[str, Any] = {"figures": {r.key: r.as_json() for r in self.rows}, **self.data}
        if self.notes:
            out["notes"] = self.notes
        if self.skipped:
            out["skipped"] = self.skipped
        if self.error:
            out["error"] = self.error
        return out


def fmt(value: float | None, unit: str, digits: int) -> str:
    """Return value with its unit, thousands separated; 'n/a' for None."""
    if value is None:
        return "n/a"
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}".rstrip() if unit else text


def verdict(met: bool | None) -> str:
    """Return MET, MISSED or '-' (no target)."""
    return "-" if met is None else "MET" if met else "MISSED"


HEADER = ("figure", "measured", "baseline", "ratio", "target", "")


def table(results: dict[str, Result], titles: dict[str, str]) -> list[str]:
    """Return the report's lines: one block per section, rows then notes."""
    lines: list[str] = []
    widths = (52, 16, 16, 7, 24)
    head = "".join(f"{h:<{w}}" for h, w in zip(HEADER, widths, strict=False)) + "verdict"
    lines.append(head)
    lines.append("-" * len(head))
    for name, res in results.items():
        lines.append(f"[{name}] {titles.get(name, '')}".rstrip())
        if res.skipped:
            lines.append(f"  skipped: {res.skipped}")
        if res.error:
            first, *rest = res.error.splitlines() or ["(no message)"]
            lines.append(f"  NO FIGURES: {first}")
            lines.extend(f"    {line}" for line in rest)
        for r in res.rows:
            ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
            cells = (
                f"  {r.figure}",
                fmt(r.measured, r.unit, r.digits),
                fmt(r.baseline, r.baseline_unit or r.unit, r.digits),
                ratio,
                r.target,
            )
            lines.append("".join(f"{c:<{w - 1}} " for c, w in zip(cells, widths, strict=True)) + verdict(r.met))
        lines.extend(f"    - {note}" for note in res.notes)
        lines.append("")
    return lines
