"""Writing a checkpoint folder: whole or not at all, loadable, never into a foreign folder, one writer at a time,
and what a killed writer leaves cleaned by the next."""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gpt_fast.checkpoint.load import check_checkpoint, checkpoint_weights
from gpt_fast.convert import default_model, writer
from gpt_fast.convert.random_init import byte_tokenizer, make_random_checkpoint, random_weights
from gpt_fast.model.config import CONFIG_FILE, CheckpointConfig
from gpt_fast.model.shapes import get_shape

TINY = get_shape("tiny")
HF_FILE = "hf/model.safetensors"  # a downloaded source in the blog's layout, inside the output folder
NOTES = "notes.txt"  # a user's own file in a checkpoint folder


def write(out: Path, seed: int) -> Path:
    return make_random_checkpoint(TINY, out, dtype=torch.float32, seed=seed)


def write_default(out: Path, seed: int) -> Path:
    """:func:`write`, recording the card's sampling as the default model's conversion does."""
    path = write(out, seed)
    config = json.loads((out / "config.json").read_text())
    config["generation"] = dataclasses.asdict(default_model.CARD_SAMPLING)
    (out / "config.json").write_text(json.dumps(config))
    return path


def seed_of(out: Path) -> int:
    """The seed of the whole checkpoint in ``out``: its config's, after checking that its weights are that seed's."""
    config = check_checkpoint(out)
    seed = config.source["seed"]
    state = checkpoint_weights(out / config.weights, config)
    expected = random_weights(TINY, torch.float32, seed)
    assert all(torch.equal(state[name], expected[name]) for name in expected), f"{out} mixes two conversions"
    return seed


def hidden_entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def blog_layout(tmp_path):
    """checkpoints/ORG/NAME holding a converted checkpoint (seed 1), hf/ and a user's file."""
    out = tmp_path / "checkpoints" / "org" / "name"
    (out / "hf").mkdir(parents=True)
    (out / HF_FILE).write_bytes(b"downloaded weights")
    write(out, seed=1)
    (out / NOTES).write_text("mine")
    return out


def assert_kept(out: Path) -> None:
    assert (out / HF_FILE).read_bytes() == b"downloaded weights"
    assert (out / NOTES).read_text() == "mine"


def assert_whole(out: Path, seed: int | None = None) -> None:
    """``out`` holds one whole checkpoint (of ``seed`` if given) with hf/ and the user's file, nothing beside it."""
    found = seed_of(out)
    assert seed is None or found == seed
    assert_kept(out)
    assert hidden_entries(out.parent) == []


def test_a_new_folder_is_written_whole_and_nothing_else(tmp_path):
    out = tmp_path / "a" / "b"
    write(out, seed=3)
    assert seed_of(out) == 3
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.pth", "tokenizer.json"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~current_umask())
    assert hidden_entries(out.parent) == []


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_replacing_keeps_hf_and_the_users_files(blog_layout):
    write(blog_layout, seed=2)
    assert_whole(blog_layout, 2)


def test_the_blog_layout_holding_only_hf_is_converted_into(tmp_path):
    out = tmp_path / "name"
    (out / "hf").mkdir(parents=True)
    (out / HF_FILE).write_bytes(b"downloaded weights")
    write(out, seed=4)
    assert seed_of(out) == 4 and (out / HF_FILE).read_bytes() == b"downloaded weights"


def test_files_the_old_checkpoint_named_are_not_carried_over(blog_layout):
    config = json.loads((blog_layout / CONFIG_FILE).read_text())
    (blog_layout / "tokenizer.json").rename(blog_layout / "old-tokenizer.json")
    config["tokenizer"]["file"] = "old-tokenizer.json"
    (blog_layout / CONFIG_FILE).write_text(json.dumps(config))
    write(blog_layout, seed=2)
    assert not (blog_layout / "old-tokenizer.json").exists()
    assert_kept(blog_layout)


