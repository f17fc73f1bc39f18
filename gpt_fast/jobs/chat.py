"""`gpt-fast chat`: a multi-turn conversation that streams each answer as it is generated."""

from __future__ import annotations

from collections.abc import Callable

from gpt_fast.engine.engine import Engine, Message
from gpt_fast.generation.sampling import SamplingConfig

EXIT_WORDS = ("/exit", "/quit")
RESET_WORD = "/reset"
Read = Callable[[str], str]
Write = Callable[[str], None]


def check_can_chat(engine: Engine) -> None:
    """Before any weights are read: chatting needs a chat template."""
    if engine.chat_template is None:
        raise ValueError(
            f"{engine.checkpoint_dir} has no chat template, so it cannot chat: give chat a --checkpoint_path whose "
            "checkpoint has one (an instruct model's), or continue text with `gpt-fast generate --prompt TEXT`"
        )


def chat_loop(
    engine: Engine, sampling: SamplingConfig, max_new_tokens: int, read: Read, write: Write, system: str | None = None
) -> None:
    """Read user turns with ``read`` until end of input or /exit; /reset starts a new conversation. Ctrl-C while an
    answer streams stops that answer (what was written of it stays in the conversation); at the prompt it starts a
    new line.

    The whole conversation is rendered with the checkpoint's chat template and prefilled each turn."""
    check_can_chat(engine)
    start: list[Message] = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    write(f"Chatting with {engine.checkpoint_dir} ({RESET_WORD} starts over, {EXIT_WORDS[0]} or Ctrl-D ends)\n")
    while True:
        try:
            text = read("> ")
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:
            write("\n")
            continue
        if text.strip() in EXIT_WORDS:
            return
        if text.strip() == RESET_WORD:
            messages = list(start)
            write(f"(a new conversation{', with the system message' if system else ''})\n")
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids = engine.chat_ids(messages)
        except ValueError as err:  # the template refused the conversation (or the text is not valid UTF-8)
            write(f"{err}; that message is left out\n")
            messages.pop()
            continue
        try:
            engine.check_fits(ids, max_new_tokens)
        except ValueError as err:
            write(f"{err}; starting a new conversation ({RESET_WORD})\n")
            messages = list(start)
            continue
        messages.append({"role": "assistant", "content": answer(engine, ids, max_new_tokens, sampling, write)})


def answer(engine: Engine, ids: list[int], max_new_tokens: int, sampling: SamplingConfig, write: Write) -> str:
    """Stream the answer to ``ids``; return its text, cut short by Ctrl-C (marked ``[stopped]``) or by
    ``max_new_tokens`` (marked ``[cut: ...]``: it did not end with a stop token)."""
    pieces: list[str] = []

    def on_text(piece: str) -> None:
        write(piece)
        pieces.append(piece)

    try:
        new = engine.generate_ids(ids, max_new_tokens, sampling, on_text=on_text).tokens[0]
    except KeyboardInterrupt:
        write(" [stopped]")
    else:
        if len(new) >= max_new_tokens and new[-1] not in engine.stop_ids:
            write(f" [cut: --max_new_tokens {max_new_tokens} reached]")
    write("\n")
    return "".join(pieces)
