"""Incremental text: pieces that add up to the decoded text, and stop strings cut out of a stream."""

import pytest

from gpt_fast.text.textstream import StopStrings, TextStream


class Bytes:
    """A tokenizer whose tokens are single bytes (an incomplete UTF-8 sequence decodes to U+FFFD)."""

    def decode(self, ids, skip_special=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_held_back_bytes_come_out_once_complete_or_at_the_end():
    pieces = []
    stream = TextStream(Bytes(), [], pieces.append)
    for byte in "aé".encode() + "€".encode()[:2]:
        stream.push(byte)
    assert pieces == ["a", "é"]  # the euro sign's first two bytes wait for the third
    stream.flush()
    assert "".join(pieces) == Bytes().decode("aé".encode() + "€".encode()[:2])


def feed(stops, pieces):
    cut = StopStrings(stops)
    out = [cut.push(piece) for piece in pieces]
    return out, cut


def test_a_stop_string_split_over_pieces_is_held_back_and_cut():
    out, cut = feed(["STOP"], ["hello S", "T", "O", "P and more"])
    assert out == ["hello ", "", "", ""] and cut.stopped


def test_text_that_turns_out_not_to_stop_is_given_out():
    out, cut = feed(["STOP"], ["a ST", "ORM", " b"])
    assert "".join(out) == "a STORM b" and out[0] == "a " and not cut.stopped


def test_the_first_of_several_stop_strings_wins():
    out, cut = feed(["world", "lo w"], ["hello world"])
    assert out == ["hel"] and cut.stopped


def test_held_back_text_is_flushed_at_the_end():
    out, cut = feed(["</end>"], ["x </e"])
    assert out == ["x "] and cut.flush() == "</e" and not cut.stopped


@pytest.mark.parametrize("text", ["", "no stops at all"])
def test_no_stop_strings_hold_nothing_back(text):
    out, _ = feed([], [text])
    assert out == [text]
