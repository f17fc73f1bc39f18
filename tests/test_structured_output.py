"""Structured output and tool calling.

Each token's bytes against llguidance's own readers of the same tokenizer files; the constraint's checks; answers
held to JSON schemas through the engine (one stream, and batched beside unconstrained requests that stay as they
are alone, also while the constrained one waits for its masks), `gpt-fast generate --json_schema` and the server
with the official openai client (``chat.completions.parse`` with Pydantic models; every answer validated by
jsonschema); tool calls in the chat template's own format (the format read from templates; a round trip through the
server on a tiny random model); bad inputs refused with one 400 while another stream goes on.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import threading
from pathlib import Path

import jsonschema
import llguidance
import llguidance.tiktoken
import openai
import pydantic
import pytest
import torch
from test_serve import SMOL, Server

from gpt_fast import Engine, SamplingConfig
from gpt_fast.cli.main import main
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.batcher import Finished, Request
from gpt_fast.engine.options import BatchOptions
from gpt_fast.generation.constraint import GrammarError, lark_literal
from gpt_fast.generation.options import OutputConstraint
from gpt_fast.model.config import TokenizerConfig, load_checkpoint_config
from gpt_fast.model.shapes import get_shape
from gpt_fast.text.tokenizer import load_tokenizer
from gpt_fast.text.tool_calls import ToolCall, ToolCallFormat
from gpt_fast.util.options import OptionError
from tests.tiny import LaggingReadbacks, one_torch_thread

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GREEDY = SamplingConfig(temperature=0)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
# Small enough for a random model to finish: no free text.
CHOICE = {
    "type": "object",
    "properties": {"pick": {"enum": ["a", "bb", "ccc"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["pick", "n"],
    "additionalProperties": False,
}
# A chat template that writes tool calls as tagged JSON objects, one after another (the layout several model families
# use); the tests read the layout from it as the server does.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Functions:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one with <call>{"name": ..., "arguments": ...}</call>.<|end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls is defined %}<|assistant|>"
    '{% for c in m.tool_calls %}<call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</call>{% endfor %}<|end_of_text|>\n'
    "{% elif m.role == 'tool' %}<|tool|>{{ m.name }}: {{ m.content }}<|end|>\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
SEVERAL_CALLS_SEED = 2  # with it, the tiny random model writes several calls, then stops
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


# --- each token's bytes ------------------------------------------------------------------------------------------


def hf_config(folder: Path) -> TokenizerConfig:
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    specials = {token["content"]: token["id"] for token in added}
    stop = max(specials.values())
    return TokenizerConfig("huggingface", "tokenizer.json", None, False, (stop,), special_tokens=specials)


def llguidance_bytes(reader: llguidance.LLTokenizer, vocab_size: int) -> list[bytes]:
    return [reader.decode_bytes([token]) for token in range(vocab_size)]


def comparable(pieces) -> list[bytes]:
    """Every token's bytes but the lone byte 0xFF's: never in UTF-8 text, and llguidance's mark of a special token
    (its own readers give that token no bytes)."""
    return [b"" if piece == b"\xff" else piece for piece in pieces]


def test_token_bytes_of_tokenizer_json_are_what_llguidance_reads(byte_level_bpe_dir, smollm2_gguf, tmp_path):
    """Byte-level BPE (a Llama-3-like file; SmolLM2's, rebuilt from its GGUF) and SentencePiece-style BPE (the
    sentencepiece model as transformers converts it: "▁" and byte pieces), each read by llguidance itself."""
    import gguf

    from gpt_fast.convert.gguf_tokenizer import tokenizer_from_gguf

    smol = tmp_path / "smol"
    smol.mkdir()
    tokenizer_from_gguf(gguf.GGUFReader(smollm2_gguf), smol)
    for folder in (byte_level_bpe_dir, smol):
        ours = load_tokenizer(folder, hf_config(folder))
        reader = llguidance.LLTokenizer((folder / "tokenizer.json").read_text())
        assert comparable(ours.token_bytes) == llguidance_bytes(reader, ours.vocab_size), folder


def test_token_bytes_of_sentencepiece_and_tiktoken_are_what_llguidance_reads(sentencepiece_dir, tiktoken_dir, tmp_path):
    """A SentencePiece model (its pieces, and the same model as transformers writes it to tokenizer.json) and a
    tiktoken file (through llguidance's reader of tiktoken's encoding)."""
    import transformers

    specials = {"<unk>": 0, "<s>": 1, "</s>": 2, "<ctl>": 3, "<tool>": 4}
    config = TokenizerConfig("sentencepiece", "tokenizer.model", 1, True, (2,), special_tokens=specials)
    pieces = load_tokenizer(sentencepiece_dir, config)
    converted = tmp_path / "converted"
    transformers.AutoTokenizer.from_pretrained(str(sentencepiece_dir)).backend_tokenizer.save(str(converted))
    reader = llguidance.LLTokenizer(converted.read_text())
    expected = llguidance_bytes(reader, pieces.vocab_size)
    control = pieces.control_ids
    assert [b for i, b in enumerate(comparable(pieces.token_bytes)) if i not in control] == [
        b for i, b in enumerate(expected) if i not in control
    ]
    as_json = load_tokenizer(converted.parent, dataclasses.replace(config, kind="huggingface", file=converted.name))
    assert comparable(as_json.token_bytes) == expected

    added = json.loads((tiktoken_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    specials = {entry["content"]: int(token_id) for token_id, entry in added.items()}
    ends = (min(specials.values()), max(specials.values()))
    config = TokenizerConfig(
        "tiktoken", "tokenizer.model", ends[0], True, ends[1:], special_tokens=specials, pattern=LLAMA3_PATTERN
    )
    ours = load_tokenizer(tiktoken_dir, config)
    reader = llguidance.tiktoken.lltokenizer_from_encoding(ours._enc, eos_token=ends[1])
    assert comparable(ours.token_bytes) == llguidance_bytes(reader, ours.vocab_size)


# --- the constraint's own checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "a json_schema or a grammar"),
        ({"json_schema": "{}", "grammar": "start: x"}, "a json_schema or a grammar"),
        ({"json_schema": "{not json"}, "not JSON"),
        ({"json_schema": "[1, 2]"}, "must be a JSON object"),
        ({"json_schema": json.dumps({"enum": list(range(1001))})}, "1001 enum values"),
        ({"json_schema": json.dumps({"enum": ["x" * 600] * 30})}, "characters of enum values"),
        ({"json_schema": "[" * 70 + "]" * 70}, "must be a JSON object"),
        ({"json_schema": '{"a":' * 70 + "1" + "}" * 70}, "nested deeper"),
        ({"grammar": " "}, "non-empty text"),
    ],
)
def test_an_output_constraint_checks_its_values(fields, message):
    with pytest.raises(OptionError, match=message):
        OutputConstraint(**fields)


# --- the engine, on the default model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_engine(smollm2_checkpoint):
    with one_torch_thread():
        yield Engine.load(smollm2_checkpoint, device="cpu")


def test_answers_match_the_schema_in_one_stream_and_batched(smol_engine):
    constraint = OutputConstraint.from_schema(PERSON)
    one = smol_engine.generate("Describe a person.", 48, GREEDY, chat=True, constraint=constraint)
    streamed = "".join(smol_engine.stream("Describe a person.", 48, GREEDY, chat=True, constraint=constraint))
    torch.manual_seed(41)  # the rows' seeds are drawn from it
    batched = smol_engine.generate(
        ["Describe a person.", "Invent a painter."], 48, SamplingConfig(0.7), chat=True, constraint=constraint
    )
    assert streamed == one[0].text
    for completion in [*one, *batched]:
        jsonschema.validate(json.loads(completion.text), PERSON)
        assert completion.finish_reason == "stop"


def any_of(count: int) -> dict:
    """A schema past the grammar engine's bound on its work at the first token (2000 items in a row)."""
    return {"anyOf": [{"type": "object", "properties": {"a": {"const": i}}} for i in range(count)]}


