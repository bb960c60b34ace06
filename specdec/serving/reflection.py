"""gRPC server reflection under both of its names: `grpc.reflection.v1`, which grpcurl and
current reflection clients ask first, and `grpc.reflection.v1alpha`, which older ones ask.

grpcio-reflection (1.85) implements v1alpha alone. v1's reflection.proto is v1alpha's under
another package, message for message and field for field, so the bytes on the wire are the same
and v1alpha's servicer answers v1 calls as they are: it is registered a second time under v1's
service name, and v1's file (v1alpha's, renamed) is added to the descriptor pool so that a
client can describe the v1 service too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA, _V1 = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."


def _v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """Adds v1's reflection.proto to `pool`, made from v1alpha's (once per pool)."""
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()  # v1alpha's Java and Go package names, and its deprecation
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message field's
                field.type_name = field.type_name.replace(_V1ALPHA, _V1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(_V1ALPHA, _V1)
            method.output_type = method.output_type.replace(_V1ALPHA, _V1)
    pool.Add(proto)


def enable_server_reflection(service_names: Sequence[str], server: grpc.Server) -> None:
    """Reflection v1 and v1alpha on `server`, listing `service_names` and both of its own."""
    pool = descriptor_pool.Default()
    _v1_file(pool)
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.ReflectionServicer(names, pool=pool)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),)
    )
