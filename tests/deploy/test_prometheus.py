"""deploy/prometheus and the Grafana dashboard's queries against a real Prometheus scraping a
real `specdec serve`.

First the files alone: `promtool check config` and `check rules`, the alerts' unit tests
(`promtool test rules rules_test.yml`, which must fail once a threshold is edited), and
monitor.yaml: its PrometheusRule carries rules.yml's groups, its ServiceMonitor selects the
`specdec-metrics` Service of deploy/k8s by its labels and port name, and both validate against
the Prometheus Operator's types (@kubernetes-models/prometheus-operator, installed with npm).

Then live: the demo's CI pair (orchestrator.demo.models, cached) served on CPU by the
orchestrator in this process (a local Ray cluster, real ports), and Debian's `prometheus` on a
free loopback port with prometheus.yml's scrape job pointed at the serve's /metrics (1 s
scrapes and rule evaluations) and rules.yml loaded. Greedy requests go through specdec.client
with the draft proposer at two k, the n-gram proposer and speculation off, plus one refused
request. Then the metrics keep their `specdec:` names, every PromQL expression of
specdec.json and rules.yml returns data, the alerts' states agree with the data, and the
acceptance rate Prometheus reports equals the one the responses' usage gives: exactly from the
counters' totals, and to rounding from the recording rules.

SPECDEC_DASHBOARD_PNG=docs/dashboard.png runs a longer load and draws that picture with
deploy/grafana/render.py from this Prometheus.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.grafana import render
from deploy.grafana.schema import npm_install
from tests import needs
from tests.needs import NPM_HINT

pytestmark = pytest.mark.slow  # a real Prometheus and a live serve: about a minute

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
SERVICES = ROOT / "deploy" / "k8s" / "base" / "services.yaml"
K = 4  # the served default number of draft tokens per step
# edits that make each alert's condition true on a healthy run: the labels its `and on (...)`
# joins must then still match, so the expression returns data
ALERT_FIRING_EDITS = {
    "SpecdecAcceptanceCollapsed": ("< 0.3", "< 2"),
    "SpecdecSpeculationOff": ("== 0", ">= 0"),
}
INSTALL_HINT = {
    name: "Debian's prometheus package ships prometheus and promtool: `sudo apt-get install "
    "prometheus` (scripts/test.sh installs it when run as root)"
    for name in ("prometheus", "promtool")
} | {"node": "Node.js: `sudo apt-get install nodejs npm`"}


def tool(name: str) -> str:
    return needs.program(name, INSTALL_HINT[name])


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True)


# --- the files alone ---


def test_promtool_accepts_the_config_and_rules() -> None:
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "rules.yml")):
        done = promtool(*args)
        assert done.returncode == 0, done.stdout + done.stderr
    done = promtool("check", "rules", "monitor.yaml")  # not a rule file: promtool must say so
    assert done.returncode != 0


def test_alert_unit_tests_pass_and_fail_on_an_edited_threshold(tmp_path: Path) -> None:
    done = promtool("test", "rules", "rules_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    rules = (PROM / "rules.yml").read_text()
    assert rules.count("< 0.3") == 1
    (tmp_path / "rules.yml").write_text(rules.replace("< 0.3", "< 0.2"))
    shutil.copy(PROM / "rules_test.yml", tmp_path)
    done = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert done.returncode != 0 and "SpecdecAcceptanceCollapsed" in done.stdout + done.stderr


GUARDED = {  # each recording rule's denominator, divided by only where above 0
    "specdec:spec_decode_acceptance_rate:rate5m": "specdec:spec_decode_num_draft_tokens:rate5m",
    "specdec:spec_decode_mean_acceptance_length:rate5m": "specdec:spec_decode_num_drafts:rate5m",
    "specdec:spec_decode_acceptance_per_pos:rate5m": "specdec:spec_decode_num_drafts:rate5m",
}


@pytest.mark.parametrize("record", GUARDED)
def test_an_idle_pair_has_no_acceptance_series_rather_than_nan(tmp_path: Path, record: str) -> None:
    """The unit tests expect no acceptance series for the pair that steps without drafting; a
    rule without its guard would record NaN (0 / 0) there, and they fail."""
    groups = yaml.safe_load((PROM / "rules.yml").read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r.get("record") == record]
    guarded = f"({GUARDED[record]} > 0)"
    assert rule["expr"].count(guarded) == 1
    rule["expr"] = rule["expr"].replace(guarded, GUARDED[record])
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(PROM / "rules_test.yml", tmp_path)
    done = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert done.returncode != 0 and "NaN" in done.stdout + done.stderr, done.stdout


def monitor_objects() -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in yaml.safe_load_all((PROM / "monitor.yaml").read_text())}


def test_monitor_carries_the_rules_and_selects_the_metrics_service() -> None:
    objs = monitor_objects()
    assert set(objs) == {"ServiceMonitor", "PrometheusRule"}
    rules = yaml.safe_load((PROM / "rules.yml").read_text())
    assert objs["PrometheusRule"]["spec"] == rules, "monitor.yaml's groups differ from rules.yml"

    service = next(
        s for s in yaml.safe_load_all(SERVICES.read_text())
        if s["metadata"]["name"] == "specdec-metrics"
    )  # fmt: skip
    monitor = objs["ServiceMonitor"]["spec"]
    wanted = monitor["selector"]["matchLabels"]
    assert wanted.items() <= service["metadata"]["labels"].items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"] and ports["metrics"] == 9464
    assert (
        service["metadata"]["annotations"]["prometheus.io/path"] == monitor["endpoints"][0]["path"]
    )
    # the overlays deploy into `specdec`, where both objects live and the monitor looks
    assert monitor["namespaceSelector"]["matchNames"] == ["specdec"]
    assert {o["metadata"]["namespace"] for o in objs.values()} == {"specdec"}


OPERATOR_TYPES = "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1"
VALIDATE_JS = f"""
import {{ readFileSync }} from "node:fs";
import {{ ServiceMonitor }} from "{OPERATOR_TYPES}/ServiceMonitor";
import {{ PrometheusRule }} from "{OPERATOR_TYPES}/PrometheusRule";
const kinds = {{ ServiceMonitor, PrometheusRule }};
for (const obj of JSON.parse(readFileSync(0, "utf8"))) {{
  try {{ new kinds[obj.kind](obj).validate(); console.log("ok"); }}
  catch (e) {{ console.log("invalid " + obj.kind + ": " + e.message.replace(/\\n/g, " ")); }}
}}
"""


def test_monitor_validates_against_the_operator_types() -> None:
    needs.program("npm", "it installs @kubernetes-models/prometheus-operator: " + NPM_HINT)
    with needs.npm_registry("@kubernetes-models/prometheus-operator"):
        folder = npm_install("@kubernetes-models/prometheus-operator@6.0.0")
    objs = list(monitor_objects().values())
    broken = copy.deepcopy(objs)
    broken[0]["spec"]["endpoints"][0]["port"] = 9464  # a number where a port name goes
    broken[1]["spec"]["groups"][0]["rules"][0].pop("expr")  # a rule without its expression
    script = folder / "validate_monitor.mjs"
    script.write_text(VALIDATE_JS)
    done = subprocess.run(
        [tool("node"), str(script)], input=json.dumps(objs + broken), cwd=folder,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 4, done.stdout + done.stderr
    assert lines[:2] == ["ok", "ok"], lines
    assert lines[2].startswith("invalid ServiceMonitor") and "port" in lines[2], lines
    assert lines[3].startswith("invalid PrometheusRule") and "expr" in lines[3], lines


# --- live: a real serve scraped by a real Prometheus ---


@dataclass(frozen=True, slots=True)
class Phase:
    """Requests sent together: `count` of them, `parallel` at a time."""

    proposer: str
    k: int | None
    count: int
    parallel: int
    max_tokens: int = 24  # the CI pair holds 64 positions; the longest prompt is 36 tokens


SHORT_LOAD = (Phase("draft", K, 6, 4), Phase("draft", 2, 3, 3), Phase("ngram", K, 2, 2),
              Phase("off", None, 2, 2))  # fmt: skip


@dataclass
class Live:
    prometheus: str  # base URL
    usages: list[Any]  # specdec.client.Usage of every response
    started: float  # the first scrape before any request
    ended: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(url: str, expr: str) -> list[dict[str, Any]]:
    return list(render.api(url, "/api/v1/query", query=expr)["result"])


def value(url: str, expr: str) -> float | None:
    result = query(url, expr)
    return float(result[0]["value"][1]) if result else None


def wait_for(what: str, check: Any, timeout: float = 60.0, detail: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{detail() if detail else ''}")


def prometheus_config(tmp: Path, target: str) -> Path:
    """prometheus.yml with its target, intervals and rule file changed for this run."""
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROM / "rules.yml")]
    (job,) = config["scrape_configs"]
    job["static_configs"][0]["targets"] = [target]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    done = promtool("check", "config", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    return path


@pytest.fixture(scope="module")
def prometheus_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """start(target) runs Prometheus scraping `target`; stopped at the module's end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        tmp = tmp_path_factory.mktemp("prometheus")
        port = free_port()
        config = prometheus_config(tmp, target)
        with (tmp / "prometheus.log").open("wb") as log:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    [tool("prometheus"), f"--config.file={config}",
                     f"--storage.tsdb.path={tmp / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}"],
                    stdout=log, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                assert procs[-1].poll() is None, (tmp / "prometheus.log").read_text()
                return False

        wait_for("Prometheus to be ready", ready)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def send(address: str, phases: tuple[Phase, ...]) -> list[Any]:
    """Runs each phase's greedy requests; returns their usages."""
    from orchestrator.demo.run import PROMPTS
    from specdec.client import Client

    usages = []
    with Client(address, timeout=300.0) as client:
        for phase in phases:

            def one(i: int, phase: Phase = phase) -> Any:
                out = client.complete(
                    PROMPTS[i % len(PROMPTS)], max_tokens=phase.max_tokens, temperature=0.0,
                    proposer=phase.proposer, num_draft_tokens=phase.k,
                )  # fmt: skip
                return out.usage

            with ThreadPoolExecutor(phase.parallel) as pool:
                usages += list(pool.map(one, range(phase.count)))
    return usages


