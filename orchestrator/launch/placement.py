"""The services as Ray actors: each pair's draft and target on separate GPUs.

Each pair gets one placement group. With at least two GPUs per pair its two bundles hold one GPU
each, so draft and target never share one; with one GPU per pair both actors take half of the
same GPU; with none they run on CPU. Bundles are packed onto one node where they fit, so the
draft → target hop stays on the node.

Node types. `--draft-resources` / `--target-resources` add custom Ray resources to the draft's
and the target's bundle (to the one bundle both share, summed, when they share a GPU), so drafts
can go to one kind of node (a small GPU) and targets to another: only nodes started with those
resources (`ray start --resources=...`, a KubeRay worker group's `resources`) can hold them.
When no node offers both, the pair's bundles cannot share a node. The group's strategy stays
PACK, which Ray documents as best-effort: bundles go onto one node where one fits them all, and
are spread over other nodes when none does (STRICT_PACK would instead leave the group pending
forever; SPREAD would split pairs that could share a node). The draft → target hop then crosses
the network on every step. A resource no node offers yet is logged; the group waits for one (an
autoscaler may add it) until `start_timeout_s`.

An actor starts its service's gRPC server in its own process (the service modules, and torch,
are imported there, never in the orchestrator) and reports `node_ip:port` and the service's
ModelInfo. All services of all pairs load at once; the orchestrator then checks each pair's
tokenizers and hands the hub its draft's address. Actors restart without limit: when a draft
dies, Ray starts a new one, whose new address `wait_draft` returns, and the orchestrator hands
that to the hub the same way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import PlacementConfig, ServiceConfig
from orchestrator.launch.ray_start import start_local_cluster
from specdec.serving.messages import ModelInfo, check_compatible

log = logging.getLogger(__name__)
RETRY_S = 0.5


class ServiceStartError(RuntimeError):
    """A service that did not start: args (its error in one line, its traceback)."""

    def __str__(self) -> str:
        return str(self.args[0])


class ServiceActor:
    """One service (role "target" or "draft") serving from this actor's process.

    A service that fails to start is not an error of the actor's creation: Ray prints such an
    error with its traceback (38 lines) from the actor's process, whatever the log level. It
    is kept instead, and `info` raises it, for the orchestrator to log in one line (the
    traceback at DEBUG).
    """

    def __init__(self, role: str, config: ServiceConfig):
        from orchestrator.launch.services import start_service  # torch lives in the actor only

        self._failure: ServiceStartError | None = None
        host = ray.util.get_node_ip_address()
        try:
            self._server, self._info = start_service(role, config, host)
        except Exception as e:
            self._failure = ServiceStartError(f"{type(e).__name__}: {e}", traceback.format_exc())
            return
        self._address = f"{host}:{self._server.port}"

    def info(self) -> tuple[str, ModelInfo]:
        if self._failure is not None:
            raise self._failure
        return self._address, self._info

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor (its CUDA_VISIBLE_DEVICES)."""
        return [str(i) for i in ray.get_gpu_ids()]

    def pid(self) -> int:
        """This actor's process id (fault tests signal it)."""
        return os.getpid()

    def stop(self, grace_s: float) -> None:
        if self._failure is None:
            self._server.stop(grace_s)


@dataclass(slots=True)
class PairPlacement:
    """One pair's actors, addresses and model infos (`draft*` None without a draft model)."""

    index: int
    group: PlacementGroup
    target: Any
    target_address: str
    target_info: ModelInfo
    draft: Any | None = None
    draft_address: str | None = None
    draft_info: ModelInfo | None = None


def ray_logging_level() -> int:
    """Ray's own loggers' level: WARNING while this program logs at INFO, since Ray's INFO
    lines read as errors on a clean start ("Failed to get node info ... Deadline Exceeded"
    while its raylet registers, before a retry that succeeds); the same as this program's
    otherwise. Its notice that token authentication is on (a default, nothing to act on) shows
    at DEBUG only."""
    level = logging.getLogger().getEffectiveLevel()
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    notice.setLevel(logging.NOTSET if level <= logging.DEBUG else logging.ERROR)
    return logging.WARNING if level == logging.INFO else level


def connect(config: PlacementConfig, services_per_pair: int) -> bool:
    """Joins `config.address` (or RAY_ADDRESS), else starts a local cluster; returns whether
    this process started the cluster (and should shut it down)."""
    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS")
    level = ray_logging_level()
    if address:
        ray.init(address=address, log_to_driver=True, logging_level=level)
        return False
    # logical CPUs: one per service even on a small machine (the services mostly wait)
    num_cpus = config.num_cpus or max(os.cpu_count() or 1, services_per_pair * config.pairs)
    start_local_cluster(
        ray.init, ray.shutdown, config.ray_start_timeout_s,
        num_cpus=num_cpus, num_gpus=config.num_gpus, include_dashboard=False,
        logging_level=level,
    )  # fmt: skip
    return True


