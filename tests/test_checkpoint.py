"""Loading a converted checkpoint: every broken or hostile weights file ends as one line naming the file, before
anything is allocated where that is possible; a good one loads into the same model its tensors describe."""

import json
import os
import pickle
import re
import shutil
import zipfile

import pytest
import torch
from tiny import tensor_pickle, torch_archive

from gpt_fast.checkpoint.load import check_finite, load_model, load_torch_weights
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.model.config import load_checkpoint_config
from gpt_fast.model.shapes import SHAPES, get_shape
from gpt_fast.model.transformer import weight_count, weight_shapes


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32).parent


@pytest.fixture
def checkpoint(pristine, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(pristine, folder)
    return folder


def load(folder, dtype=torch.float32):
    return load_model(folder, load_checkpoint_config(folder), torch.device("cpu"), dtype)


def test_a_good_checkpoint_loads_its_own_tensors(checkpoint):
    model = load(checkpoint)
    saved = torch.load(checkpoint / "model.pth", weights_only=True)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved.items())
    assert not any(p.untyped_storage().filename for p in model.parameters())  # copied out of the file mapping


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "llama-3-8b"])
def test_weight_count_agrees_with_the_model(name):
    shapes = weight_shapes(SHAPES[name])
    assert weight_count(SHAPES[name]) == (len(shapes), sum(torch.Size(s).numel() for s in shapes.values()))


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_state(path, edit):
    """torch.save the tiny checkpoint's tensors after ``edit(state)``."""
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def set_first(value):
    return lambda state: state["tok_embeddings.weight"].view(-1).__setitem__(0, value)


# model.pth (or config.json) edits -> what the one-line error says; each is caught before any tensor is read,
# except non-finite values, which need the data.
BAD_WEIGHTS = {
    "text file": (lambda p: p.write_text("not weights\n" * 100_000), r"is not a torch.save archive \(a zip file\)"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-1000]), r"is not a torch.save archive"),
    "legacy pickle": (lambda p: p.write_bytes(pickle.dumps({"a": 1}) * 100_000), r"is not a torch.save archive"),
    "a folder": (lambda p: p.unlink() or p.mkdir(), r"model.pth is a folder"),
    "a pipe": (lambda p: p.unlink() or os.mkfifo(p), r"model.pth is not a regular file"),
    "non-string key": (
        lambda p: save_state(p, lambda s: s.update({7: s.pop("norm.weight")})),
        r"name 7 is not a string",
    ),
    "not a tensor": (lambda p: save_state(p, lambda s: s.update({"norm.weight": [1.0]})), r"norm.weight is a list"),
    "integer weights": (
        lambda p: save_state(p, lambda s: s.update({"norm.weight": s["norm.weight"].int()})),
        r"tensor norm.weight has dtype torch.int32; weights must be one of float32, bfloat16, float16, float64",
    ),
    "complex weights": (
        lambda p: save_state(p, lambda s: s.update({"norm.weight": s["norm.weight"].to(torch.complex64)})),
        r"tensor norm.weight has dtype torch.complex64",
    ),
    "dtype other than config.json's": (
        lambda p: save_state(p, lambda s: s.update({"norm.weight": s["norm.weight"].double()})),
        r"tensor norm.weight is torch.float64, config.json says dtype float32",
    ),
    "a tensor missing": (
        lambda p: save_state(p, lambda s: s.update({"extra": s.pop("norm.weight")})),
        r"missing tensor\(s\): norm.weight; unexpected tensor\(s\): extra",
    ),
    "nan": (lambda p: save_state(p, set_first(float("nan"))), r"tensor tok_embeddings.weight holds NaN or infinite"),
    "inf": (lambda p: save_state(p, set_first(float("-inf"))), r"tensor tok_embeddings.weight holds NaN or infinite"),
    "a million layers claimed": (
        lambda p: edit_config(p, lambda c: c["model"].update(n_layer=10**6)),
        r"model.pth holds \d+ bytes, config.json's model describes \d+ parameters",
    ),
    "weights leave the folder": (
        lambda p: edit_config(p, lambda c: c.update(weights="../other/model.pth")),
        r"weights must be a path inside the checkpoint folder",
    ),
    "weights link out of the folder": (
        lambda p: link_out(p),
        r"weights: 'model.pth' leads outside .* \(through a symbolic link\)",
    ),
}


