"""The OpenAI API's chat and completion requests, checked field by field into a batching Request, and its responses.

Anything wrong with a request is an :class:`APIError` carrying the status and OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``). Fields OpenAI defines that this server cannot honour
(``suffix``, ``best_of``, ...) are refused by name rather than ignored, and so is any field OpenAI does not define
(as OpenAI does). ``response_format``, ``tools`` and ``tool_choice``: :mod:`gpt_fast.serve.structured`. The OpenAI
fields that change no answer (:data:`IGNORED_FIELDS`: request metadata, storage, service tier, end-user id,
``parallel_tool_calls`` without tools) are checked, then accepted and named in the server's log once, as vLLM does.
``n`` choices per prompt (each its own request, seeded ``seed``, ``seed + 1``, ...), ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` apply per request in the batched step
(:class:`gpt_fast.generation.options.LogitAdjustments`). Extensions: ``top_k``, ``min_p``, ``repetition_penalty``;
token ids in ``stop`` and as ``prompt``; ``ignore_eos`` (generate ``max_tokens`` whatever the model's stop tokens:
for benchmarks); vLLM's ``/tokenize`` and ``/detokenize`` (:func:`tokenize`, :func:`detokenize`).

Completions take several prompts in one request (a choice each, in order, answered whole) and ``echo``: the prompt
before each answer, with ``logprobs`` the prompt tokens' log-probabilities too (the first one null, as OpenAI gives
it), and ``max_tokens: 0`` to score a prompt without generating: what lm-evaluation-harness's ``local-completions``
sends for its log-likelihood tasks.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gpt_fast.engine.batcher import MAX_STOP_TEXTS, Finished, Request, TokenLogprob
from gpt_fast.generation.options import (
    MAX_BIAS,
    MAX_BIASED,
    MAX_PENALTY,
    LogitAdjustments,
    OutputConstraint,
    SamplingConfig,
    ToolSpec,
)
from gpt_fast.serve.errors import APIError
from gpt_fast.serve.structured import (
    ToolCallList,
    Tools,
    response_format,
    tool_call_objects,
    tool_fields,
    tool_finish,
    tools_of,
)

MAX_TEMPERATURE = 2.0  # OpenAI's range is 0..2
CHAT_TOP_LOGPROBS = 20  # OpenAI's limits for top_logprobs (chat) and logprobs (completions)
COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 16  # n
MAX_SEED = 2**63 - 1
MAX_METADATA = 16  # OpenAI's limits for metadata: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer" is OpenAI's newer name for "system"
COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "user",
        "logprobs",
        "ignore_eos",
        "min_p",
        "repetition_penalty",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "response_format",
    }
)
IGNORED_FIELDS = ("metadata", "store", "service_tier", "user", "parallel_tool_calls")  # they change no answer
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}


@dataclass(frozen=True)
class Context:
    """What requests are checked against: the served model's id, its context per slot and vocabulary, and how
    text and conversations (with tools) become token ids (``chat_ids`` None: the model has no chat template). Tool
    calls as the chat template writes them (``tool_marker`` None: it writes none): the text that opens them in a
    streamed answer (empty: none visible), the constraint of an answer of calls, and the calls an answer makes."""

    model_id: str
    max_seq_length: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    chat_ids: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]] | None
    tokenize: Callable[[str, bool], list[int]]  # text, with the checkpoint's special tokens (BOS) or without
    detokenize: Callable[[list[int]], str]  # special tokens written out
    tool_marker: str | None = None
    # tools, the one function named, several calls allowed, or else a document of this constraint
    tool_constraint: (
        Callable[[Sequence[ToolSpec], str | None, bool, OutputConstraint | None], OutputConstraint] | None
    ) = None
    parse_tool_calls: Callable[[Sequence[int], Collection[str]], tuple[str, ToolCallList]] | None = None


@dataclass(frozen=True)
class Call:
    """A checked request: what to generate (a request per choice), and how to answer."""

    chat: bool
    requests: tuple[Request, ...]
    stream: bool
    include_usage: bool
    ignored: tuple[str, ...] = ()  # the IGNORED_FIELDS the request gave
    echo: tuple[str, ...] | None = None  # completions with echo: each choice's prompt text, before its answer
    tools: Tools | None = None  # chat: the functions the model may call (their calls read from each answer)
    constraint_param: str | None = None  # the field the requests' constraint comes from

    @property
    def top_logprobs(self) -> int | None:
        return self.requests[0].top_logprobs


class Fields:
    """A request body's fields, each read with its type and range checked (absent and null are the same)."""

    def __init__(self, body: Any, known: frozenset[str]) -> None:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - known)
        if unknown:
            raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def number(self, name: str, default: float, low: float, high: float) -> float:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise APIError(400, f"{name} must be a number from {low:g} to {high:g}, got {value!r}", param=name)
        return float(value)

    def integer(self, name: str, low: int, high: int) -> int | None:
        value = self.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise APIError(400, f"{name} must be an integer from {low} to {high}, got {value!r}", param=name)
        return value

    def boolean(self, name: str) -> bool:
        value = self.get(name)
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"{name} must be true or false, got {value!r}", param=name)
        return bool(value)

    def ignored(self) -> tuple[str, ...]:
        """The :data:`IGNORED_FIELDS` given (``parallel_tool_calls`` only without tools), once checked to be of
        OpenAI's types."""
        metadata = self.get("metadata")
        if metadata is not None and not valid_metadata(metadata):
            message = (
                f"metadata must be an object of at most {MAX_METADATA} string values (keys up to "
                f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})"
            )
            raise APIError(400, message, param="metadata")
        for name in ("service_tier", "user"):
            if self.get(name) is not None and not isinstance(self.get(name), str):
                raise APIError(400, f"{name} must be a string", param=name)
        self.boolean("store")
        self.boolean("parallel_tool_calls")
        honoured = {"parallel_tool_calls"} if self.get("tools") is not None else set()
        return tuple(name for name in IGNORED_FIELDS if self.get(name) is not None and name not in honoured)

    def unsupported(self, name: str, allowed: Sequence[Any], what: str) -> None:
        """Refuse ``name`` unless absent or one of ``allowed`` (the values that change nothing)."""
        value = self.get(name)
        if value is not None and not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise APIError(400, f"{name} is not supported by this server: {what}", param=name)