def gpus_per_pair(
    total_gpus: float, pairs: int, services_per_pair: int, device: str, target_gpus: int = 1
) -> int:
    """GPUs each pair's bundles hold: `target_gpus` for the target (its tensor-parallel ranks)
    and one for the draft where there are enough, else one for both (a target on one GPU
    only), else none (CPU)."""
    if device == "cpu":
        return 0
    if total_gpus < 1:
        if device == "cuda":
            raise ValueError("device 'cuda' needs a GPU, and the Ray cluster has none.")
        return 0
    split = target_gpus + services_per_pair - 1
    if total_gpus >= split * pairs:
        return split
    if target_gpus > 1:
        draft = ", and one for the draft" if services_per_pair == 2 else ""
        raise ValueError(
            f"--target-tensor-parallel {target_gpus} needs {split} GPUs per pair ({target_gpus} "
            f"for the target's ranks{draft}): {pairs} pair(s) need {split * pairs}, and the Ray "
            f"cluster has {total_gpus:g}."
        )
    if total_gpus >= pairs:
        return 1
    raise ValueError(
        f"pairs={pairs} need at least {pairs} GPUs ({services_per_pair * pairs} for one per "
        f"service); the Ray cluster has {total_gpus:g}. Lower --pairs or pass --device cpu."
    )


def _bundles(
    gpus: int, custom: Sequence[Mapping[str, float]], target_gpus: int = 1
) -> tuple[list[dict[str, float]], list[int], list[float]]:
    """The group's bundles, each service's bundle index, and each service's GPUs (a share of
    one where they share it); `custom[i]` holds the custom resources of service i (target,
    then draft). A target of `target_gpus` > 1 has a bundle of that many GPUs, which Ray
    places on one node."""
    services = len(custom)
    if gpus == 1 and target_gpus == 1:
        shared: dict[str, float] = {"CPU": services, "GPU": 1}
        for resources in custom:
            for name, amount in resources.items():
                shared[name] = shared.get(name, 0) + amount
        return [shared], [0] * services, [1.0 / services] * services
    own = [float(target_gpus), *[1.0] * (services - 1)] if gpus else [0.0] * services
    bundles = [{"CPU": 1, "GPU": n} if n else {"CPU": 1} for n in own]
    return [b | dict(r) for b, r in zip(bundles, custom, strict=True)], list(range(services)), own


def _failure(e: ServiceStartError, role: str, pair: int) -> str:
    """The one line of a service's failed start; its traceback is logged at DEBUG."""
    own = e.cause if isinstance(e, RayTaskError) else e  # Ray raises it wrapped
    log.debug("the %s service of pair %d failed to start:\n%s", role, pair, own.args[1])
    return str(own)


def _started(actor: Any, role: str, pair: int, timeout_s: float) -> tuple[str, ModelInfo]:
    """The actor's address and info once its service is warm; a failed start is a
    RuntimeError that ends with the service's own error."""
    try:
        address, info = ray.get(actor.info.remote(), timeout=timeout_s)
    except ServiceStartError as e:
        raise RuntimeError(
            f"The {role} service of pair {pair} failed to start: {_failure(e, role, pair)}"
        ) from None
    except RayActorError as e:  # its process died
        log.debug("the %s service of pair %d: %s", role, pair, e)
        cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"The {role} service of pair {pair} failed to start: {cause}") from e
    except GetTimeoutError as e:
        raise RuntimeError(
            f"The {role} service of pair {pair} was not up within {timeout_s:g} s."
        ) from e
    return address, info