def link_out(weights):
    """Move the weights out of the checkpoint folder, leaving a symbolic link to them."""
    outside = weights.parent.parent / "elsewhere.pth"
    weights.rename(outside)
    weights.symlink_to(outside)


def edit_config(weights, edit):
    path = weights.parent / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("name", list(BAD_WEIGHTS))
def test_bad_weights_are_one_line_naming_the_file(name, checkpoint):
    edit, message = BAD_WEIGHTS[name]
    edit(checkpoint / "model.pth")
    with pytest.raises(ValueError) as info:
        load(checkpoint)
    assert re.search(message, str(info.value)), info.value
    text = str(info.value)
    assert len(text.splitlines()) == 1 and str(checkpoint) in text and ("model.pth" in text or "config.json" in text)


def test_float16_overflow_is_refused(checkpoint):
    save_state(checkpoint / "model.pth", set_first(1e6))
    assert load(checkpoint, torch.float32) is not None
    with pytest.raises(ValueError, match=r"tok_embeddings.weight holds NaN or infinite values \(in float16\)"):
        load(checkpoint, torch.float16)


# Archives that torch.load would read wrongly or at a cost set by the file rather than by its size:
# name -> (pickle, data records, zip compression, what the error says)
HOSTILE_ARCHIVES = {
    # a tensor of 4 values on a storage declared 4 GB: memory-mapped, it would read past its record
    "storage larger than its record": (tensor_pickle({"a": (4,)}, 10**9), {"0": bytes(16)}, 0, r"do not match"),
    # a tensor of 4 values viewing a storage of a million: hidden bytes
    "tensor on a larger storage": (
        tensor_pickle({"a": (4,)}, 10**6),
        {"0": bytes(4 * 10**6)},
        0,
        r"view 4000000 bytes of storage but hold only 16",
    ),
    # 400 MB of zeros deflate to 400 KB: torch.load would inflate them
    "compressed record": (
        tensor_pickle({"a": (4,)}, 4),
        {"0": bytes(16)},
        zipfile.ZIP_DEFLATED,
        r"archive member .*data/0 is compressed",
    ),
    "record nobody uses": (tensor_pickle({"a": (4,)}, 4), {"0": bytes(16), "1": bytes(8)}, 0, r"do not match"),
    "more records than tensors expected": (
        tensor_pickle({"a": (4,)}, 4),
        {str(i): bytes(16) for i in range(10)},
        0,
        r"holds 10 data records, more than the 4 tensors expected",
    ),
    "a pickle too large for its tensors": (
        pickle.dumps(list(range(100_000)), protocol=2),
        {},
        0,
        r"pickle of \d+ bytes is too large for at most 4 tensors",
    ),
    "a list, not a dict": (pickle.dumps([1, 2], protocol=2), {}, 0, r"holds a list, not a dict of tensors"),
}


@pytest.mark.parametrize("name", list(HOSTILE_ARCHIVES))
def test_hostile_archives_are_refused_before_reading_data(name, tmp_path):
    data_pkl, records, compression, message = HOSTILE_ARCHIVES[name]
    path = torch_archive(tmp_path / "model.pth", data_pkl, records, compression)
    with pytest.raises(ValueError, match=message) as info:
        load_torch_weights(path, max_tensors=4)
    assert str(path) in str(info.value) and len(str(info.value).splitlines()) == 1


def test_unsafe_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "payload-ran"
    path = torch_archive(tmp_path / "model.pth", pickle.dumps({"a": RunsCode(marker)}, protocol=2))
    with pytest.raises(
        ValueError, match="unsafe pickle refused, it holds more than tensors .*unsupported GLOBAL posix.system"
    ):
        load_torch_weights(path, max_tensors=4)
    assert not marker.exists()


def test_check_finite_names_the_first_bad_tensor():
    tensors = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]), "c": torch.tensor([float("inf")])}
    with pytest.raises(ValueError, match=r"^here: tensor b holds NaN"):
        check_finite(tensors, "here")
    check_finite({"a": torch.ones(2, dtype=torch.bfloat16)}, "here")