def parse_chat(body: Any, ctx: Context) -> Call:
    """A ``/v1/chat/completions`` body as a Call."""
    fields = Fields(body, CHAT_FIELDS)
    check_model(fields, ctx)
    fields.boolean("parallel_tool_calls")
    tools = tools_of(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls") is not False)
    if tools is not None and ctx.tool_marker is None:
        raise APIError(
            400, "this model's chat template does not write tool calls: it cannot be given tools", param="tools"
        )
    prompt = chat_prompt(fields, ctx, tools)
    new_max, old_max = fields.integer("max_completion_tokens", 1, 2**31), fields.integer("max_tokens", 1, 2**31)
    if new_max is not None and old_max is not None and new_max != old_max:
        raise APIError(400, "max_completion_tokens and max_tokens differ; give one", param="max_tokens")
    logprobs = fields.boolean("logprobs")
    top = fields.integer("top_logprobs", 0, CHAT_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (top or 0) if logprobs else None
    max_tokens = new_max if new_max is not None else old_max
    answer = response_format(fields.get("response_format"))
    constraint = answer_constraint(answer, tools, ctx)
    call = make_call(fields, ctx, True, [prompt], max_tokens, top_logprobs, constraint=constraint)
    return dataclasses.replace(call, tools=tools, constraint_param="response_format" if answer else "tools")


def answer_constraint(answer: OutputConstraint | None, tools: Tools | None, ctx: Context) -> OutputConstraint | None:
    """What an answer is held to: calls of the tools where they are forced, calls or the ``response_format``'s
    document where the model chooses, else the document (or nothing)."""
    if tools is None or (answer is None and not tools.forced):
        return answer
    return ctx.tool_constraint(tools.specs, tools.only, tools.parallel, None if tools.forced else answer)


def parse_completion(body: Any, ctx: Context) -> Call:
    """A ``/v1/completions`` body as a Call: a choice per prompt."""
    fields = Fields(body, COMPLETION_FIELDS)
    check_model(fields, ctx)
    texts, prompts = completion_prompts(fields.get("prompt"), ctx)
    fields.unsupported("suffix", [], "no text after the completion")
    fields.unsupported("best_of", [1], "one completion per request")
    echo = fields.boolean("echo")
    top_logprobs = fields.integer("logprobs", 0, COMPLETION_LOGPROBS)
    max_tokens = fields.integer("max_tokens", 0 if echo else 1, 2**31)
    scored = top_logprobs if echo and top_logprobs is not None else 0 if max_tokens == 0 else None
    constraint = response_format(fields.get("response_format"))
    call = make_call(fields, ctx, False, prompts, max_tokens, top_logprobs, scored, constraint)
    call = dataclasses.replace(call, constraint_param="response_format")
    if not echo:
        return call
    echoed = tuple(ctx.detokenize(ids) if text is None else text for text, ids in zip(texts, prompts, strict=True))
    return dataclasses.replace(call, echo=echoed)


def check_model(fields: Fields, ctx: Context) -> None:
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "you must provide a model parameter (a string)", param="model")
    if model != ctx.model_id:
        message = f"The model `{model}` does not exist (this server has {ctx.model_id})"
        raise APIError(404, message, param="model", code="model_not_found")


def make_call(
    fields: Fields,
    ctx: Context,
    chat: bool,
    prompts: list[list[int]],
    max_tokens: int | None,
    top_logprobs: int | None,
    prompt_logprobs: int | None = None,
    constraint: OutputConstraint | None = None,
) -> Call:
    """The fields chat and completions share, and ``n`` requests for each prompt (each held to ``constraint``)."""
    n = fields.integer("n", 1, MAX_CHOICES) or 1
    adjust = adjustments(fields, ctx.vocab_size)
    ignored = fields.ignored()
    sampling = SamplingConfig(
        temperature=fields.number("temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_k=fields.integer("top_k", 1, 2**31),
        top_p=fields.number("top_p", 1.0, 0.0, 1.0) or math.nextafter(0.0, 1.0),
    )
    stop_texts, stop_ids = stops(fields.get("stop"), ctx.vocab_size)
    stream = fields.boolean("stream")
    seed, ignore_eos = fields.integer("seed", -MAX_SEED - 1, MAX_SEED), fields.boolean("ignore_eos")
    requests = tuple(
        Request(
            prompt_ids=tuple(prompt),
            max_new_tokens=token_budget(len(prompt), max_tokens, ctx, "messages" if chat else "prompt"),
            sampling=sampling,
            seed=None if seed is None else (seed + choice + MAX_SEED + 1) % (2 * MAX_SEED + 2) - MAX_SEED - 1,
            stop_ids=stop_ids,
            stop_texts=stop_texts,
            ignore_eos=ignore_eos,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            adjust=adjust,
            constraint=constraint,
        )
        for prompt in prompts
        for choice in range(n)
    )
    return Call(chat, requests, stream, include_usage(fields.get("stream_options"), stream), ignored)


def adjustments(fields: Fields, vocab_size: int) -> LogitAdjustments:
    """Penalties, ``logit_bias`` (OpenAI's object of token ids, as strings, to a bias) and min-p."""
    bias = fields.get("logit_bias")
    if bias is not None and not (
        isinstance(bias, dict)
        and len(bias) <= MAX_BIASED
        and all(key.isdigit() and int(key) < vocab_size for key in bias)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= MAX_BIAS for v in bias.values())
    ):
        message = (
            f"logit_bias must map at most {MAX_BIASED} token ids in 0..{vocab_size - 1} (as strings) to numbers "
            f"from {-MAX_BIAS:g} to {MAX_BIAS:g}"
        )
        raise APIError(400, message, param="logit_bias")
    return LogitAdjustments(
        presence_penalty=fields.number("presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=fields.number("frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=fields.number("repetition_penalty", 1.0, 0.01, 100.0),
        min_p=fields.number("min_p", 0.0, 0.0, 1.0),
        logit_bias=tuple((int(key), float(value)) for key, value in (bias or {}).items()),
    )


def valid_metadata(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) <= MAX_METADATA
        and all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY for k in value)
        and all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE for v in value.values())
    )


TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "return_token_strs"})  # fmt: skip


def tokenize(body: Any, ctx: Context) -> dict[str, Any]:
    """vLLM's ``/tokenize``: ``prompt`` (text; ``add_special_tokens``, default true: the checkpoint's BOS) or
    ``messages`` (a conversation through the chat template, ready for the answer) as token ids, with their count
    and the context per slot (``max_model_len``); ``return_token_strs``: each token's text too."""
    fields = Fields(body, TOKENIZE_FIELDS)
    if fields.get("model") is not None:
        check_model(fields, ctx)
    prompt, messages = fields.get("prompt"), fields.get("messages")
    if (prompt is None) == (messages is None):
        raise APIError(400, "give either prompt (a string) or messages", param="prompt")
    if messages is not None:
        if fields.get("add_generation_prompt") is False:
            raise APIError(400, "the chat template is rendered ready for the answer", param="add_generation_prompt")
        ids = chat_prompt(fields, ctx, None)
    elif isinstance(prompt, str):
        special = fields.get("add_special_tokens")
        ids = encoded(lambda: ctx.tokenize(prompt, special is None or fields.boolean("add_special_tokens")))
    else:
        raise APIError(400, "prompt must be a string", param="prompt")
    strings = [ctx.detokenize([i]) for i in ids] if fields.boolean("return_token_strs") else None
    return {"count": len(ids), "max_model_len": ctx.max_seq_length, "tokens": ids, "token_strs": strings}