def test_the_engine_refuses_a_schema_or_gives_up_on_it(smol_engine):
    """What it refuses, it refuses when the constraint is compiled, before anything is generated; what it gives up
    on within its limits (its time-out) fails the generation."""
    for schema, message in [
        ({"type": "banana"}, "refuses it: Invalid type"),
        ({"type": "array", "uniqueItems": True}, "refuses it: Unimplemented"),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "no end"),
    ]:
        with pytest.raises(GrammarError, match=message):
            smol_engine.compile_constraint(OutputConstraint.from_schema(schema))
    with pytest.raises(GrammarError, match="gave up on it after 1 tokens: .*max is 2000"):
        smol_engine.generate("x", 4, GREEDY, constraint=OutputConstraint.from_schema(any_of(2100)))


def test_generate_command_holds_the_answer_to_a_json_schema(smollm2_checkpoint, tmp_path, capsys):
    schema, metrics = tmp_path / "person.json", tmp_path / "metrics.json"
    schema.write_text(json.dumps(PERSON))
    argv = ["generate", "--checkpoint_path", str(smollm2_checkpoint), "--chat", "--prompt", "Describe a person.",
            "--json_schema", str(schema), "--temperature", "0", "--num_samples", "1", "--max_new_tokens", "48",
            "--metrics_json", str(metrics)]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0, capsys.readouterr().err
    jsonschema.validate(json.loads(json.loads(metrics.read_text())["samples"][0]["text"][0]), PERSON)
    schema.write_text('{"enum": [' + ", ".join(["1"] * 1001) + "]}")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.startswith("error: --json_schema has 1001 enum values")


