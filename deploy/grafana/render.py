"""Draws the dashboard's panels with matplotlib from a real Prometheus' answers to their queries.

    python deploy/grafana/render.py --prometheus http://127.0.0.1:9090 --minutes 10 \\
        --out docs/dashboard.png

Each time series panel of specdec.json becomes one small plot titled like the panel: its
queries, with the dashboard's variables set to "All" and `$__rate_interval` to --rate-window,
go to /api/v1/query_range, and each returned series is one line labelled by the query's legend
format. It is not a Grafana screenshot (no Grafana runs here), and the caption says so.
tests/deploy/test_prometheus.py calls `draw` on its own Prometheus when SPECDEC_DASHBOARD_PNG
names the output file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "specdec.json"
CAPTION = "drawn from real Prometheus query results with matplotlib; not a Grafana screenshot"
ALL = ".*"  # the dashboard variables' allValue


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]


def panels(dashboard: dict[str, Any]) -> list[Panel]:
    """The time series panels of a dashboard JSON, in the dashboard's order."""
    return [
        Panel(
            p["title"],
            p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
            tuple(Query(t["expr"], t.get("legendFormat", "")) for t in p.get("targets", ())),
        )
        for p in dashboard["panels"]
        if p["type"] == "timeseries"
    ]


def substitute(expr: str, rate_window: str, variables: dict[str, str] | None = None) -> str:
    """`expr` as Grafana sends it with every variable at `variables` (default: All)."""
    expr = expr.replace("$__rate_interval", rate_window)
    values = variables or {}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), ALL), expr)


def api(url: str, path: str, **params: str) -> Any:
    """The `data` of a Prometheus HTTP API answer; raises on an error status."""
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=30) as response:
        body = json.loads(response.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus answered {body} to {path} {params}.")
    return body["data"]


def legend(form: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), form).strip()


Series = list[tuple[str, list[float], list[float]]]  # (legend, times, values) of each series


def series(url: str, query: Query, start: float, end: float, step: float, window: str) -> Series:
    """Each series one query returns over [start, end]."""
    data = api(
        url, "/api/v1/query_range", query=substitute(query.expr, window),
        start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}",
    )  # fmt: skip
    return [
        (
            legend(query.legend, s["metric"]),
            [float(t) for t, _ in s["values"]],
            [float(v) for _, v in s["values"]],
        )
        for s in data["result"]
    ]


def _format_axis(ax: Any, unit: str) -> None:
    from matplotlib.ticker import EngFormatter, PercentFormatter

    if unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    elif unit == "s":
        ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
    elif unit == "reqps":
        ax.set_ylabel("requests/s", fontsize=7)


def draw(
    url: str,
    out: Path,
    start: float,
    end: float,
    *,
    rate_window: str = "30s",
    note: str = "",
    dashboard: Path = DASHBOARD,
) -> int:
    """Draws every panel over [start, end] into `out`; returns the number of series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = panels(json.loads(dashboard.read_text()))
    cols = 3
    rows = math.ceil(len(specs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.3 * rows), squeeze=False)
    step = max((end - start) / 300, 1.0)
    drawn = 0
    for ax, spec in zip(axes.flat, specs, strict=False):
        for query in spec.queries:
            for name, times, values in series(url, query, start, end, step, rate_window):
                ax.plot([(t - start) / 60 for t in times], values, label=name, linewidth=1.2)
                drawn += 1
        ax.set_title(spec.title, fontsize=10)
        ax.set_xlabel("minutes", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_xlim(0, (end - start) / 60)
        ax.set_ylim(bottom=0)
        _format_axis(ax, spec.unit)
        if ax.lines:
            ax.legend(fontsize=6, loc="best", ncol=2 if len(ax.lines) > 6 else 1)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(specs) :]:
        ax.axis("off")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(end))
    fig.suptitle(f"specdec dashboard panels ({stamp}): {CAPTION}", fontsize=12)
    fig.text(0.5, 0.005, note, ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="base URL, http://host:9090")
    parser.add_argument("--minutes", type=float, default=15.0, help="the range, ending now")
    parser.add_argument("--rate-window", default="1m", help="what $__rate_interval becomes")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    end = time.time()
    draw(args.prometheus.rstrip("/"), args.out, end - 60 * args.minutes, end,
         rate_window=args.rate_window, note=f"Prometheus at {args.prometheus}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
