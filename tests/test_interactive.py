"""`gpt-fast chat`'s loop: the conversation is kept, /reset and /exit, and Ctrl-C stops an answer, not the chat."""

import pytest

from gpt_fast.engine.engine import Engine
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.jobs.chat import answer, chat_loop

GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def engine(smollm2_checkpoint):
    return Engine.load(smollm2_checkpoint, device="cpu")


def test_chat_loop_keeps_the_conversation(engine, monkeypatch):
    written = []
    turns = iter(["What is the capital of France?", "And of Italy?", "/exit"])
    seen = []
    original = engine.chat_ids
    monkeypatch.setattr(
        engine, "chat_ids", lambda messages: seen.append([dict(m) for m in messages]) or original(messages)
    )
    chat_loop(engine, GREEDY, 30, lambda prompt: next(turns), written.append)
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert "Paris" in seen[1][1]["content"]
    assert "Rome" in "".join(written)


def test_reset_starts_over_with_the_system_message(engine, monkeypatch):
    turns = iter(["Hi", "/reset", "Hello", "/exit"])
    seen = []
    original = engine.chat_ids
    monkeypatch.setattr(
        engine, "chat_ids", lambda messages: seen.append([dict(m) for m in messages]) or original(messages)
    )
    written = []
    chat_loop(engine, GREEDY, 5, lambda prompt: next(turns), written.append, system="Be brief.")
    assert [[m["role"] for m in messages] for messages in seen] == [["system", "user"], ["system", "user"]]
    assert "(a new conversation, with the system message)\n" in written


def test_an_answer_cut_by_max_new_tokens_is_marked(engine):
    written = []
    text = answer(engine, engine.chat_ids([{"role": "user", "content": "Tell me a story."}]), 4, GREEDY, written.append)
    assert "".join(written) == f"{text} [cut: --max_new_tokens 4 reached]\n"
    written.clear()
    ids = engine.chat_ids([{"role": "user", "content": "Say hi."}])
    text = answer(engine, ids, 60, GREEDY, written.append)
    assert "".join(written) == f"{text}\n"  # ended by its stop token within 60


class InterruptedStream:
    """Stands in for the engine: two pieces of an answer, then Ctrl-C."""

    def generate_ids(self, ids, max_new_tokens, sampling, on_text):
        on_text("Paris")
        on_text(" is")
        raise KeyboardInterrupt


def test_ctrl_c_stops_the_answer_and_keeps_what_was_said():
    written = []
    assert answer(InterruptedStream(), [1, 2], 10, GREEDY, written.append) == "Paris is"
    assert "".join(written) == "Paris is [stopped]\n"


def test_ctrl_c_at_the_prompt_and_end_of_input(engine):
    events = iter([KeyboardInterrupt, EOFError])

    def read(prompt):
        raise next(events)

    written = []
    chat_loop(engine, GREEDY, 5, read, written.append)  # returns at end of input, not at Ctrl-C
    assert written[-2:] == ["\n", "\n"]


def test_a_turn_too_long_for_the_context_starts_over(engine):
    turns = iter(["word " * 9000, "/exit"])
    written = []
    chat_loop(engine, GREEDY, 5, lambda prompt: next(turns), written.append)
    assert any("exceeds the model's context" in line and "starting a new conversation" in line for line in written)


def test_a_message_the_template_refuses_is_left_out(engine, monkeypatch):
    turns = iter(["bad \udcff text", "Hi", "/exit"])
    seen = []
    original = engine.chat_ids
    monkeypatch.setattr(
        engine, "chat_ids", lambda messages: seen.append([dict(m) for m in messages]) or original(messages)
    )
    written = []
    chat_loop(engine, GREEDY, 3, lambda prompt: next(turns), written.append)
    assert any("not valid UTF-8" in line and "left out" in line for line in written)
    assert [m["content"] for m in seen[-1]] == ["Hi"]