# --- the batcher: constrained slots beside plain ones --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=3)
    return Engine.load(path, device="cpu")


def run_batched(engine, requests, lagging=False):
    """Each request's Finished, and the number of decode steps launched when it finished."""
    batcher = engine.batcher(BatchOptions(max_batch=3, max_seq_length=128))
    if lagging:
        batcher.readbacks = LaggingReadbacks(batcher.device)
    launched = [0]
    decode = batcher.steps.decode

    def counted(*args, **kwargs):
        launched[0] += 1
        return decode(*args, **kwargs)

    batcher.steps = dataclasses.replace(batcher.steps, decode=counted)
    ends: list = [None] * len(requests)
    for index, request in enumerate(requests):

        def keep(event, index=index):
            if isinstance(event, Finished):
                ends[index] = (event, launched[0])

        batcher.submit(request, keep)
    batcher.run()
    return ends


def test_constrained_slots_wait_for_their_masks_while_plain_ones_run_ahead(tiny_engine):
    """A constrained request's tokens are held to its schema; the plain requests beside it give what they give
    without it. With results reaching the host a step late (as on a GPU), the plain request still finishes in as many
    steps as it has tokens, while the constrained one sits out the steps launched before its last token was read."""
    encode, choice = tiny_engine.encode, OutputConstraint.from_schema(CHOICE)
    plain = [
        Request(tuple(encode("hello")), 24, GREEDY, ignore_eos=True),
        Request(tuple(encode("zz")), 24, SamplingConfig(1.0), seed=7, ignore_eos=True),
    ]
    constrained = [
        Request(tuple(encode("{")), 40, GREEDY, constraint=choice),
        Request(tuple(encode("a")), 40, SamplingConfig(1.0), seed=3, constraint=choice),
    ]
    alone = run_batched(tiny_engine, plain)
    for lagging in (False, True):
        mixed = run_batched(tiny_engine, [plain[0], constrained[0], plain[1], constrained[1]], lagging)
        assert [end.ids for end, _ in mixed[::2]] == [end.ids for end, _ in alone]
        for end, _ in mixed[1::2]:
            assert end.finish_reason == "stop"
            jsonschema.validate(json.loads(tiny_engine.decode(end.ids)), CHOICE)
    first_plain, first_constrained = mixed[0], mixed[1]
    assert first_plain[1] <= 24 + 2  # a step per token: it ran ahead
    assert first_constrained[1] > len(first_constrained[0].ids) + 2  # held while its masks were made


def test_a_constraint_ends_the_answer_and_a_grammar_may_name_special_tokens(tiny_engine):
    """The answer ends once the grammar is complete (no stop token needed); a grammar's special token (here EOS, as
    a tool call's marker may be) is a token of its own."""
    assert lark_literal("x<|end_of_text|>y", tiny_engine.tokenizer.special_tokens) == '"x" <[257]> "y"'
    constraint = OutputConstraint(grammar='start: "ab" <[257]> "c"')
    ids = tiny_engine.encode("q")
    (done,) = run_batched(tiny_engine, [Request(tuple(ids), 10, GREEDY, ignore_eos=True, constraint=constraint)])
    assert list(done[0].ids) == [*b"ab", 257, *b"c"] and done[0].finish_reason == "stop"


# --- tool calls in a template's own format -------------------------------------------------------------------------

