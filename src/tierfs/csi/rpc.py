"""gRPC plumbing shared by the services: method tables from the message classes, error codes.

The services are built from ``csi_pb2`` alone (no generated stubs): a method's request
and response classes are found in the service descriptor, so each service is just a
table of plain functions.
"""

from __future__ import annotations

import logging
from typing import Callable

import grpc

from tierfs.csi import csi_pb2 as pb
from tierfs.csi.errors import VolumeError

log = logging.getLogger("tierfs.csi")
PACKAGE = "csi.v1"
# gRPC carries the message in a trailer, and trailers are capped (8 KiB by default): an
# answer that quoted a huge attribute back would reach kubelet as a transport error instead.
MAX_DETAILS = 1024


def one_line(text: str, limit: int = MAX_DETAILS) -> str:
    """The message as kubelet shows it in the pod's events: one line, of a bounded length."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message_class(descriptor):
    return getattr(pb, descriptor.name)


def service(name: str, methods: dict[str, Callable]) -> grpc.GenericRpcHandler:
    """A handler for ``csi.v1.<name>``; methods missing from ``methods`` answer UNIMPLEMENTED."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name[name].methods:
        fn = methods.get(method.name)
        if fn is None:
            continue
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _answer(f"{name}.{method.name}", fn),
            request_deserializer=_message_class(method.input_type).FromString,
            response_serializer=_message_class(method.output_type).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(f"{PACKAGE}.{name}", handlers)


def _answer(name: str, fn: Callable):
    def call(request, context: grpc.ServicerContext):
        try:
            return fn(request)
        except VolumeError as e:
            message = one_line(str(e))
            log.warning("%s: %s %s", name, e.code, message)
            context.abort(grpc.StatusCode[e.code], message)
        except Exception as e:  # noqa: BLE001 (a bug: its traceback in the log, a clean code to kubelet)
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, one_line(f"{type(e).__name__}: {e}"))

    return call


def stub(channel: grpc.Channel, service_name: str, method: str) -> Callable:
    """A client callable for one method, as kubelet would call it (used by tests and tools)."""
    desc = pb.DESCRIPTOR.services_by_name[service_name].methods_by_name[method]
    return channel.unary_unary(
        f"/{PACKAGE}.{service_name}/{method}",
        request_serializer=_message_class(desc.input_type).SerializeToString,
        response_deserializer=_message_class(desc.output_type).FromString,
    )