def detokenize(body: Any, ctx: Context) -> dict[str, Any]:
    """vLLM's ``/detokenize``: ``tokens`` (ids of the vocabulary) as text, special tokens written out."""
    fields = Fields(body, frozenset({"model", "tokens"}))
    if fields.get("model") is not None:
        check_model(fields, ctx)
    ids = fields.get("tokens")
    if not isinstance(ids, list) or not all(valid_id(t, ctx.vocab_size) for t in ids):
        raise APIError(400, f"tokens must be an array of token ids in 0..{ctx.vocab_size - 1}", param="tokens")
    return {"prompt": ctx.detokenize(ids)}


def valid_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def encoded(encode: Callable[[], list[int]]) -> list[int]:
    """``encode()``, a text the tokenizer refuses (invalid text) a 400."""
    try:
        return encode()
    except ValueError as err:
        raise APIError(400, str(err), param="prompt") from None


def chat_prompt(fields: Fields, ctx: Context, tools: Tools | None) -> list[int]:
    """The prompt ids of the request's ``messages`` (and ``tools``) through the chat template."""
    messages = chat_messages(fields.get("messages"))
    if ctx.chat_ids is None:
        raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        return ctx.chat_ids(messages, None if tools is None else list(tools.functions))
    except ValueError as err:  # the template refused the conversation, or a message is not valid text
        raise APIError(400, str(err), param="messages") from None


MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """The conversation as ``{"role", "content"}`` dicts of text (content given as a string, or as an array of text
    parts, joined by newlines), with an assistant's tool calls and a tool message's call id
    (:func:`gpt_fast.serve.structured.tool_fields`)."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "messages must be a non-empty array", param="messages")
    messages = []
    calls: dict[str, str] = {}  # the assistant's calls so far: id -> function name
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        extra = sorted(set(message) - MESSAGE_FIELDS)
        if extra:
            raise APIError(400, f"{where}.{extra[0]} is not supported by this server", param=f"{where}.{extra[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        fields = tool_fields(message, where, calls)
        content = message_text(message.get("content"), where, optional="tool_calls" in fields)
        messages.append({"role": "system" if role == "developer" else role, "content": content} | fields)
    return messages


def message_text(content: Any, where: str, optional: bool) -> str | None:
    """A message's text: a string, or an array of text parts (joined by newlines); None where ``optional`` (an
    assistant's message of tool calls)."""
    if content is None and optional:
        return None
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        content = "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or an array of text parts", param=f"{where}.content")
    return content


def completion_prompts(value: Any, ctx: Context) -> tuple[list[str | None], list[list[int]]]:
    """The prompts' texts (None for token ids) and token ids: one prompt, or an array of them."""
    several = isinstance(value, list) and value and all(isinstance(item, (str, list)) for item in value)
    items = value if several else [value]
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts in one request, got {len(items)}", param="prompt")
    return [item if isinstance(item, str) else None for item in items], [completion_prompt(item, ctx) for item in items]


