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

from workers.models.hf_tokenizer import HFTokenizer

# Llama 3.1 / 3.2 Instruct's template
LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen3's template
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for index in range(ns.last_query_index, -1, -1) %}
    {%- set message = messages[index] %}
    {%- if ns.multi_step_tool and message.role == "user" and not('<tool_response>' in message.content and '</tool_response>' in message.content) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

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