def refused_request(address: str) -> None:
    """One request the server refuses (k above its maximum): an error by code."""
    from specdec.client import Client, SpecdecClientError

    with Client(address, timeout=60.0) as client, pytest.raises(SpecdecClientError) as refused:
        client.complete("def f():", max_tokens=4, num_draft_tokens=99)
    assert refused.value.code.name == "INVALID_ARGUMENT"


@pytest.fixture(scope="module")
def live(prometheus_factory: Any) -> Iterator[Live]:
    from orchestrator.demo.models import DemoBudget, build_demo_models
    from orchestrator.demo.run import serve_config
    from orchestrator.server import Orchestrator

    pair = build_demo_models(budget=DemoBudget.ci(), progress=False)  # cached after one build
    orchestrator = Orchestrator(serve_config(pair, K))
    try:
        address = f"127.0.0.1:{orchestrator.start()}"
        url = prometheus_factory(f"127.0.0.1:{orchestrator.metrics_port}")
        wait_for("a first scrape", lambda: query(url, "specdec:spec_decode_num_drafts_total"))
        started = time.time()
        assert value(url, "sum(specdec:spec_decode_num_drafts_total)") == 0
        picture = os.environ.get("SPECDEC_DASHBOARD_PNG")
        usages = long_load(address) if picture else send(address, SHORT_LOAD)
        refused_request(address)
        totals = usage_totals(usages)
        expr = "sum(specdec:spec_decode_num_draft_tokens_total)"
        wait_for(
            "the last counts to be scraped", lambda: value(url, expr) == totals[1], 30,
            lambda: f": Prometheus has {value(url, expr)} draft tokens, the responses {totals}",
        )  # fmt: skip
        wait_for("an error to be scraped", lambda: query(url, "specdec:request_errors_total"))
        time.sleep(3)  # a few rule evaluations after that scrape
        run = Live(url, usages, started, time.time())
        if picture:
            draw_picture(run, Path(picture))
        yield run
    finally:
        orchestrator.stop(1.0)


