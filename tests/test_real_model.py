"""The real model, as a newcomer serves it: `reflow up --model FILE.gguf` imports SmolLM2-135M-Instruct
from its GGUF file and streams a chat answer whose greedy text is the one transformers generates from
the same file, over gRPC and through the `openai` SDK; the conversation and its rating reach the
store, the worker reports its KV cache, and a schema holds an answer to a type the SDK parses."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import httpx
import openai
import pydantic
import pytest
import torch

from reflow.client import Client
from reflow.v1 import inference_pb2
from tests.support.cli import reflow
from tests.support.hf import transformers
from tests.support.registry import new_store
from tests.support.smollm2 import smollm2_gguf
from tests.support.up import Up, feedback_stats
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

KEY = "rf_test_key_0123456789"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
MAX_TOKENS = 32
NAME = "smollm2-135m-instruct-q4_1"  # what `--model` names the file's model


class Capital(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)


def transformers_answer(read: Path) -> str:
    """What transformers generates greedily for CHAT from the GGUF file as it `read` it, in float32."""
    tokenizer = transformers().AutoTokenizer.from_pretrained(read)
    model = transformers().AutoModelForCausalLM.from_pretrained(read).eval()
    ids = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.timeout(600)
def test_reflow_up_serves_a_gguf_file_with_the_answer_transformers_gives(
    tmp_path: Path, smollm2_by_transformers: Path
) -> None:
    gguf = smollm2_gguf()
    expected = transformers_answer(smollm2_by_transformers)
    data_dir = tmp_path / "data"
    new_store(data_dir / "mlflow.db")  # empty (tests/reflow/cli/test_up.py has `reflow up` make one)
    up = Up(data_dir, "--workers", "1", "--model", str(gguf), env={"REFLOW_DTYPE": "float32"})
    try:
        endpoints = up.endpoints()
        wait_for(lambda: "--chat" in up.output(), 30, what="the hint for a chat model")  # printed after
        with Client(endpoints["gateway"], KEY) as client:
            sampling = inference_pb2.SamplingParams(max_tokens=MAX_TOKENS)
            stream = list(client.generate(messages=CHAT, sampling=sampling))
            served = [(m.name, [v.version for v in m.versions]) for m in client.list_models().models]
        assert served == [(NAME, ["1"])]
        assert "".join(m.text for m in stream) == expected
        assert stream[-1].usage.prompt_tokens > 30  # SmolLM2's template adds its system prompt
        # the same through the OpenAI API, as the `openai` SDK's users write it; then a rating of it
        sdk = openai.OpenAI(base_url=f"{endpoints['http']}/v1", api_key=KEY)
        chunks = list(sdk.chat.completions.create(
            model=NAME, messages=CHAT, stream=True, stream_options={"include_usage": True}, user="u42",
            temperature=0, max_tokens=MAX_TOKENS,
        ))  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        prompt_tokens = stream[-1].usage.prompt_tokens
        assert chunks[-1].usage.prompt_tokens == prompt_tokens
        # the same prompt again: all its full 16-token blocks reused but the last token's, same answer
        reused = (prompt_tokens - 1) // 16 * 16
        assert stream[-1].usage.cached_tokens == 0
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reused
        rated = sdk.post("/feedback", body={"request_id": chunks[0].id, "rating": 1}, cast_to=httpx.Response)
        assert rated.json()["accepted"] == 1
        stats = feedback_stats(data_dir, lambda s: s["inferences"] == 2 and s["joined_feedback"] == 1)
        assert (stats["inferences"], stats["feedback"]) == (2, 1)
        with urllib.request.urlopen(endpoints["metrics"]["worker-0"], timeout=10) as reply:
            metrics = reply.read().decode()
        assert "reflow_worker_kv_blocks " in metrics and "reflow_worker_kv_cache_usage " in metrics
        hit = f"reflow_worker_prefix_cache_hit_tokens_total {float(reused)}"
        assert hit in metrics and f"reflow_worker_prompt_tokens_total {2.0 * prompt_tokens}" in metrics
        listed = reflow("models", "list", NAME, env={"REFLOW_DATA_DIR": str(data_dir)})
        assert listed.stdout.split("\t")[:3] == ["1", "champion", "import"], listed.stderr
        status = reflow("workers", "status", "--json", env={"REFLOW_DATA_DIR": str(data_dir)})
        [worker] = json.loads(status.stdout)
        assert worker["kv_blocks_used"] == 0 and worker["kv_blocks_total"] > 0
        assert worker["kv_blocks_cached"] == prompt_tokens // 16
        assert worker["prefix_cache_hit_rate"] == pytest.approx(reused / (2 * prompt_tokens))
        assert [(v["model"], v["dtype"]) for v in worker["loaded"]] == [(NAME, "float32")]
        assert worker["loaded"][0]["dtype_candidates"] == []  # REFLOW_DTYPE set: nothing measured
        # a structured answer as the SDK's users ask for one: parsed into their own type
        parsed = sdk.chat.completions.parse(
            model=NAME, messages=CHAT, response_format=Capital, temperature=0, max_tokens=MAX_TOKENS
        )
        capital = parsed.choices[0].message.parsed
        assert isinstance(capital, Capital) and capital.city == "Paris", parsed.choices[0].message.content
    finally:
        assert up.stop() == 0, up.output()
