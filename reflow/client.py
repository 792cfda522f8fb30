"""A small Python client for the public Inference service (used by `reflow generate`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from reflow.gateway_tls import client_credentials
from reflow.mtls import open_channel
from reflow.v1 import inference_pb2, inference_pb2_grpc


class Client:
    """Blocking client: `with Client(target, api_key) as c: for m in c.generate("47+38="): ...`."""

    def __init__(self, target: str, api_key: str, ca_file: str | Path | None = None):
        """A channel to the gateway at `target`: TLS trusting the CA certificate (PEM) in `ca_file`
        for the gateway's, else plaintext."""
        self.channel = open_channel(target, client_credentials(ca_file))
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),)

    def generate(
        self,
        prompt: str = "",
        *,
        messages: Iterable[inference_pb2.ChatMessage | Mapping[str, str]] = (),
        model: str = "",
        sampling: inference_pb2.SamplingParams | None = None,
        reasoning_budget: int = 0,
        user_id: str = "",
        timeout: float | None = None,
    ) -> Iterator[inference_pb2.GenerateResponse]:
        """Streams the messages of one completion of `prompt`, or of `messages`, a conversation
        (`{"role": "user", "content": "..."}` each) the model's chat template renders."""
        request = inference_pb2.GenerateRequest(
            model=model,
            prompt=prompt,
            messages=messages,
            sampling=sampling,
            reasoning_budget=reasoning_budget,
            user_id=user_id,
        )
        yield from self.stub.Generate(request, metadata=self.metadata, timeout=timeout)

    def submit_feedback(
        self, items: Iterable[inference_pb2.Feedback], timeout: float | None = None
    ) -> inference_pb2.FeedbackAck:
        """Streams feedback items (any number) and returns the gateway's acknowledgement."""
        return self.stub.SubmitFeedback(iter(items), metadata=self.metadata, timeout=timeout)

    def list_models(self) -> inference_pb2.ListModelsResponse:
        """The models and versions the gateway can route to."""
        return self.stub.ListModels(inference_pb2.ListModelsRequest(), metadata=self.metadata)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
