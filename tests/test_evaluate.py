"""`gpt-fast eval`: sliding-window perplexity equal to transformers' loss on the same ids, the windows, the default
text, and bad input in one line."""

import json
import math

import pytest
import torch

from gpt_fast.cli.main import main
from gpt_fast.convert.hf import convert_hf
from gpt_fast.engine.engine import Engine
from gpt_fast.jobs.evaluate import builtin_text, perplexity, windows
from gpt_fast.jobs.options import DEFAULT_TEXT, EvalOptions
from tests.tiny import save_hf_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny transformers Llama and our engine over its conversion (float32)."""
    folder = tmp_path_factory.mktemp("eval")
    hf_model = save_hf_llama(folder / "hf")
    convert_hf(folder / "hf", folder / "ours")
    return hf_model, Engine.load(folder / "ours"), folder / "ours"


@torch.no_grad()
def transformers_perplexity(model, ids, window, stride):
    """The Hugging Face guide's sliding-window loop ("Perplexity of fixed-length models"), each window's mean loss
    weighted by the number of labels transformers actually scores in it."""
    total, count, scored_until = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        window_ids = torch.tensor([ids[begin:end]])
        labels = window_ids.clone()
        labels[:, : -(end - scored_until)] = -100
        loss = model(window_ids, labels=labels).loss.item()
        scored = (labels[:, 1:] != -100).sum().item()
        total, count, scored_until = total + loss * scored, count + scored, end
        if end == len(ids):
            break
    return math.exp(total / count), count


@pytest.mark.parametrize("window, stride", [(64, 64), (16, 8), (16, 16), (20, 7)])
def test_perplexity_equals_transformers_loss(models, window, stride):
    hf_model, engine, _ = models
    ids = torch.randint(0, engine.model_config.vocab_size, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = perplexity(engine, ids, window, stride)
    expected, count = transformers_perplexity(hf_model, ids, window, stride)
    assert ours.tokens == count
    assert ours.perplexity == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("n, window, stride", [(50, 16, 8), (50, 16, 5), (17, 16, 16), (2, 16, 8), (1000, 100, 1)])
def test_windows_score_every_token_once(n, window, stride):
    scored = []
    for begin, end, count in windows(n, window, stride):
        assert end - begin <= window and 1 <= count <= end - begin - 1
        scored += range(end - count, end)
    assert len(scored) == len(set(scored)) and 0 not in scored
    if stride < window:  # else each window's first token has no context in it, and goes unscored
        assert sorted(scored) == list(range(1, n))


def test_default_text_ships_with_python():
    text = builtin_text(EvalOptions())
    assert len(text) > 100_000 and 'The "assert" statement' in text
    assert builtin_text(EvalOptions()) == text


def test_eval_command_prints_a_table_and_json(models, tmp_path, capsys):
    _, engine, folder = models
    text = tmp_path / "text.txt"
    text.write_text("The capital of France is Paris. " * 40)
    argv = ["eval", "--checkpoint_path", str(folder), "--text", str(text), "--window", "32", "--stride", "16"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    result = json.loads(out)
    ids = engine.encode(text.read_text())
    assert result["tokens"] == len(ids) - 1 and result["quantization"] == "none" and result["text"] == str(text)
    assert result["perplexity"] == pytest.approx(perplexity(engine, ids, 32, 16).perplexity, rel=1e-6)
    with pytest.raises(SystemExit):
        main([*argv, "--max_tokens", "40"])
    out, _ = capsys.readouterr()
    assert out.splitlines()[0].startswith("| checkpoint | quantization | device | dtype | kv_cache_dtype | text |")
    assert f"| {folder} | none | CPU | float32 | float32 | {text} | 39 | 32 | 16 |" in out


def test_eval_scores_with_the_kv_cache_dtype_asked(models, tmp_path, capsys):
    """``--kv_cache_dtype``: the window's keys and values are read back from a cache of that dtype, so a float8
    cache's rounding moves the perplexity a little, where a float32 one matches the model's."""
    _, _, folder = models
    text = tmp_path / "text.txt"
    text.write_text("The capital of France is Paris. " * 40)
    argv = ["eval", "--checkpoint_path", str(folder), "--text", str(text), "--window", "32", "--json"]
    results = {}
    for kv_dtype in ("float32", "float8_e4m3fn"):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--kv_cache_dtype", kv_dtype])
        out, err = capsys.readouterr()
        assert exit_info.value.code == 0, err
        results[kv_dtype] = json.loads(out)
        assert results[kv_dtype]["kv_cache_dtype"] == kv_dtype
    rounded, exact = results["float8_e4m3fn"]["perplexity"], results["float32"]["perplexity"]
    assert rounded != exact and rounded == pytest.approx(exact, rel=0.1)


BAD = {
    "both texts": (["--text", "x.txt", "--dataset", "wikitext-2"], "give --text or --dataset, not both"),
    "unknown dataset": (["--dataset", "ptb"], "--dataset 'ptb' is not one of wikitext-2"),
    "stride above the window": (["--window", "8", "--stride", "9"], "--stride must be in 1..--window (8), got 9"),
    "one token": (["--max_tokens", "1"], "--max_tokens must be >= 2, got 1"),
    "text not UTF-8": (["--text", "{bad}"], "is not valid UTF-8 text"),
    "missing text": (["--text", "{missing}"], "missing --text"),
    "window beyond the context": (["--window", "100000"], "--window 100000 is beyond the model's context of"),
    "default window, stride beyond it": (["--stride", "100000"], "--stride must be in 1..--window"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line(name, models, tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    args = [a.format(bad=tmp_path / "bad.txt", missing=tmp_path / "none.txt") for a in BAD[name][0]]
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--checkpoint_path", str(models[2]), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert BAD[name][1] in err


def test_wikitext_offline_without_a_cached_copy(models, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--checkpoint_path", str(models[2]), "--dataset", "wikitext-2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and len(err.strip().splitlines()) == 1
    assert (
        "--dataset wikitext-2 (Salesforce/wikitext, " in err
        and "offline and not in the local Hugging Face cache" in err
    )


def test_default_text_is_named():
    assert EvalOptions().text_name == DEFAULT_TEXT == "pydoc_data.topics"


def test_wikitext_with_the_hub_unreachable(models, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    from gpt_fast.util import download

    def unreachable(endpoint):
        raise ConnectionError(f"cannot reach the Hugging Face hub at {endpoint} (Name or service not known); retry")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(download, "check_reachable", unreachable)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--checkpoint_path", str(models[2]), "--dataset", "wikitext-2", "--json"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1 and not out and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --dataset wikitext-2 (Salesforce/wikitext, ")
    assert "cannot reach the Hugging Face hub at" in err and err.strip().endswith("without the hub, use --text FILE")
