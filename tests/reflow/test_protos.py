"""The wire contract: stubs are fresh, every rpc and field is documented, contract names hold."""

from __future__ import annotations

import re
from pathlib import Path

from reflow import protogen
from reflow.v1 import inference_pb2, worker_pb2


def test_generated_stubs_are_not_stale(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    for path in fresh:
        committed = protogen.STUB_ROOT / path.relative_to(tmp_path)
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `make protos`"


def test_every_rpc_and_field_has_a_comment() -> None:
    declaration = re.compile(r"^\s*(rpc \w+|(repeated |map<[^>]+> )?[\w.]+ \w+ = \d+;|\w+ = \d+;)")
    for proto in protogen.PROTO_ROOT.rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if declaration.match(line):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} lacks a comment: {line}"


def test_public_contract_names() -> None:
    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert [m.name for m in service.methods] == ["Generate", "SubmitFeedback", "ListModels"]
    generate = service.methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    feedback = service.methods_by_name["SubmitFeedback"]
    assert feedback.client_streaming and not feedback.server_streaming
    fields = {
        "GenerateRequest": ["model", "prompt", "sampling", "user_id", "reasoning_budget",
                            "latency_budget_ms", "labels", "messages", "variant", "logprobs", "top_logprobs",
                            "prompt_logprobs", "structured_output", "tools", "tool_choice",
                            "prompt_only"],
        "Tool": ["name", "description", "parameters"],
        "ToolChoice": ["mode", "function"],
        "ToolCall": ["id", "name", "arguments"],
        "ToolCallDelta": ["index", "id", "name", "arguments"],
        "StructuredOutput": ["json_object", "json_schema", "regex", "grammar"],
        "TokenLogprob": ["token_id", "token", "logprob", "top_logprobs"],
        "ChatMessage": ["role", "content", "tool_calls", "tool_call_id"],
        "SamplingParams": ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
                           "frequency_penalty", "repetition_penalty", "logit_bias"],
        "GenerateResponse": ["request_id", "model", "model_version", "arm", "text", "reasoning_text",
                             "finish_reason", "usage", "routing", "logprobs", "prompt_logprobs",
                             "tool_calls"],
        "Routing": ["variant", "token_agreement", "predicted_time_to_first_token_ms", "predicted_total_ms",
                    "reasoning_budget", "predicted_to_meet_deadline"],
        "Usage": ["prompt_tokens", "completion_tokens", "reasoning_tokens", "time_to_first_token_ms",
                  "total_ms", "cached_tokens"],
        "Feedback": ["feedback_id", "request_id", "rating", "correction", "user_id", "labels",
                     "preferred_over", "stars"],
        "FeedbackAck": ["accepted", "rejected", "errors"],
    }  # fmt: skip
    for message, names in fields.items():
        assert [f.name for f in inference_pb2.DESCRIPTOR.message_types_by_name[message].fields] == names
    reasons = inference_pb2.DESCRIPTOR.enum_types_by_name["FinishReason"].values_by_name
    assert list(reasons) == [
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_STOP", "FINISH_REASON_LENGTH",
        "FINISH_REASON_CANCELLED", "FINISH_REASON_ERROR", "FINISH_REASON_TOOL_CALLS",
    ]  # fmt: skip
    worker = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    assert [m.name for m in worker.methods] == ["Generate", "Status", "Load", "Unload", "SyncAliases"]