BARE_TEMPLATE = (
    "{% if tools %}[{% for t in tools %}{{ t.function.name }}{% endfor %}]{% endif %}"
    "{% for m in messages %}{% if m.tool_calls is defined %}<|assistant|>{% set c = m.tool_calls[0].function %}"
    '{"type": "function", "name": "{{ c.name }}", "parameters": {{ c.arguments | tojson }}}<|end|>'
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LIST_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "{% if m.tool_calls is defined %}[CALLS][{% for c in m.tool_calls %}{% if not loop.first %}, {% endif %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson | tojson }}}{% endfor %}]</s>'
    "{% else %}[{{ m.role }}] {{ m.content }}</s>{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "template, start, between, end, parallel, keys",
    [
        (TOOLS_TEMPLATE, "<call>", "</call><call>", "</call>", True, ["name", "arguments"]),
        (BARE_TEMPLATE, "", "", "", False, ["type", "name", "parameters"]),
        (LIST_TEMPLATE, "[CALLS][", ", ", "]", True, ["name", "arguments"]),
    ],
)
def test_the_tool_call_format_is_read_from_the_template(template, start, between, end, parallel, keys):
    """Rendering one call (and two) of a probe function gives where calls start, how they are separated and end (up
    to the stop token), and the call object's keys: the tagged, the bare (one call a turn, fixed "type", arguments
    under "parameters") and the listed layout (arguments written as JSON text)."""
    layout = ToolCallFormat.of_template(template, None, None, ["<|end|>", "<|end_of_text|>", "</s>"])
    assert (layout.start, layout.between, layout.end, layout.parallel) == (start, between, end, parallel)
    assert [key for key, _ in layout.keys] == keys
    assert layout.arguments_as_text == (template is LIST_TEMPLATE)
    call = {keys[-2]: "get_time", keys[-1]: {"zone": "UTC"}} | ({"type": "function"} if "type" in keys else {})
    written = json.dumps(call["parameters" if "parameters" in call else "arguments"])
    if layout.arguments_as_text:
        call["arguments"] = written
    whole = f"{start}{json.dumps(call)}{end}"
    expected = [ToolCall("get_time", written)]
    assert layout.parse(whole, {"get_time"}) == ("", expected)
    prefixed = f"Let me check. {whole}"  # text before a call: only where a marker opens calls
    assert layout.parse(prefixed, {"get_time"}) == (("Let me check.", expected) if start else (prefixed, []))
    assert layout.parse(whole, {"other"}) == (whole, [])


def test_a_template_without_tools_has_no_tool_call_format(smol_engine):
    assert smol_engine.tool_call_format is None
    assert ToolCallFormat.of_template("{% for m in messages %}{{ m.content }}{% endfor %}", None, None, []) is None
    with pytest.raises(ValueError, match="does not write tool calls"):
        smol_engine.chat_ids([{"role": "user", "content": "hi"}], tools=[WEATHER])


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    """The tiny random model with a chat template that writes tool calls."""
    shape = dataclasses.replace(get_shape("tiny"), block_size=2048)  # the tools' JSON is a token a byte
    weights = make_random_checkpoint(shape, tmp_path_factory.mktemp("tools"), dtype=torch.float32, seed=5)
    config = dataclasses.replace(load_checkpoint_config(weights.parent), chat_template=TOOLS_TEMPLATE)
    (weights.parent / "config.json").write_text(config.to_json())
    server = Server("--checkpoint_path", str(weights.parent), "--max_batch", "2", "--max_seq_length", "1536",
                    "--model_name", "tools")  # fmt: skip
    yield server
    server.stop()


def check_calls(calls, tools) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def ask_tools(client, messages: list[dict], tools: list[dict], **options):
    """The tools server's answer to ``messages`` with ``tools`` (OpenAI's client)."""
    return client.chat.completions.create(model="tools", messages=messages, tools=tools, **options)