def long_load(address: str) -> list[Any]:
    """About four minutes of changing load, for the picture."""
    usages = []
    for round_ in range(6):
        usages += send(address, (Phase("draft", K, 8, 4), Phase("draft", 2, 4, 2)))
        usages += send(address, (Phase("ngram", K, 3, 2), Phase("off", None, 3, 3)))
        if round_ == 3:
            refused_request(address)
        time.sleep(10)
    return usages


def draw_picture(run: Live, out: Path) -> None:
    n = len(run.usages)
    note = (
        f"Prometheus 2.42 (1 s scrapes) on `specdec serve` with the demo's CI pair on 2 CPU "
        f"cores (kernels under Triton's interpreter); {n} greedy requests (draft k={K} and "
        "k=2, ngram, off, two refused); rate window 30 s"
    )
    assert render.draw(run.prometheus, out, run.started - 10, run.ended, note=note) > 0


def usage_totals(usages: list[Any], proposer: str | None = None) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) summed over the responses."""
    picked = [u for u in usages if proposer is None or u.proposer == proposer]
    return (
        sum(u.num_drafts for u in picked),
        sum(u.num_draft_tokens for u in picked),
        sum(u.num_accepted_tokens for u in picked),
    )


def test_the_reported_acceptance_rate_is_the_responses(live: Live) -> None:
    drafts, draft_tokens, accepted = usage_totals(live.usages)
    assert drafts > 20 and 0 < accepted < draft_tokens
    expected = accepted / draft_tokens
    totals = (
        "sum(specdec:spec_decode_num_accepted_tokens_total)"
        " / sum(specdec:spec_decode_num_draft_tokens_total)"
    )
    assert value(live.prometheus, totals) == expected  # exactly: the same two integers
    assert (accepted - 1) / draft_tokens != expected
    recorded = "sum(specdec:spec_decode_num_accepted_tokens:rate5m)" + (
        " / sum(specdec:spec_decode_num_draft_tokens:rate5m)"
    )
    assert value(live.prometheus, recorded) == pytest.approx(expected, rel=1e-9)
    for proposer in ("draft", "ngram"):
        drafts, draft_tokens, accepted = usage_totals(live.usages, proposer)
        rule = f'specdec:spec_decode_acceptance_rate:rate5m{{proposer="{proposer}"}}'
        assert value(live.prometheus, rule) == pytest.approx(accepted / draft_tokens, rel=1e-9)
        rule = f'specdec:spec_decode_mean_acceptance_length:rate5m{{proposer="{proposer}"}}'
        assert value(live.prometheus, rule) == pytest.approx(1 + accepted / drafts, rel=1e-9)


def test_the_metrics_keep_their_names(live: Live) -> None:
    """Prometheus 2.x asks for OpenMetrics, in which prometheus_client would escape `specdec:`
    to `specdec_`; the orchestrator answers the text format, so the names keep their colon."""
    names = render.api(live.prometheus, "/api/v1/label/__name__/values")
    assert "specdec:spec_decode_num_drafts_total" in names
    assert not [n for n in names if n.startswith("specdec_")]


def has_a_number(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def nan_series(result: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [s["metric"] for s in result if math.isnan(float(s["value"][1]))]


def test_every_dashboard_query_returns_data(live: Live) -> None:
    dashboard = json.loads(render.DASHBOARD.read_text())
    queries = [q for p in render.panels(dashboard) for q in p.queries]
    assert len(queries) >= 15
    results = {q.expr: query(live.prometheus, render.substitute(q.expr, "5m")) for q in queries}
    empty = [expr for expr, result in results.items() if not has_a_number(result)]
    assert not empty, f"no data for {empty}"
    nan = {expr: nan_series(result) for expr, result in results.items() if nan_series(result)}
    assert not nan, f"NaN series (an idle proposer or pair divided by 0): {nan}"
    # "off" never drafts: the panels that divide by its drafts show no data for it
    off = {"proposer": "off"}
    for panel in render.panels(dashboard):
        for q in panel.queries:
            if "num_drafts_total" in q.expr or "num_draft_tokens_total" in q.expr:
                result = query(live.prometheus, render.substitute(q.expr, "5m", off))
                assert result == [], (panel.title, result)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(metric, label)
            metric, label = variable["query"].removeprefix("label_values(")[:-1].split(", ")
            path = f"/api/v1/label/{label}/values"
            found = render.api(live.prometheus, path, **{"match[]": metric})
            assert found, variable["query"]


def test_every_rule_returns_data_and_the_alerts_agree_with_it(live: Live) -> None:
    groups = yaml.safe_load((PROM / "rules.yml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    for rule in rules:
        if "record" in rule:
            assert has_a_number(query(live.prometheus, rule["expr"])), rule["expr"]
            recorded = query(live.prometheus, rule["record"])
            assert has_a_number(recorded), rule["record"]
            assert not nan_series(recorded), (rule["record"], nan_series(recorded))
            if "acceptance" in rule["record"]:  # "off" never drafts: no series, not 0 / 0
                assert {s["metric"]["proposer"] for s in recorded} == {"draft", "ngram"}
        else:
            old, new = ALERT_FIRING_EDITS[rule["alert"]]
            assert rule["expr"].count(old) == 1
            assert query(live.prometheus, rule["expr"].replace(old, new)), rule["alert"]
    loaded = render.api(live.prometheus, "/api/v1/rules")["groups"]
    states = {r["name"]: r for g in loaded for r in g["rules"]}
    assert len(states) == len(rules) and all(r["health"] == "ok" for r in states.values())
    # drafts were made: speculation was not off; the collapse alert is pending exactly for
    # the proposers whose acceptance is below its threshold
    assert states["SpecdecSpeculationOff"]["state"] == "inactive"
    low = {
        s["metric"]["proposer"]
        for s in query(live.prometheus, "specdec:spec_decode_acceptance_rate:rate5m < 0.3")
    }
    pending = {a["labels"]["proposer"] for a in states["SpecdecAcceptanceCollapsed"]["alerts"]}
    assert pending == low
