"""`gpt-fast chat`: a multi-turn conversation that streams each answer as it is generated."""

from __future__ import annotations

from collections.abc import Callable

from gpt_fast.runner import Engine
from gpt_fast.sampling import SamplingConfig

EXIT_WORDS = ("/exit", "/quit")
RESET_WORD = "/reset"


def chat_loop(
    engine: Engine, sampling: SamplingConfig, max_new_tokens: int, read: Callable[[str], str], system: str | None = None
) -> None:
    """Read user turns with ``read`` until end of input or /exit; /reset starts a new conversation.

    The whole conversation is rendered with the checkpoint's chat template and prefilled each turn."""
    if engine.config.chat_template is None:
        raise ValueError("this checkpoint has no chat template, so it cannot chat; use `gpt-fast generate --prompt`")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    engine.write(f"Chatting with {engine.checkpoint_dir} ({RESET_WORD} starts over, {EXIT_WORDS[0]} or Ctrl-D ends)\n")
    while True:
        try:
            text = read("> ")
        except EOFError:
            engine.write("\n")
            return
        if text.strip() in EXIT_WORDS:
            return
        if text.strip() == RESET_WORD:
            messages = list(start)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = engine.chat_ids(messages)
        try:
            engine.check_fits(ids, max_new_tokens)
        except ValueError as err:
            engine.write(f"{err}; starting a new conversation ({RESET_WORD})\n")
            messages = list(start)
            continue
        _, on_tokens = engine.stream_to(ids)
        result = engine.generate(ids, max_new_tokens, sampling, on_tokens=on_tokens)
        engine.write("\n")
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(result.tokens[0], skip_special=True)})
