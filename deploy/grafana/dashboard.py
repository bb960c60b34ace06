"""The specdec Grafana dashboard, built with grafana-foundation-sdk (its Grafana 11.6 types).

    python deploy/grafana/dashboard.py --out deploy/grafana/specdec.json

writes the JSON that deploy/grafana/provisioning/ provisions; tests/deploy/test_dashboard.py
checks that the committed file equals a fresh generation. Every query reads the metrics that
orchestrator/core/metrics.py defines, filtered by the dashboard's `model_pair` and `proposer`
variables; `$__rate_interval` is Grafana's own (at least four scrape intervals).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

UID = "specdec"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
PAIR = 'model_pair=~"$model_pair"'
SPEC = f'{PAIR}, proposer=~"$proposer"'
WINDOW = "[$__rate_interval]"
BY_PAIR_PROPOSER = "sum by (model_pair, proposer)"
INTERVAL_ONLY = ("auto", "auto_count", "auto_min")


def rate(metric: str, labels: str = PAIR, by: str = "sum by (model_pair)") -> str:
    return f"{by} (rate({metric}{{{labels}}}{WINDOW}))"


def spec_rate(name: str) -> str:
    return rate(f"specdec:spec_decode_{name}_total", SPEC, BY_PAIR_PROPOSER)


def per(denominator: str) -> str:
    """`/ per(x)` divides only where x is above 0: an idle proposer or pair (0 / 0) shows no
    data instead of NaN."""
    return f"({denominator} > 0)"


def by_proposer(expr: str, legend: str = "") -> tuple[tuple[str, str], ...]:
    return ((expr, "{{model_pair}} {{proposer}}" + legend),)


def quantiles(histogram: str) -> tuple[tuple[str, str], ...]:
    buckets = rate(f"specdec:{histogram}_bucket", PAIR, "sum by (model_pair, le)")
    return tuple(
        (f"histogram_quantile({q}, {buckets})", f"{{{{model_pair}}}} p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    )


def mean_per_step(part: str) -> tuple[str, str]:
    metric = f"specdec:step_{part}seconds"
    expr = f"{rate(metric + '_sum')} / {per(rate(metric + '_count'))}"
    return expr, f"{{{{model_pair}}}} {part.rstrip('_') or 'whole step'}"


DRAFT_BUSY = (
    f"{rate('specdec:draft_busy_seconds_total')} / "
    f"{per(f'sum by (model_pair) (specdec:pairs{{{PAIR}}})')}"
)
PER_POSITION = rate(
    "specdec:spec_decode_num_accepted_tokens_per_pos_total",
    SPEC,
    "sum by (model_pair, proposer, position)",
)


@dataclass(frozen=True, slots=True)
class PanelSpec:
    """One time series panel: its queries as (PromQL, legend) pairs."""

    title: str
    description: str
    unit: str
    queries: tuple[tuple[str, str], ...]
    max: float | None = None


SPECULATION = (
    PanelSpec(
        "Acceptance rate",
        "Draft tokens accepted / draft tokens verified, by model pair and proposer.",
        "percentunit",
        by_proposer(f"{spec_rate('num_accepted_tokens')} / {per(spec_rate('num_draft_tokens'))}"),
        max=1,
    ),
    PanelSpec(
        "Mean acceptance length",
        "Tokens a draft step yields: 1 + accepted draft tokens / drafts (the target's own token "
        "included).",
        "none",
        by_proposer(f"1 + {spec_rate('num_accepted_tokens')} / {per(spec_rate('num_drafts'))}"),
    ),
    PanelSpec(
        "Acceptance by draft position",
        "Drafts whose token at position i (from 0) was accepted / drafts: vLLM's per-position "
        "acceptance rate. Falls with the position, since a rejection ends the draft.",
        "percentunit",
        by_proposer(
            f"{PER_POSITION} / on (model_pair, proposer) group_left () "
            f"{per(spec_rate('num_drafts'))}",
            " position {{position}}",
        ),
        max=1,
    ),
    PanelSpec(
        "Chosen k (draft tokens per draft)",
        "The mean k of the steps that drafted, per proposer (draft tokens verified / drafts; "
        "shorter near a request's end), and the k of each step serving draft-model requests "
        "(p50 / p90 / p99 of specdec:step_num_draft_tokens: what --dynamic-speculation "
        "chooses, 0 where it turned speculation off).",
        "none",
        by_proposer(f"{spec_rate('num_draft_tokens')} / {per(spec_rate('num_drafts'))}")
        + quantiles("step_num_draft_tokens"),
    ),
)
REQUESTS = (
    PanelSpec(
        "Generated tokens/s",
        "Rate of generated tokens, counted when a request finishes (from its usage).",
        "short",
        ((rate("specdec:generation_tokens_total"), "{{model_pair}}"),),
    ),
    PanelSpec(
        "Time to first token",
        "Arrival to first token: p50, p90 and p99 from the histogram's buckets.",
        "s",
        quantiles("time_to_first_token_seconds"),
    ),
    PanelSpec(
        "Time per output token",
        "Mean time per token after the first, per request: p50, p90 and p99.",
        "s",
        quantiles("time_per_output_token_seconds"),
    ),
    PanelSpec(
        "Requests running and waiting",
        "Requests admitted to a pair, and requests queued for admission.",
        "short",
        tuple(
            (
                f"sum by (model_pair) (specdec:num_requests_{state}{{{PAIR}}})",
                f"{{{{model_pair}}}} {state}",
            )
            for state in ("running", "waiting")
        ),
    ),
    PanelSpec(
        "Errors by code",
        "Requests ended by an error status, by gRPC status code (refusals included).",
        "reqps",
        (
            (
                rate("specdec:request_errors_total", PAIR, "sum by (model_pair, code)"),
                "{{model_pair}} {{code}}",
            ),
        ),
    ),
    PanelSpec(
        "Finished requests by reason",
        "Requests that finished, by finish reason.",
        "reqps",
        (
            (
                rate("specdec:request_success_total", PAIR, "sum by (model_pair, finish_reason)"),
                "{{model_pair}} {{finish_reason}}",
            ),
        ),
    ),
)
STEPS = (
    PanelSpec(
        "Draft, transport and verify time per step",
        "Mean seconds per hub step: the draft's forward and the Propose round trip less it "
        "(steps that used the draft service), the target's verify forward, the rejection "
        "sampler, and the whole step.",
        "s",
        tuple(mean_per_step(part) for part in ("draft_", "transport_", "verify_", "sampler_", "")),
    ),
    PanelSpec(
        "Draft-ahead hit rate",
        "Draft asks answered from drafts made ahead for their verdict (no forward while the "
        "target waits) / asks that had drafts made ahead; 0 while draft-ahead is off or idle.",
        "percentunit",
        (
            (
                f"{rate('specdec:draft_ahead_hits_total')} / clamp_min("
                f"{rate('specdec:draft_ahead_hits_total')} + "
                f"{rate('specdec:draft_ahead_misses_total')}, 1e-9)",
                "{{model_pair}}",
            ),
        ),
        max=1,
    ),
    PanelSpec(
        "Draft device busy and idle",
        "Fraction of the time a pair's draft device was busy, averaged over the pairs: its "
        "proposal forwards plus its passes ahead (draft-ahead; admissions not counted), and 1 "
        "minus that, the time it waited.",
        "percentunit",
        (
            (DRAFT_BUSY, "{{model_pair}} busy"),
            (f"1 - {DRAFT_BUSY}", "{{model_pair}} idle"),
        ),
        max=1,
    ),
)
FAULTS = (
    PanelSpec(
        "Draft requests at k = 0 by reason",
        "Draft requests that decoded target-only for a step because of the draft service, per "
        "second: deadline (it did not answer a step within --draft-deadline-ms and has not "
        "since; the hub resynchronises it once it answers) or unavailable (it is down until "
        "Ray restarts it). Output is unchanged; only speculation pauses.",
        "reqps",
        (
            (
                rate("specdec:draft_fallback_requests_total", PAIR, "sum by (model_pair, reason)"),
                "{{model_pair}} {{reason}}",
            ),
        ),
    ),
    PanelSpec(
        "Service restarts and Serve reconnects",
        "Draft and target services back at a new address after Ray restarted them, by role, "
        "and Serve streams to a target opened again after breaking, as increases over the "
        "interval.",
        "short",
        (
            (
                f"sum by (model_pair, role) (increase(specdec:service_restarts_total{{{PAIR}}}"
                f"{WINDOW}))",
                "{{model_pair}} {{role}} restarts",
            ),
            (
                f"sum by (model_pair) (increase(specdec:serve_reconnects_total{{{PAIR}}}{WINDOW}))",
                "{{model_pair}} Serve reconnects",
            ),
        ),
    ),
)
ROWS = (
    ("Speculative decoding", SPECULATION),
    ("Requests", REQUESTS),
    ("Steps", STEPS),
    ("Faults", FAULTS),
)


def panel(spec: PanelSpec, x: int, y: int) -> timeseries.Panel:
    legend = (
        common.VizLegendOptions()
        .display_mode(common_models.LegendDisplayMode.LIST)
        .placement(common_models.LegendPlacement.BOTTOM)
        .show_legend(True)
    )
    built = (
        timeseries.Panel()
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .min(0)
        .legend(legend)
        .grid_pos(GridPos(h=8, w=12, x=x, y=y))
    )
    if spec.max is not None:
        built = built.max(spec.max)
    for i, (expr, legend_format) in enumerate(spec.queries):
        built = built.with_target(
            prometheus.Dataquery()
            .datasource(DATASOURCE)
            .expr(expr)
            .legend_format(legend_format)
            .range()
            .ref_id(chr(ord("A") + i))
        )
    return built


def label_variable(name: str, metric: str) -> dashboard.QueryVariable:
    return (
        dashboard.QueryVariable(name)
        .label(name)
        .datasource(DATASOURCE)
        .query(f"label_values({metric}, {name})")
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dashboard_models.VariableOption(selected=True, text="All", value="$__all"))
    )


def build() -> dict[str, object]:
    """The dashboard as the JSON object Grafana reads."""
    board = (
        dashboard.Dashboard("specdec")
        .uid(UID)
        .description("Speculative decoding served by specdec: acceptance, latency, steps.")
        .tags(["specdec"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
        .with_variable(label_variable("model_pair", "specdec:steps_total"))
        .with_variable(label_variable("proposer", "specdec:spec_decode_num_drafts_total"))
    )
    y, panel_id = 0, 0
    for title, specs in ROWS:
        panel_id += 1
        row = dashboard.Row(title).id(panel_id).grid_pos(GridPos(h=1, w=24, x=0, y=y))
        board = board.with_row(row)
        y += 1
        for i, spec in enumerate(specs):
            panel_id += 1
            board = board.with_panel(panel(spec, x=12 * (i % 2), y=y + 8 * (i // 2)).id(panel_id))
        y += 8 * ((len(specs) + 1) // 2)
    built = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))
    # The SDK writes an interval variable's fields on every variable; Grafana's schema
    # (@grafana/schema VariableModel) has no such fields, and the schema test rejects them.
    for variable in built["templating"]["list"]:
        if variable["type"] != "interval":
            for key in INTERVAL_ONLY:
                variable.pop(key, None)
    return dict(built)


def render_json() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args()
    args.out.write_text(render_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
