"""Chat templates render (and tokenize) exactly as transformers' apply_chat_template does."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from gpt_fast.chat_template import chat_prompt_ids, render_chat
from gpt_fast.convert.hf_tokenizer import tokenizer_from_hf_dir
from gpt_fast.tokenizer import Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Indented blocks (trim_blocks / lstrip_blocks), tojson with non-ASCII and HTML characters, loop controls,
# a {% generation %} block, and an undefined special token.
FEATURES_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    <{{ message['role'] }}>{{ message | tojson }}
    {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}{% endif %}
{% endfor %}
{{ tools | tojson(indent=2) }} {{ unk_marker is defined }} {{ bos_token is defined }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "  You are terse. <script>&amp;</script>  "},
    {"role": "user", "content": "Hello! Café 😀\tand\nnewlines"},
    {"role": "assistant", "content": "Hi. \"quoted\" 'single'"},
    {"role": "user", "content": "Second question: 2 + 2?"},
]


def ours_and_theirs(directory: Path) -> tuple[Tokenizer, object]:
    cfg, _, _ = tokenizer_from_hf_dir(directory, {})
    return load_tokenizer(directory, cfg), transformers.AutoTokenizer.from_pretrained(str(directory))


def assert_renders_like_transformers(template: str, ours: Tokenizer, theirs, messages: list[dict]) -> None:
    for add_generation_prompt in (True, False):
        expected = theirs.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = render_chat(
            template,
            messages,
            bos_token=ours.bos_token,
            eos_token=ours.eos_token,
            add_generation_prompt=add_generation_prompt,
        )
        assert got == expected
    expected_ids = theirs.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, return_dict=False
    )
    assert chat_prompt_ids(ours, template, messages) == expected_ids


def test_llama3_style_template(byte_level_bpe_dir: Path) -> None:
    ours, theirs = ours_and_theirs(byte_level_bpe_dir)
    assert_renders_like_transformers(LLAMA3_TEMPLATE, ours, theirs, CONVERSATION)
    assert_renders_like_transformers(LLAMA3_TEMPLATE, ours, theirs, CONVERSATION[1:2])
    ids = chat_prompt_ids(ours, LLAMA3_TEMPLATE, CONVERSATION[1:2])
    assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1  # the template's BOS only


def test_llama2_style_template(sentencepiece_dir: Path) -> None:
    ours, theirs = ours_and_theirs(sentencepiece_dir)
    assert_renders_like_transformers(LLAMA2_TEMPLATE, ours, theirs, CONVERSATION)
    assert_renders_like_transformers(LLAMA2_TEMPLATE, ours, theirs, CONVERSATION[1:])


def test_template_features(sentencepiece_dir: Path) -> None:
    ours, theirs = ours_and_theirs(sentencepiece_dir)
    messages = [*CONVERSATION, {"role": "skip", "content": "hidden"}, {"role": "user", "content": "x", "name": None}]
    # Text first: a SentencePiece prompt that starts with spaces gets the dummy prefix before them from
    # sentencepiece, which we follow, and not from transformers 5 (see test_tokenizer_sentencepiece.py).
    assert_renders_like_transformers("Chat:" + FEATURES_TEMPLATE, ours, theirs, messages)
    rendered = render_chat(FEATURES_TEMPLATE, messages, bos_token=None, eos_token=None)
    assert "Café 😀" in rendered and "<script>&amp;</script>" in rendered and "hidden" not in rendered
    assert rendered.rstrip().endswith("null False False\n<assistant>")


def test_raise_exception_in_template(sentencepiece_dir: Path) -> None:
    ours, theirs = ours_and_theirs(sentencepiece_dir)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        theirs.apply_chat_template(bad, chat_template=LLAMA2_TEMPLATE, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        render_chat(LLAMA2_TEMPLATE, bad, bos_token="<s>", eos_token="</s>")


def test_sandbox_blocks_unsafe_attributes() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.__class__.__mro__ }}", [], bos_token=None, eos_token=None)


@pytest.mark.parametrize("template", [None, ""])
def test_no_template_is_a_clear_error(sentencepiece_dir: Path, template: str | None) -> None:
    ours, _ = ours_and_theirs(sentencepiece_dir)
    with pytest.raises(ValueError, match="no chat template.*--prompt without --chat"):
        chat_prompt_ids(ours, template, CONVERSATION)


@pytest.mark.slow
def test_smollm2_template(smollm2_tokenizer, smollm2_hf_tokenizer) -> None:
    ours, _, template = smollm2_tokenizer
    assert template == smollm2_hf_tokenizer.chat_template
    for messages in (CONVERSATION, CONVERSATION[1:]):  # with and without a system message (it adds a default one)
        assert_renders_like_transformers(template, ours, smollm2_hf_tokenizer, messages)
    ids = chat_prompt_ids(ours, template, CONVERSATION[1:2])
    assert ids[:2] == [1, 9690]  # <|im_start|>system: no BOS added on top of the template's tokens
