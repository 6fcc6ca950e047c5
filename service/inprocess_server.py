"""A real gRPC port in front of an `InProcessTransport`: the client library's calls over the
network, answered by the sidecar's own scheduler in this process (no Ray), so a "sidecar"
starts and stops in milliseconds. For tests of clients against the network: outages,
restarts on the same port, a wrong world size.

    server, port = serve_in_process(InProcessTransport(config))
    ... RolloutWriter(f"127.0.0.1:{port}") ...
    server.stop(0)  # like a killed sidecar: connections reset, calls in flight fail

Errors answer with the status code of the `SidecarError` the transport raised, as a real
sidecar does. Only the unary calls the client library makes are served.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc
from rlfeed.client.transport import SidecarError
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.inprocess import InProcessTransport


def _unary(call: Callable, request_type, response_type) -> grpc.RpcMethodHandler:
    def handle(request, context):
        try:
            return call(request)
        except SidecarError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), exc.message)

    return grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=request_type.FromString,
        response_serializer=response_type.SerializeToString,
    )


def _handlers(transport: InProcessTransport) -> list[grpc.GenericRpcHandler]:
    def report(request: pb.TrainerReport) -> pb.TrainerReportAck:
        transport.report(request)
        return pb.TrainerReportAck()

    services = {
        "RolloutIngest": {
            "SubmitRolloutBatch": _unary(transport.submit, pb.RolloutBatch, pb.SubmitAck),
        },
        "TaskSampling": {
            "RegisterTasks": _unary(
                lambda r: transport.register_tasks(list(r.task_ids)),
                pb.RegisterTasksRequest,
                pb.RegisterTasksResponse,
            ),
            "SampleTasks": _unary(
                lambda r: transport.sample_tasks(r.n), pb.SampleTasksRequest, pb.SampleTasksResponse
            ),
        },
        "BatchServing": {
            "GetBatch": _unary(
                lambda r: transport.get_batch(r.step, r.rank, r.timeout_ms / 1000),
                pb.GetBatchRequest,
                pb.GetBatchResponse,
            ),
            "AckSteps": _unary(
                lambda r: transport.ack_steps(
                    r.rank, r.through_step if r.HasField("through_step") else None
                ),
                pb.AckStepsRequest,
                pb.AckStepsResponse,
            ),
            "ReportTrainerMetrics": _unary(report, pb.TrainerReport, pb.TrainerReportAck),
        },
        "SidecarStatus": {
            "GetStatus": _unary(
                lambda r: transport.status(), pb.GetStatusRequest, pb.StatusResponse
            ),
        },
    }
    return [
        grpc.method_handlers_generic_handler(f"rlfeed.v1.{service}", methods)
        for service, methods in services.items()
    ]


def serve_in_process(
    transport: InProcessTransport, address: str = "127.0.0.1:0"
) -> tuple[grpc.Server, int]:
    """(started server, its port) answering at `address` from `transport`; the caller
    stops it. A port given in `address` is bound again after a stop (a restart)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers(_handlers(transport))
    port = server.add_insecure_port(address)
    server.start()
    return server, port