def test_a_linked_output_folder_stays_a_link(tmp_path):
    real = tmp_path / "disk" / "name"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    write(tmp_path / "link", seed=5)
    assert (tmp_path / "link").is_symlink() and seed_of(real) == 5


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "content, message",
    [
        ({"config.json": '{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": ""}, "not a gpt-fast"),
        ({"config.json": "{not json"}, "not a gpt-fast"),
        ({"paper.pdf": "", "hf/x": ""}, "it holds paper.pdf and no gpt-fast checkpoint"),
        ({"a": "", "b": "", "c": "", "d": ""}, r"it holds a, b, c, \.\.\. and no"),
    ],
    ids=["hugging-face-folder", "broken-config", "users-files", "many-files"],
)
def test_a_folder_that_is_not_a_checkpoint_is_never_written_into(tmp_path, content, message):
    out = tmp_path / "out"
    for name, text in content.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = snapshot(out)
    with pytest.raises(FileExistsError, match=f"refusing to write into {out}: .*{message}"):
        write(out, seed=1)
    with pytest.raises(FileExistsError, match="refusing"):  # also when asked past the early check
        writer.write_checkpoint(out, {}, lambda stage: pytest.fail("staged"))
    assert snapshot(out) == before and hidden_entries(tmp_path) == []


def test_an_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        write(tmp_path / "out", seed=1)
    with pytest.raises(NotADirectoryError, match=f"output folder {tmp_path / 'out'} is not a folder"):
        writer.write_checkpoint(tmp_path / "out", {}, lambda stage: pytest.fail("staged"))
    assert (tmp_path / "out").read_text() == "x"


def prepare_with_tokenizer_file(name: str):
    """A prepare step writing a random checkpoint's tokenizer whose config names the tokenizer file ``name``."""

    def prepare(stage):
        tokenizer, tok_config = byte_tokenizer(TINY.vocab_size)
        tokenizer.save(str(stage / "tokenizer.json"))
        return CheckpointConfig(model=TINY, tokenizer=dataclasses.replace(tok_config, file=name), dtype="float32")

    return prepare


@pytest.mark.parametrize(
    "tokenizer_file, drop, message",
    [
        (
            "tokenizer.json",
            "tok_embeddings.weight",
            r"{out}/model.pth: missing tensor\(s\): tok_embeddings.weight; unexpected tensor\(s\): renamed.weight",
        ),
        ("nowhere.json", None, "tokenizer file not found: {out}/nowhere.json"),
    ],
    ids=["missing-tensor", "missing-tokenizer"],
)
def test_what_generate_would_reject_is_not_written(blog_layout, tokenizer_file, drop, message):
    state = {("renamed.weight" if k == drop else k): v for k, v in random_weights(TINY, torch.float32, 2).items()}
    before = snapshot(blog_layout)
    with pytest.raises(
        ValueError,
        match="the converted checkpoint does not load, .* left as it was: " + message.format(out=blog_layout),
    ):
        writer.write_checkpoint(blog_layout, state, prepare_with_tokenizer_file(tokenizer_file))
    assert snapshot(blog_layout) == before and hidden_entries(blog_layout.parent) == []


class Killed(BaseException):
    """Stands for SIGKILL: raised at a chosen rename, with the clean-up that follows disabled."""


def stop_at(setattr_, step: int, stop) -> None:
    """Call ``stop()`` instead of the ``step``-th rename or exchange of the write (``setattr_`` patches them)."""
    calls = []
    real_rename, real_exchange = os.rename, writer.exchange

    def counted(real):
        def call(*args):
            calls.append(args)
            if len(calls) == step:
                stop()
            return real(*args)

        return call

    setattr_(os, "rename", counted(real_rename))
    setattr_(writer, "exchange", counted(real_exchange))


def raise_(error: type[BaseException]):
    def stop():
        raise error()

    return stop


def no_exchange(a, b):
    return False


# exchange: staging -> new, hf/ and notes.txt carried, exchange; fallback: the same (the exchange call fails),
# then NAME -> old, new -> NAME
STEPS = [("exchange", step) for step in range(1, 5)] + [("fallback", step) for step in range(1, 7)]


def write_stopped(out: Path, patch: pytest.MonkeyPatch, mode: str, step: int, error: type[BaseException]) -> None:
    """Write seed 2 into ``out``, stopped by ``error`` at the ``step``-th rename or exchange."""
    if mode == "fallback":
        patch.setattr(writer, "exchange", no_exchange)
    stop_at(patch.setattr, step, raise_(error))
    with pytest.raises(error):
        write(out, seed=2)


@pytest.mark.parametrize("mode, step", STEPS)
def test_ctrl_c_at_any_step_leaves_one_whole_checkpoint(blog_layout, monkeypatch, mode, step):
    with monkeypatch.context() as patch:
        write_stopped(blog_layout, patch, mode, step, KeyboardInterrupt)
    assert_whole(blog_layout, 2 if (mode, step) == ("fallback", 6) else 1)  # rolled forward if NAME is gone


@pytest.mark.parametrize("mode, step", STEPS)
def test_the_next_writer_finishes_what_a_killed_one_left(blog_layout, monkeypatch, mode, step):
    with monkeypatch.context() as patch:
        patch.setattr(writer, "clean_leftovers", lambda out: None)
        patch.setattr(writer, "file_lock", lambda path, on_wait: killed_lock(path))
        write_stopped(blog_layout, patch, mode, step, Killed)
    if (mode, step) != ("fallback", 6):  # NAME is only missing between the fallback's two renames
        assert seed_of(blog_layout) in (1, 2)
    with writer.output_lock(blog_layout):
        pass
    assert_whole(blog_layout)


@contextlib.contextmanager
def killed_lock(path: Path):
    """A lock left as a killed holder leaves it: the file stays."""
    path.touch()
    yield


KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[4])
from test_convert_writer import stop_at
from gpt_fast.convert import writer
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.model.shapes import get_shape

