"""Admit, Release and GetModelInfo: the same three rpcs on the draft and target services."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grpc

from specdec.pb import common_pb2
from specdec.serving.messages import AdmitRequest


class _StepTimes(Protocol):
    @property
    def forward_s(self) -> float: ...
    @property
    def sampler_s(self) -> float: ...
    @property
    def graphed(self) -> bool: ...


def step_timing(times: _StepTimes, service_s: float) -> common_pb2.StepTiming:
    """A step's StepTiming: its device times and its whole time in the servicer."""
    return common_pb2.StepTiming(
        service_s=service_s,
        forward_s=times.forward_s,
        sampler_s=times.sampler_s,
        graphed=times.graphed,
    )


class _ModelInfo(Protocol):
    def to_pb(self) -> common_pb2.ModelInfo: ...


class LifecycleEngine(Protocol):
    @property
    def info(self) -> _ModelInfo: ...

    def admit(self, admission: AdmitRequest) -> tuple[int, int]: ...

    def release(self, request_ids: Sequence[str]) -> int: ...


class LifecycleServicer:
    """Mixin for a generated servicer whose `engine` admits, releases and describes itself."""

    engine: LifecycleEngine

    def Admit(
        self, request: common_pb2.AdmitRequest, context: grpc.ServicerContext
    ) -> common_pb2.AdmitResponse:
        length, step = self.engine.admit(AdmitRequest.from_pb(request))
        return common_pb2.AdmitResponse(committed_length=length, next_step=step)

    def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(num_released=self.engine.release(request.request_ids))

    def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.engine.info.to_pb()
