"""The error interceptor of every reflow server: a request that is no serialization of its message
is INVALID_ARGUMENT on every service (gRPC itself answers UNKNOWN, or INTERNAL inside a request
stream), and well-formed requests pass through as before."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from reflow.serving import bind, new_server, set_serving
from reflow.v1 import inference_pb2, inference_pb2_grpc

P = inference_pb2
# field 1 holding bytes that are not UTF-8: a string field of every request here (GenerateRequest.model,
# Feedback.feedback_id, HealthCheckRequest.service, ServerReflectionRequest.host) but ListModelsRequest,
# which has no fields (and keeps unknown ones as bytes)
BAD_STRING = b"\x0a\x02\xff\xfe"
CORRUPT = b"\xff\xff\xff"  # no wire format at all


class Echo(inference_pb2_grpc.InferenceServicer):
    async def Generate(
        self, request: P.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[P.GenerateResponse]:
        yield P.GenerateResponse(text=request.prompt)

    async def SubmitFeedback(
        self, request_iterator: AsyncIterator[P.Feedback], context: grpc.aio.ServicerContext
    ) -> P.FeedbackAck:
        return P.FeedbackAck(accepted=len([item async for item in request_iterator]))

    async def ListModels(
        self, request: P.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> P.ListModelsResponse:
        return P.ListModelsResponse(models=[P.Model(name="echo")])


async def test_a_request_that_is_no_message_is_invalid_argument_on_every_service() -> None:
    ended: list[tuple[str, grpc.StatusCode]] = []
    server, health = new_server(
        ["reflow.v1.Inference"], on_done=lambda method, code: ended.append((method, code))
    )
    inference_pb2_grpc.add_InferenceServicer_to_server(Echo(), server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    await set_serving(health, ["reflow.v1.Inference"], True)
    feedback = P.Feedback(request_id="r", rating=1).SerializeToString()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = {
                "/reflow.v1.Inference/Generate": lambda body: channel.unary_stream(
                    "/reflow.v1.Inference/Generate"
                )(body).read(),
                "/reflow.v1.Inference/SubmitFeedback": lambda body: channel.stream_unary(
                    "/reflow.v1.Inference/SubmitFeedback"
                )(iter([feedback, body])),
                "/reflow.v1.Inference/ListModels": channel.unary_unary("/reflow.v1.Inference/ListModels"),
                "/grpc.health.v1.Health/Check": channel.unary_unary("/grpc.health.v1.Health/Check"),
                "/grpc.health.v1.Health/Watch": lambda body: channel.unary_stream(
                    "/grpc.health.v1.Health/Watch"
                )(body).read(),
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": lambda body: (
                    channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
                        iter([body])
                    ).read()
                ),
            }
            for path, send in calls.items():
                for body in (CORRUPT,) if path.endswith("/ListModels") else (BAD_STRING, CORRUPT):
                    try:
                        await send(body)
                    except grpc.aio.AioRpcError as error:
                        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, body, error)
                        assert "not a valid message" in (error.details() or ""), (path, error.details())
                    else:
                        raise AssertionError(f"{path} took {body!r}")
            # well-formed requests are served as before
            generated = await channel.unary_stream(
                "/reflow.v1.Inference/Generate", response_deserializer=P.GenerateResponse.FromString
            )(P.GenerateRequest(prompt="1+1=").SerializeToString()).read()
            ack = await channel.stream_unary(
                "/reflow.v1.Inference/SubmitFeedback", response_deserializer=P.FeedbackAck.FromString
            )(iter([feedback, feedback]))
            watched = await channel.unary_stream(
                "/grpc.health.v1.Health/Watch",
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )(health_pb2.HealthCheckRequest(service="reflow.v1.Inference").SerializeToString()).read()
            reflected = await channel.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )(iter([reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()])).read()
    finally:
        await server.stop(0)
    assert generated.text == "1+1=" and ack.accepted == 2
    assert watched.status == health_pb2.HealthCheckResponse.SERVING
    assert "reflow.v1.Inference" in {s.name for s in reflected.list_services_response.service}
    reflow_calls = [
        (method, code)
        for method, code in ended
        if method.endswith(("/Generate", "/SubmitFeedback", "/ListModels"))
    ]
    assert reflow_calls[:5] == [
        (method, grpc.StatusCode.INVALID_ARGUMENT) for method in [
            "/reflow.v1.Inference/Generate", "/reflow.v1.Inference/Generate",
            "/reflow.v1.Inference/SubmitFeedback", "/reflow.v1.Inference/SubmitFeedback",
            "/reflow.v1.Inference/ListModels",
        ]
    ]  # fmt: skip