out, step, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if mode == "fallback":
    writer.exchange = lambda a, b: False
stop_at(setattr, step, lambda: os.kill(os.getpid(), signal.SIGKILL))
make_random_checkpoint(get_shape("tiny"), out, dtype=torch.float32, seed=2)
"""


@pytest.mark.parametrize("mode, step", [("exchange", 3), ("fallback", 6)], ids=["mid-carry", "between-renames"])
def test_sigkill_mid_swap_then_the_next_run_cleans_up(blog_layout, mode, step):
    result = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(blog_layout), str(step), mode, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    leftover = [name for name in hidden_entries(blog_layout.parent) if ".gpt-fast-" in name]
    assert leftover, "the kill came before the swap"
    if mode == "exchange":
        assert seed_of(blog_layout) == 1 and not (blog_layout / "hf").exists()  # hf/ is in the new folder
    else:
        assert not blog_layout.exists()
    write(blog_layout, seed=3)
    assert_whole(blog_layout, 3)


def test_leftovers_of_other_names_are_never_touched(tmp_path):
    out = tmp_path / "name"
    others = [
        ".name.gpt-fast-staging-toolong123",
        ".other.gpt-fast-staging-abcdefgh",
        ".name.gpt-fast-unknown-abcdefgh",
        "name.gpt-fast-staging-abcdefgh",
    ]
    for name in others:
        (tmp_path / name).mkdir()
    (tmp_path / "target").mkdir()
    (tmp_path / ".name.gpt-fast-staging-abcdefgh").symlink_to(tmp_path / "target")
    (tmp_path / ".name.gpt-fast-new-abcdefgh").write_text("a file")
    write(out, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*others, "target", "name", ".name.gpt-fast-staging-abcdefgh", ".name.gpt-fast-new-abcdefgh"]
    )


def test_a_staging_folder_left_inside_by_an_older_version_is_cleaned(tmp_path):
    out = tmp_path / "name"
    (out / ".gpt-fast-staging-abcd1234").mkdir(parents=True)
    (out / ".gpt-fast-staging-abcd1234" / "model.pth").write_bytes(b"partial")
    write(out, seed=1)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.pth", "tokenizer.json"]


def test_a_link_planted_at_the_lock_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / ".out.gpt-fast-lock").symlink_to(victim)
    with pytest.raises(OSError):
        write(tmp_path / "out", seed=1)
    assert victim.read_text() == "precious" and not (tmp_path / "out").exists()


def hold_lock(out: Path, locked: threading.Event, release: threading.Event, then=None):
    with writer.output_lock(out):
        locked.set()
        release.wait(60)
        if then:
            then()


def test_two_writers_of_one_folder_take_turns(blog_layout, monkeypatch):
    """The second writer waits for the first and then replaces its result whole."""
    locked, release, waiting = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(writer, "waiting", lambda out: waiting.set())
    first = threading.Thread(target=hold_lock, args=(blog_layout, locked, release, lambda: write(blog_layout, 2)))
    first.start()
    assert locked.wait(60)
    second = threading.Thread(target=write, args=(blog_layout, 3))
    second.start()
    assert waiting.wait(60)
    assert seed_of(blog_layout) == 1
    release.set()
    first.join(60)
    second.join(60)
    assert_whole(blog_layout, 3)


def test_without_fcntl_a_second_writer_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("gpt_fast.util.fileio.fcntl", None)
    out = tmp_path / "out"
    with writer.output_lock(out):
        errors = []
        thread = threading.Thread(target=lambda: errors.append(pytest.raises(FileExistsError, write, out, 1)))
        thread.start()
        thread.join(60)
    assert f"{tmp_path}/.out.gpt-fast-lock exists: another gpt-fast process" in str(errors[0].value)
    write(out, seed=1)
    assert seed_of(out) == 1 and hidden_entries(tmp_path) == []


def test_a_second_first_use_of_the_default_model_waits_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT_FAST_CACHE", str(tmp_path / "cache"))
    out = default_model.default_checkpoint_dir()
    locked, release, waiting = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(writer, "waiting", lambda out: waiting.set())
    monkeypatch.setattr(default_model, "installed_gguf", lambda: pytest.fail("converted a second time"))
    first = threading.Thread(target=hold_lock, args=(out, locked, release, lambda: write_default(out, 7)))
    first.start()
    assert locked.wait(60)
    results = []
    second = threading.Thread(target=lambda: results.append(default_model.ensure_default_checkpoint()))
    second.start()
    assert waiting.wait(60)
    release.set()
    first.join(60)
    second.join(60)
    assert results == [out / "model.pth"] and seed_of(out) == 7


def test_a_link_to_nothing_is_not_followed(tmp_path):
    (tmp_path / "out").symlink_to(tmp_path / "elsewhere" / "deep")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'out'} is a link to nothing"):
        write(tmp_path / "out", seed=1)
    assert not (tmp_path / "elsewhere").exists()
