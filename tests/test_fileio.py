"""Output files: written whole through a temporary name nobody can plant a link at; standard output, devices and
pipes written through; links at the output path replaced, never followed."""

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from gpt_fast.util.fileio import atomic_path, check_output_file, file_lock, write_text_atomic


def test_a_file_is_replaced_whole_and_nothing_else_is_left(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_failed_write_leaves_what_was_there(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_link_to_a_regular_file_is_replaced_and_its_target_left(tmp_path):
    """Our choice: following it would let a link planted at a predictable output path redirect the write."""
    target = tmp_path / "target.json"
    target.write_text("precious")
    link = tmp_path / "m.json"
    link.symlink_to(target)
    write_text_atomic(check_output_file(link, "--metrics_json"), "metrics")
    assert not link.is_symlink() and link.read_text() == "metrics" and target.read_text() == "precious"


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    """The temporary folder's name is unpredictable; were it guessed and a link planted there, the exclusive
    creation would pass over it to a fresh name."""
    victim = tmp_path / "victim"
    victim.mkdir()
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    (tmp_path / ".m.json.guessed.tmp").symlink_to(victim)
    write_text_atomic(tmp_path / "m.json", "metrics")
    assert (tmp_path / "m.json").read_text() == "metrics" and list(victim.iterdir()) == []
    assert (tmp_path / ".m.json.guessed.tmp").is_symlink()


def test_the_temporary_folder_is_private(tmp_path):
    with atomic_path(tmp_path / "m.json") as tmp:
        assert oct(tmp.parent.stat().st_mode & 0o777) == "0o700"
        tmp.write_text("x")


def test_a_named_pipe_is_written_through(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    write_text_atomic(check_output_file(fifo, "--metrics_json"), "metrics")
    reader.join(60)
    assert received == ["metrics"] and fifo.is_fifo()


def test_dev_null_is_written_through():
    write_text_atomic(check_output_file(Path("/dev/null"), "--metrics_json"), "metrics")
    assert Path("/dev/null").is_char_device()


WRITE_TO = """
import sys
from pathlib import Path
from gpt_fast.util.fileio import check_output_file, write_text_atomic
print("printed first", flush=True)
write_text_atomic(check_output_file(Path(sys.argv[1]), "--metrics_json"), "metrics\\n")
"""


@pytest.mark.parametrize("name", ["/dev/stdout", "/proc/self/fd/1", "-"])
def test_standard_output_redirected_to_a_file_is_written_through(tmp_path, name):
    """Even when standard output is a regular file, /dev/stdout is written through it (after what was printed),
    never truncated or replaced."""
    log = tmp_path / "log"
    with log.open("w") as out:
        result = subprocess.run([sys.executable, "-c", WRITE_TO, name], stdout=out, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 0, result.stderr
    assert log.read_text() == "printed first\nmetrics\n"
    assert Path("/dev/stdout").is_symlink()


def test_standard_output_to_a_pipe_is_written_through():
    result = subprocess.run([sys.executable, "-c", WRITE_TO, "/dev/stdout"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "printed first\nmetrics\n"


def test_a_lock_is_exclusive_between_threads_and_removed_after(tmp_path):
    lock = tmp_path / "lock"
    waited = threading.Event()
    order = []

    def second():
        with file_lock(lock, waited.set):
            order.append("second")

    with file_lock(lock, lambda: pytest.fail("waited for nobody")):
        thread = threading.Thread(target=second)
        thread.start()
        assert waited.wait(60)
        order.append("first")
    thread.join(60)
    assert order == ["first", "second"] and not lock.exists()


def test_native_stderr_keeps_the_lines_that_do_not_match(capfd):
    import re

    from gpt_fast.util.fileio import native_stderr_without

    with native_stderr_without(re.compile(rb"noise")):
        os.write(2, b"noise 1\nkept\nnoise 2\n")
    assert capfd.readouterr().err == "kept\n"