def test_a_tool_call_round_trip(tools_server):
    """The model is asked for a call (required), its calls come back parsed from the template's format; the call and
    the tool's result go back in the conversation, rendered by the template, and the model answers."""
    client = tools_server.client()
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask_tools(
        client,
        question,
        [WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: greedy, a random model would write calls without end
        max_tokens=120,
        temperature=0,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    check_calls(message.tool_calls, [WEATHER, CLOCK])
    call = message.tool_calls[0]
    history = [
        *question,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    final = ask_tools(client, history, [WEATHER, CLOCK], max_tokens=8, temperature=0, tool_choice="none")
    assert isinstance(final.choices[0].message.content, str) and not final.choices[0].message.tool_calls
    status, body = tools_server.request(
        "/tokenize", json.dumps({"messages": history}).encode(), {"Content-Type": "application/json"}
    )
    rendered = tools_server.request(
        "/detokenize", json.dumps({"tokens": body["tokens"]}).encode(), {"Content-Type": "application/json"}
    )[1]["prompt"]
    assert status == 200
    assert f'<call>{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}</call>' in rendered
    assert f"<|tool|>{call.function.name}: sunny, 21 C" in rendered


def test_named_single_and_streamed_tool_calls(tools_server):
    client = tools_server.client()
    question = [{"role": "user", "content": "What time is it?"}]
    named = ask_tools(
        client,
        question,
        [WEATHER, CLOCK],
        max_tokens=120,
        temperature=0.8,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert [call.function.name for call in named.choices[0].message.tool_calls] == ["get_time"]
    single = ask_tools(
        client,
        question,
        [WEATHER, CLOCK],
        max_tokens=200,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=4,
    )
    assert len(single.choices[0].message.tool_calls) == 1
    chunks = ask_tools(
        client,
        question,
        [WEATHER],
        max_tokens=240,
        tool_choice="required",
        temperature=1.0,
        seed=SEVERAL_CALLS_SEED,
        stream=True,
    )
    deltas, reasons = [], []
    for chunk in chunks:
        choice = chunk.choices[0]
        deltas += choice.delta.tool_calls or []
        assert not choice.delta.content
        reasons += [choice.finish_reason] if choice.finish_reason else []
    assert reasons == ["tool_calls"] and len(deltas) > 1
    assert [delta.index for delta in deltas] == list(range(len(deltas)))
    check_calls(deltas, [WEATHER])


# --- the server on the default model, with the official client ----------------------------------------------------


@pytest.fixture(scope="module")
def smol_server(smollm2_checkpoint):
    server = Server("--checkpoint_path", str(smollm2_checkpoint), "--max_batch", "2", "--model_name", SMOL)
    yield server
    server.stop()


class Colour(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float = pydantic.Field(ge=0, le=40)


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=40)
    city: City


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)
    favourite: Colour
    address: Address


class Scores(pydantic.BaseModel):
    subject: str = pydantic.Field(max_length=20)
    marks: list[int] = pydantic.Field(min_length=1, max_length=4)
    grade: Colour


@pytest.mark.parametrize(
    "model, question",
    [(City, "Tell me about Paris."), (Person, "Describe a person and where they live."),
     (Scores, "Give me a student's marks in maths.")],
)  # fmt: skip
def test_parse_gives_a_valid_pydantic_instance(smol_server, model, question):
    """``chat.completions.parse``: nested objects, an enum, arrays and bounded numbers, validated by the client's
    Pydantic model and by jsonschema against the model's own schema."""
    completion = smol_server.client().chat.completions.parse(
        model=SMOL, messages=[{"role": "user", "content": question}], response_format=model, max_tokens=120,
        temperature=0,
    )  # fmt: skip
    message = completion.choices[0].message
    assert isinstance(message.parsed, model) and completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), model.model_json_schema())


def test_the_serving_guides_structured_output_example_runs_as_written(smol_server, capsys):
    guide = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    section = guide[guide.index("## Structured output and tool calls") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(code.replace("http://127.0.0.1:8000", smol_server.url), {})  # the guide's own code
    assert re.fullmatch(r"name='.+' country='.+' population_millions=[\d.]+\n", capsys.readouterr().out)


def test_json_object_answers_parse_whole_and_streamed_and_in_completions(smol_server):
    client = smol_server.client()
    messages = [{"role": "user", "content": "Describe Rome in JSON: its name and its country."}]
    whole = client.chat.completions.create(
        model=SMOL, messages=messages, response_format={"type": "json_object"}, max_tokens=120, temperature=0
    )
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model=SMOL,
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == whole.choices[0].message.content
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    completion = client.completions.create(
        model=SMOL, prompt="A person: ", max_tokens=60, temperature=0, extra_body={"response_format": schema}
    )
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


BAD = [
    ({"response_format": {"type": "yaml"}}, "response_format", "must be an object whose type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}},
     "response_format", "Invalid type: banana"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format", "must be a JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}},
     "response_format", "no end"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": list(range(5000))}}}},
     "response_format", "5000 enum values"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": any_of(2100)}}},
     "response_format", "max is 2000"),
    ({"tools": [WEATHER]}, "tools", "does not write tool calls"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]", "letters, digits"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0]", "JSON object"),
]  # fmt: skip


def test_bad_inputs_get_one_clear_400_and_another_stream_goes_on(smol_server):
    client = smol_server.client()
    messages = [{"role": "user", "content": "Tell me a story about a dragon."}]
    expected = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=40, temperature=0)
    streamed: list[str] = []

    def watch() -> None:
        stream = client.chat.completions.create(
            model=SMOL, messages=messages, max_tokens=40, temperature=0, stream=True
        )
        streamed.extend(chunk.choices[0].delta.content or "" for chunk in stream)

    watcher = threading.Thread(target=watch)
    watcher.start()
    smol_server.wait_for(lambda health: health["busy"] == 1)
    base = {"model": SMOL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for fields, param, message in BAD:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**(base | fields))
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
        assert message in err.value.body["message"] and err.value.body["type"] == "invalid_request_error"
    watcher.join(120)
    assert "".join(streamed) == expected.choices[0].message.content
    assert smol_server.health()["status"] == "ok"
