"""deploy/grafana: the committed dashboard is what dashboard.py generates, it matches Grafana's
own dashboard types (deploy/grafana/schema.py: @grafana/schema's TypeScript as JSON Schema) and
broken copies do not, and the provisioning files point at it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import needs
from tests.needs import NPM_HINT

# the deploy tooling comes with the dev extras; a GPU machine running `pytest -m gpu` has only
# the runtime dependencies
DEV_EXTRAS = "needs the dev extras: pip install -e '.[dev]'"
pytest.importorskip("grafana_foundation_sdk", reason=DEV_EXTRAS)
from deploy.grafana import dashboard, schema  # noqa: E402

pytestmark = pytest.mark.slow  # installs npm packages on its first run

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"


def committed() -> dict[str, Any]:
    return dict(json.loads((GRAFANA / "specdec.json").read_text()))


def test_the_committed_json_is_a_fresh_generation() -> None:
    fresh = dashboard.render_json()
    assert (GRAFANA / "specdec.json").read_text() == fresh, (
        "deploy/grafana/specdec.json is stale: run "
        "python deploy/grafana/dashboard.py --out deploy/grafana/specdec.json"
    )


def test_the_panels_the_dashboard_promises() -> None:
    board = committed()
    titles = [p["title"] for p in board["panels"] if p["type"] == "timeseries"]
    assert titles == [s.title for _, specs in dashboard.ROWS for s in specs]
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)
    for p in board["panels"]:
        if p["type"] == "timeseries":
            assert p["description"] and p["datasource"]["uid"] == "${datasource}"
            assert all(t["expr"] and t["refId"] for t in p["targets"])
    chosen_k = next(p for p in board["panels"] if p["title"].startswith("Chosen k"))
    assert "num_draft_tokens_total" in chosen_k["targets"][0]["expr"]
    assert "num_drafts_total" in chosen_k["targets"][0]["expr"]
    assert all("step_num_draft_tokens_bucket" in t["expr"] for t in chosen_k["targets"][1:])
    assert len(chosen_k["targets"]) == 4
    faults = {p["title"]: [t["expr"] for t in p["targets"]] for p in board["panels"]
              if p["type"] == "timeseries" and p["gridPos"]["y"] > 0}  # fmt: skip
    fallback = faults["Draft requests at k = 0 by reason"]
    assert fallback == [
        "sum by (model_pair, reason) (rate(specdec:draft_fallback_requests_total"
        '{model_pair=~"$model_pair"}[$__rate_interval]))'
    ]
    restarts = faults["Service restarts and Serve reconnects"]
    assert "specdec:service_restarts_total" in restarts[0] and "role" in restarts[0]
    assert "specdec:serve_reconnects_total" in restarts[1]


@pytest.fixture(scope="module")
def grafana_schemas() -> dict[str, dict[str, Any]]:
    what = "@grafana/schema and ts-json-schema-generator"
    needs.program("npm", f"it installs {what}: {NPM_HINT}")
    with needs.npm_registry(what):
        schemas = schema.schemas()
    return schemas


def test_the_dashboard_matches_grafanas_types(grafana_schemas: dict[str, Any]) -> None:
    assert schema.problems(committed(), grafana_schemas) == []


BREAKS = {  # what breaks the dashboard -> how
    "a number where a string goes": lambda b: b.update(refresh=30),
    "an unknown field": lambda b: b.update(panelz=[]),
    "a required field missing": lambda b: b.pop("schemaVersion"),
    "a panel type that is not a string": lambda b: b["panels"][1].update(type=3),
    "a legend placement Grafana lacks": (
        lambda b: b["panels"][1]["options"]["legend"].update(placement="middle")
    ),
    "an interval variable's field on a query variable": (
        lambda b: b["templating"]["list"][1].update(auto_count=30)
    ),
}


@pytest.mark.parametrize("how", BREAKS)
def test_a_broken_dashboard_fails_the_schema(how: str, grafana_schemas: dict[str, Any]) -> None:
    board = copy.deepcopy(committed())
    BREAKS[how](board)
    assert schema.problems(board, grafana_schemas), how


def test_provisioning_points_at_the_dashboard_and_a_prometheus() -> None:
    provisioning = GRAFANA / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards/dashboards.yaml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file" and provider["options"]["path"]
    (source,) = yaml.safe_load((provisioning / "datasources/datasource.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"]
    variable = committed()["templating"]["list"][0]
    assert variable["type"] == "datasource" and variable["query"] == source["type"]