def completion_prompt(value: Any, ctx: Context) -> list[int]:
    """A prompt's token ids: a string (encoded as ``gpt-fast generate --prompt`` encodes it) or token ids."""
    if isinstance(value, str):
        ids = encoded(lambda: ctx.encode(value))
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        ids = value
        if not all(0 <= t < ctx.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in 0..{ctx.vocab_size - 1}", param="prompt")
    else:
        raise APIError(400, "prompt must be a string, an array of token ids, or an array of those", param="prompt")
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
    return ids


def token_budget(prompt_tokens: int, max_tokens: int | None, ctx: Context, param: str) -> int:
    """The answer's budget: ``max_tokens``, or what the context leaves after the prompt."""
    room = ctx.max_seq_length - prompt_tokens
    limit = f"This model's maximum context length is {ctx.max_seq_length} tokens"
    if room < 1:
        message = f"{limit}, and the prompt is {prompt_tokens} tokens long: no room for an answer"
        raise APIError(400, message, param=param, code="context_length_exceeded")
    if max_tokens is None:
        return room
    if max_tokens > room:
        message = (
            f"{limit}; the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) together ask for "
            f"{prompt_tokens + max_tokens}"
        )
        raise APIError(400, message, param="max_tokens", code="context_length_exceeded")
    return max_tokens


def stops(value: Any, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``stop``: a string, or an array of strings (stop texts) and integers (stop token ids, an extension)."""
    items = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP_TEXTS:
        raise APIError(400, f"stop must be a string or an array of at most {MAX_STOP_TEXTS} stops", param="stop")
    texts, ids = [], []
    for item in items:
        if isinstance(item, str) and item:
            texts.append(item)
        elif valid_id(item, vocab_size):
            ids.append(item)
        else:
            message = f"each stop must be a non-empty string or a token id in 0..{vocab_size - 1}, got {item!r}"
            raise APIError(400, message, param="stop")
    return tuple(texts), tuple(ids)


def include_usage(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise APIError(400, "stream_options must be an object with include_usage", param="stream_options")
    usage = value.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError(400, "stream_options.include_usage must be true or false", param="stream_options")
    return usage


def usage(ends: Sequence[Finished]) -> dict[str, int]:
    """The tokens of every choice's prompt and answer."""
    prompt = sum(finished.prompt_tokens for finished in ends)
    completion = sum(finished.completion_tokens for finished in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Responder:
    """The response objects of one call: the whole answer, or its stream of chunks; a choice per request, in order.
    A choice's log-probabilities are items of :class:`TokenLogprob`, the echoed prompt's first."""

    def __init__(
        self,
        call: Call,
        model_id: str,
        parse_tool_calls: Callable[[Sequence[int], Collection[str]], tuple[str, ToolCallList]] | None = None,
    ) -> None:
        self.call, self.model, self.parse_tool_calls = call, model_id, parse_tool_calls
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.text_offset = [0] * len(call.requests)  # completions' logprobs: where each choice's next token starts

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(self, ends: Sequence[tuple[Finished, list[TokenLogprob]]]) -> dict[str, Any]:
        """The whole answer: each choice's end and log-probabilities, in order."""
        choices = []
        for index, (finished, logprobs) in enumerate(ends):
            reason = finished.finish_reason
            if self.call.chat:
                content, calls = self.tool_calls(finished)
                message = {"role": "assistant", "content": content}
                if calls:
                    message, reason = message | {"tool_calls": tool_call_objects(calls)}, tool_finish(reason)
                choice = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": self.echoed(index) + finished.text}
            choice |= {"logprobs": self._logprobs(index, logprobs), "finish_reason": reason}
            choices.append(choice)
        body = self._object("chat.completion" if self.call.chat else "text_completion", choices)
        body["usage"] = usage([finished for finished, _ in ends])
        return body

    def echoed(self, index: int) -> str:
        return "" if self.call.echo is None else self.call.echo[index]

    def tool_calls(self, finished: Finished) -> tuple[str | None, ToolCallList]:
        """A chat answer's text (None when it is only calls) and the calls it makes (none without tools; the first
        alone where several are not allowed)."""
        tools = self.call.tools
        if tools is None:
            return finished.text, []
        content, calls = self.parse_tool_calls(finished.ids, tools.names)
        if not calls:
            return finished.text, []
        return content or None, calls if tools.parallel else calls[:1]

    def tool_calls_chunk(self, calls: ToolCallList, index: int) -> dict[str, Any]:
        """A chunk of a stream holding choice ``index``'s calls, whole."""
        objects = [{"index": i} | call for i, call in enumerate(tool_call_objects(calls))]
        body = self._object("chat.completion.chunk", [{"index": index, "delta": {"tool_calls": objects}}])
        body["choices"][0] |= {"logprobs": None, "finish_reason": None}
        if self.call.include_usage:
            body["usage"] = None
        return body

    def chunk(
        self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None = None, index: int = 0
    ) -> dict[str, Any]:
        """A chunk of a stream: new text of choice ``index`` (chat: the first chunk also names the role), or its end."""
        if self.call.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            body = self._object("chat.completion.chunk", [{"index": index, "delta": delta}])
        else:
            body = self._object("text_completion", [{"index": index, "text": text}])
        body["choices"][0] |= {"logprobs": self._logprobs(index, logprobs), "finish_reason": finish_reason}
        if self.call.include_usage:
            body["usage"] = None
        return body

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        """Chat streams start by naming the role, for each choice."""
        body = self.chunk("", [], index=index)
        body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return body

    def usage_chunk(self, ends: Sequence[Finished]) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        kind = "chat.completion.chunk" if self.call.chat else "text_completion"
        return self._object(kind, []) | {"usage": usage(ends)}

    def _logprobs(self, index: int, items: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.call.top_logprobs is None:
            return None
        if self.call.chat:
            return {"content": [self._chat_logprob(item) for item in items], "refusal": None}
        offsets = []
        for item in items:
            offsets.append(self.text_offset[index])
            self.text_offset[index] += len(item.text)
        return {
            "tokens": [item.text for item in items],
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [None if item.logprob is None else {t: lp for _, t, lp in item.top} for item in items],
            "text_offset": offsets,
        }

    @staticmethod
    def _chat_logprob(item: TokenLogprob) -> dict[str, Any]:
        def entry(text: str, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

        return entry(item.text, item.logprob) | {"top_logprobs": [entry(text, lp) for _, text, lp in item.top]}
