"""Chat prompts render byte for byte as transformers' `apply_chat_template` renders them, for copies of
well-known public templates and for the environment's features; what a template refuses is a ValueError."""

# ruff: noqa: E501 (the templates are copies, their lines as long as the originals')

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tests.support.templates import LLAMA3, QWEN3
from workers.models.hf_tokenizer import HFTokenizer

# Mistral 7B Instruct v0.1's template
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# What transformers' environment adds to Jinja's: trim_blocks and lstrip_blocks (for the tags without dashes
# on lines of their own), loop controls, a tojson escaping no HTML, the generation block, strftime_now
FEATURES = r"""{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}
    {% else %}
{{ message | tojson }} {{ message | tojson(indent=2, sort_keys=true) }}
    {% endif %}
    {% if ns.count == 3 %}{% break %}{% endif %}
{% endfor %}
{{ ns.count }} {{ strftime_now('%Y-%m-%d') }} {{ bos_token }}|{{ eos_token }}|{{ pad_token }}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

SYSTEM = {"role": "system", "content": "You are a concise assistant.\n"}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2 + 2?"}],
    "system and user": [SYSTEM, {"role": "user", "content": "  Name a prime.  "}],
    "several turns": [
        SYSTEM,
        {"role": "user", "content": "Where is the Eiffel tower?"},
        {"role": "assistant", "content": "In Paris."},
        {"role": "user", "content": "And Tokyo tower?"},
    ],
    "unicode": [
        {"role": "user", "content": 'Qu\'est-ce que « 東京タワー » ? <b>&amp;</b> "quoted" 😀'},
        {"role": "assistant", "content": "Une tour à Tokyo — 東京 🗼\n"},
        {"role": "user", "content": "Спасибо! مرحبا नमस्ते"},
    ],
}
THOUGHTS = {  # Qwen3 keeps the reasoning of the turns after the last question only
    "reasoning in the last turn": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<think>\nSix sevens.\n</think>\n\n42"},
    ],
    "reasoning before the last question": [
        SYSTEM,
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<think>\nSix sevens.\n</think>\n\n42"},
        {"role": "user", "content": "And 6 * 8?"},
    ],
}
LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN3_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
MISTRAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def saved(
    directory: Path, template: str | dict[str, str] | None, tokens: dict[str, str], in_config: bool = False
) -> tuple[HFTokenizer, PreTrainedTokenizerBase]:
    """Ours and transformers' tokenizer of what transformers saves for a word-level tokenizer with `tokens`
    and `template` (in `chat_template.jinja`, else, with `in_config`, in `tokenizer_config.json`)."""
    vocab = {"[UNK]": 0} | {token: i + 1 for i, token in enumerate(tokens.values())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    wrapped.chat_template = template
    wrapped.save_pretrained(directory, save_jinja_files=not in_config)
    return HFTokenizer.from_directory(directory), AutoTokenizer.from_pretrained(directory)


def transformers_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(prompt, str)
    return prompt


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize(
    ("template", "tokens"),
    [(LLAMA3, LLAMA3_TOKENS), (QWEN3, QWEN3_TOKENS), (FEATURES, LLAMA3_TOKENS)],
    ids=["llama3", "qwen3", "features"],
)
def test_prompts_are_rendered_as_transformers_renders_them(
    tmp_path: Path, template: str, tokens: dict[str, str], name: str
) -> None:
    ours, theirs = saved(tmp_path, template, tokens)
    messages = CONVERSATIONS[name]
    assert ours.render_chat(messages) == transformers_prompt(theirs, messages)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALLED = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALLED]},
    {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1"},
]


@pytest.mark.parametrize(
    ("template", "tokens"), [(LLAMA3, LLAMA3_TOKENS), (QWEN3, QWEN3_TOKENS)], ids=["llama3", "qwen3"]
)
def test_tools_calls_and_their_results_are_rendered_as_transformers_renders_them(
    tmp_path: Path, template: str, tokens: dict[str, str]
) -> None:
    ours, theirs = saved(tmp_path, template, tokens)
    for messages in (TOOL_TURNS[:1], TOOL_TURNS):
        expected = theirs.apply_chat_template(
            messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True
        )
        assert ours.render_chat(messages, [WEATHER]) == expected
    assert '"name": "get_weather"' in expected and "Sunny, 21 C" in expected


def test_the_environment_escapes_no_html_and_keeps_the_generation_block(tmp_path: Path) -> None:
    ours, _ = saved(tmp_path, FEATURES, {**LLAMA3_TOKENS, "pad_token": "<pad>"})
    prompt = ours.render_chat(CONVERSATIONS["unicode"])
    assert '"content": "Qu\'est-ce que « 東京タワー » ? <b>&amp;</b> \\"quoted\\" 😀"' in prompt
    assert "Une tour à Tokyo — 東京 🗼\n" in prompt
    assert prompt.endswith("|<|eot_id|>|<pad>\n<|assistant|>")


@pytest.mark.parametrize("name", THOUGHTS)
def test_qwen3_thoughts_are_rendered_as_transformers_renders_them(tmp_path: Path, name: str) -> None:
    ours, theirs = saved(tmp_path, QWEN3, QWEN3_TOKENS)
    assert ours.render_chat(THOUGHTS[name]) == transformers_prompt(theirs, THOUGHTS[name])


def test_llama3_opens_with_bos_and_a_system_header_even_without_a_system_message(tmp_path: Path) -> None:
    ours, _ = saved(tmp_path, LLAMA3, LLAMA3_TOKENS)
    prompt = ours.render_chat(CONVERSATIONS["user"])
    assert prompt.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge"
    )
    assert prompt.endswith("What is 2 + 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("name", ["user", "several turns"])
def test_mistral_prompts_are_rendered_as_transformers_renders_them(tmp_path: Path, name: str) -> None:
    ours, theirs = saved(tmp_path, MISTRAL, MISTRAL_TOKENS)
    messages = [message for message in CONVERSATIONS[name] if message["role"] != "system"]
    assert ours.render_chat(messages) == transformers_prompt(theirs, messages)


def test_roles_that_do_not_alternate_are_refused_with_the_templates_message(tmp_path: Path) -> None:
    ours, theirs = saved(tmp_path, MISTRAL, MISTRAL_TOKENS)
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]
    message = re.escape("Conversation roles must alternate user/assistant/user/assistant/...")
    with pytest.raises(ValueError, match=f"^{message}$"):
        ours.render_chat(messages)
    with pytest.raises(jinja2.TemplateError, match=f"^{message}$"):
        transformers_prompt(theirs, messages)
    with pytest.raises(ValueError, match=re.escape("Only user and assistant roles are supported!")):
        ours.render_chat([{"role": "user", "content": "Hi"}, SYSTEM])


@pytest.mark.parametrize(
    "template", [QWEN3, {"default": QWEN3, "tool_use": MISTRAL}], ids=["a string", "named templates"]
)
def test_a_template_in_the_config_is_read_as_transformers_reads_it(
    tmp_path: Path, template: str | dict[str, str]
) -> None:
    ours, theirs = saved(tmp_path, template, QWEN3_TOKENS, in_config=True)
    assert not (tmp_path / "chat_template.jinja").exists()
    messages = CONVERSATIONS["several turns"]
    assert ours.render_chat(messages) == transformers_prompt(theirs, messages)


def test_a_model_without_a_template_asks_for_a_prompt(tmp_path: Path) -> None:
    ours, _ = saved(tmp_path, None, MISTRAL_TOKENS)
    with pytest.raises(ValueError) as refused:
        ours.render_chat(CONVERSATIONS["user"])
    assert str(refused.value) == "this model has no chat template; send a prompt instead of messages"


def test_an_empty_conversation_is_refused_as_transformers_refuses_it(tmp_path: Path) -> None:
    ours, theirs = saved(tmp_path, QWEN3, QWEN3_TOKENS)
    with pytest.raises(ValueError, match="empty conversation") as refused:
        ours.render_chat([])
    with pytest.raises(ValueError, match=str(refused.value)):
        transformers_prompt(theirs, [])