class Placement:
    """Starts, watches and stops every pair's actors."""

    def __init__(
        self, config: PlacementConfig, services: ServiceConfig, actor_class: type = ServiceActor
    ):
        self.config = config
        self.services = services
        self.actor_class = actor_class  # ServiceActor's interface; tests place stand-ins
        self.pairs: list[PairPlacement] = []
        self._groups: list[PlacementGroup] = []
        self._actors: list[Any] = []
        # set when the orchestrator begins its stop: a service that died is not waited for
        self.stopping = threading.Event()

    @property
    def services_per_pair(self) -> int:
        return 2 if self.services.draft is not None else 1

    def start(self) -> list[PairPlacement]:
        """Places and starts every pair; refuses a draft whose tokenizer differs."""
        n = self.services_per_pair
        total = ray.cluster_resources().get("GPU", 0.0)
        tp = self.services.target_tensor_parallel
        gpus = gpus_per_pair(total, self.config.pairs, n, self.services.device, tp)
        custom = [self.config.target_resources, self.config.draft_resources][:n]
        bundles, index, shares = _bundles(gpus, custom, tp)
        log.info("placing %d pair(s): %d GPU(s) per pair (cluster: %g), bundles %s",
                 self.config.pairs, gpus, total, bundles)  # fmt: skip
        missing = sorted({k for r in custom for k in r} - set(ray.cluster_resources()))
        if missing:
            log.warning("no node offers %s yet: the pairs wait for one up to %g s", missing,
                        self.config.start_timeout_s)  # fmt: skip
        groups = [placement_group(bundles, strategy="PACK") for _ in range(self.config.pairs)]
        self._groups = groups
        try:
            try:
                ray.get([g.ready() for g in groups], timeout=self.config.start_timeout_s)
            except GetTimeoutError as e:
                raise RuntimeError(
                    f"Ray could not reserve {bundles} for each of {self.config.pairs} pair(s) "
                    f"within {self.config.start_timeout_s:g} s; cluster resources: "
                    f"{ray.cluster_resources()}."
                ) from e
            self._start_actors(groups, index, shares)
        except BaseException:
            self.stop(0.0)
            raise
        return self.pairs

    def _actor(self, group: PlacementGroup, bundle: int, share: float, *args: Any) -> Any:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        cpus = share if 0.0 < share < 1.0 else 1.0  # a GPU's share: as much of a CPU
        cls: Any = ray.remote(self.actor_class)
        actor = cls.options(
            num_cpus=cpus, num_gpus=share, max_restarts=-1, scheduling_strategy=strategy
        ).remote(*args)
        self._actors.append(actor)
        return actor

    def _start_actors(
        self, groups: list[PlacementGroup], index: list[int], shares: list[float]
    ) -> None:
        """Starts every service at once (loading in parallel), then checks each pair's
        tokenizers; the hub is given its draft afterwards (`PairClient.set_draft`)."""
        roles = ["target", "draft"][: self.services_per_pair]
        actors = [
            [self._actor(g, index[j], gpus, role, self.services)
             for j, (role, gpus) in enumerate(zip(roles, shares, strict=True))]
            for g in groups
        ]  # fmt: skip
        for i, group in enumerate(groups):
            infos = [_started(a, role, i, self.config.start_timeout_s)
                     for a, role in zip(actors[i], roles, strict=True)]  # fmt: skip
            pair = PairPlacement(i, group, actors[i][0], *infos[0])
            self.pairs.append(pair)
            log.info("pair %d: target at %s, draft at %s", i, infos[0][0],
                     infos[1][0] if len(infos) == 2 else None)  # fmt: skip
            if len(infos) == 2:
                pair.draft, (pair.draft_address, pair.draft_info) = actors[i][1], infos[1]
                try:
                    check_compatible(pair.target_info, infos[1][1])
                except ValueError as e:
                    raise ValueError(
                        f"Refusing the draft {self.services.draft!r} for the target "
                        f"{self.services.target!r}: {e}"
                    ) from e

    def wait_draft(self, pair: PairPlacement) -> tuple[str, ModelInfo]:
        """The (restarted) draft's address and info, once it answers."""
        assert pair.draft is not None
        pair.draft_address, pair.draft_info = self._wait(pair.draft, "draft", pair.index)
        return pair.draft_address, pair.draft_info

    def wait_target(self, pair: PairPlacement) -> tuple[str, ModelInfo]:
        """The (restarted) target's address and info, once it answers."""
        pair.target_address, pair.target_info = self._wait(pair.target, "target", pair.index)
        return pair.target_address, pair.target_info

    def _wait(self, actor: Any, role: str, index: int) -> tuple[str, ModelInfo]:
        """Asks `actor` until it answers; RuntimeError after `restart_timeout_s`, once the stop
        has begun, or once Ray is no longer initialised. Without that last check, a call
        after a SIGTERM to every process of a systemd unit (Ray's GCS and raylet stopped under
        this process) started a new local Ray cluster from this thread (Ray's auto-init), and
        Ray's core worker then aborted the process."""
        timeout = self.config.restart_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"pair {index}'s {role} did not come back within {timeout:g} s.")
            if self.stopping.is_set():
                raise RuntimeError(f"pair {index}'s {role} is not waited for: serve is stopping.")
            if not ray.is_initialized():
                raise RuntimeError(f"pair {index}'s {role} cannot come back: Ray has stopped.")
            try:
                address, info = ray.get(actor.info.remote(), timeout=remaining)
            except ServiceStartError as e:
                raise RuntimeError(
                    f"pair {index}'s {role} failed to start again: {_failure(e, role, index)}"
                ) from None
            except (RayActorError, GetTimeoutError) as e:
                log.info("pair %d: %s not back yet (%s)", index, role, type(e).__name__)
                self.stopping.wait(RETRY_S)
                continue
            return address, info

    def stop(self, grace_s: float) -> None:
        """Stops every service (grace for in-flight calls), then frees actors and groups."""
        self.stopping.set()
        actors, self._actors = self._actors, []
        if not actors and not self._groups:
            return  # nothing placed (ray.get would start a cluster just to return)
        if not ray.is_initialized():  # Ray is gone, and its actors with it: a call would start
            self._groups, self.pairs = [], []  # a new cluster (Ray's auto-init) to no purpose
            return
        try:
            ray.get([a.stop.remote(grace_s) for a in actors], timeout=grace_s + 10.0)
        except Exception as e:  # a dead or never started actor has nothing left to stop
            log.info("stopping services: %s", type(e).__name__)
            log.debug("stopping services: %s", e)
        for a in actors:
            ray.kill(a, no_restart=True)
        for g in self._groups:
            remove_placement_group(g)
        self._groups, self.pairs = [], []
