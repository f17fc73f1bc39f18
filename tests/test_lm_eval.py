"""`gpt-fast lm-eval` and our lm-evaluation-harness model on a tiny random Llama converted from transformers: the
log-likelihoods are transformers' own for the continuation's tokens, rolling windows score each token once, and
two local tasks (multiple choice, generation; JSONL files written here, nothing downloaded) score the same in this
process as through `gpt-fast serve` with lm-eval's `local-completions` model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_serve import Server
from tiny import save_hf_llama

from gpt_fast.cli.main import main
from gpt_fast.convert.hf import convert_hf
from gpt_fast.engine.engine import Engine

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from gpt_fast.jobs.lm_eval_model import GptFastLM, cut_at_stops, sampling_of  # noqa: E402

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris.", " Rome.", " numbers"], "answer": 0},
    {"question": "def quicksort(arr):\n   ", "choices": [" if", " return arr", " Hello"], "answer": 1},
    {"question": "Hello, my name is ", "choices": ["Ada", "Paris", "12345"], "answer": 0},
    {"question": "Tabs\tand", "choices": [" spaces", " newlines", " text too"], "answer": 2},
]
PROMPTS = [
    {"prompt": "The capital of Italy is", "target": " Rome."},
    {"prompt": "def quicksort(arr):", "target": "\n"},
    {"prompt": "Hello, my name is Ada and I like", "target": " numbers"},
]
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: [".", "\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
TASKS = ["tiny_mc", "tiny_gen"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama saved by transformers and converted: (its folder, the model, our checkpoint)."""
    src = tmp_path_factory.mktemp("lm-eval") / "hf"
    hf_model = save_hf_llama(src)
    checkpoint = src.parent / "converted"
    convert_hf(src, checkpoint, dtype="float32")
    return src, hf_model, checkpoint


@pytest.fixture(scope="module")
def engine(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.load(tiny[2], device="cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    for name, rows, template in (("mc", QUESTIONS, MC_TASK), ("gen", PROMPTS, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(template.format(data=data))
    return folder


def reference(hf_model, hf_dir: Path, context: str, continuation: str) -> tuple[float, bool]:
    """transformers' log-likelihood of the continuation's tokens (those of the whole text after the context's,
    BOS first, the context's trailing white space moved to the continuation; after BOS alone for an empty context) and
    whether each is the most likely one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if context:
        whole, prefix = tokenizer(context + continuation).input_ids, tokenizer(context.rstrip()).input_ids
    else:
        whole, prefix = [tokenizer.bos_token_id, *tokenizer(continuation, add_special_tokens=False).input_ids], [0]
    count = len(whole) - len(prefix)
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([whole])).logits[0, :-1].float().log_softmax(-1)[-count:]
    targets = torch.tensor(whole[-count:])
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    return chosen.double().sum().item(), bool((logprobs.argmax(-1) == targets).all())


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, arguments, index) for index, arguments in enumerate(args)]


def test_loglikelihoods_are_transformers_own(tiny, engine):
    """Each (context, continuation), a trailing space and an empty context included, scores as transformers
    scores the continuation's tokens of the whole text."""
    hf_dir, hf_model, _ = tiny
    pairs = [("The capital of France is", " Paris."), ("Hello, my name is ", "Ada"), ("def f(x):", "\n    return")]
    pairs += [(row["question"], choice) for row in QUESTIONS for choice in row["choices"]] + [("", "The capital")]
    ours = GptFastLM(engine).loglikelihood(instances("loglikelihood", pairs))
    for pair, (logprob, greedy) in zip(pairs, ours, strict=True):
        expected, expected_greedy = reference(hf_model, hf_dir, *pair)
        assert logprob == pytest.approx(expected, abs=1e-4), pair
        assert greedy == expected_greedy, pair


def test_greedy_continuations_are_greedy(engine):
    """What greedy decoding writes after a context (where its text encodes back to the same tokens) is greedy to
    the log-likelihood, and scores above another continuation."""
    lm = GptFastLM(engine)
    contexts = ["The capital of France is", "Hello, my name is", "def quicksort(arr):", "The capital of Italy"]
    answers = engine.generate(contexts, 3, sampling_of({}), ignore_eos=True)
    checked = 0
    for context, answer in zip(contexts, answers, strict=True):
        if engine.encode(context + answer.text) != answer.prompt_ids + answer.ids:
            continue
        (best, greedy), (other, not_greedy) = lm.loglikelihood(
            instances("loglikelihood", [(context, answer.text), (context, " Rome.")])
        )
        assert greedy and not not_greedy and best > other
        checked += 1
    assert checked


def test_rolling_windows_score_each_token_once(engine):
    """A document within the context scores as one window after BOS; in windows of 8 tokens, each token is scored
    once, with the context lm-eval's rolling windows give it."""
    text = "The capital of France is Paris. The capital of Italy is Rome. Hello, my name is Ada."
    ids = engine.tokenizer.encode(text, bos=False)
    assert len(ids) > 16
    whole = GptFastLM(engine).loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))[0]
    expected = engine.log_likelihoods([engine.tokenizer.bos_id, *ids]).double().sum().item()
    assert whole == pytest.approx(expected, abs=1e-4)
    windowed = GptFastLM(engine, max_length=8).loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))
    pieces = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, engine.tokenizer.bos_id, 7, 1)]
    assert sum(len(continuation) for _, continuation in pieces) == len(ids)
    expected = sum(engine.log_likelihoods(c + t).double().sum().item() for c, t in pieces if len(c) == 1)
    expected += sum(engine.log_likelihoods(c + t)[-len(t) :].double().sum().item() for c, t in pieces if len(c) > 1)
    assert windowed[0] == pytest.approx(expected, abs=1e-4) and windowed[0] != pytest.approx(whole, abs=1e-3)


def test_generation_honours_until_and_the_budget(engine):
    lm = GptFastLM(engine)
    prompts = ["The capital of France is", "Hello, my name is", "def quicksort(arr):"]
    free = lm.generate_until(instances("generate_until", [(p, {"max_gen_toks": 10, "until": []}) for p in prompts]))
    alone = [engine.generate(p, 10, sampling_of({}), ignore_eos=False)[0].text for p in prompts]
    assert free == alone
    stops = [text[1:3] for text in free]  # a stop string inside each answer
    stopped = lm.generate_until(
        instances(
            "generate_until", [(p, {"max_gen_toks": 10, "until": s}) for p, s in zip(prompts, stops, strict=True)]
        )
    )
    assert stopped == [text[: text.index(stop)] for text, stop in zip(free, stops, strict=True)]
    short = lm.generate_until(instances("generate_until", [(prompts[0], {"max_gen_toks": 2, "until": ["zzz"]})]))
    assert short == [engine.generate(prompts[0], 2, sampling_of({}))[0].text]
    assert cut_at_stops("a.b\nc", [".", "\n"]) == "a"


def test_sampling_follows_the_generation_arguments():
    assert sampling_of({}).greedy and sampling_of({"do_sample": False, "temperature": 0.7}).greedy
    assert sampling_of({"do_sample": True, "temperature": 0}).greedy
    sampled = sampling_of({"do_sample": True, "temperature": 0.5, "top_p": 0.9})
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.5, None, 0.9)


def evaluate(model, task_dir: Path, **kwargs) -> dict:
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=manager, log_samples=True, **kwargs)


def responses(results: dict) -> dict[str, list]:
    """Each task's answers, document by document: log-likelihoods of each choice, or generated texts."""
    out = {}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        out[task] = [[r[0] for r in s["resps"]] for s in samples]
    return out


@pytest.mark.slow
def test_the_command_and_the_server_score_the_same(tiny, engine, task_dir, tmp_path, capsys):
    """`gpt-fast lm-eval` prints lm-eval's table and writes the results; lm-eval's `local-completions` model
    against `gpt-fast serve` gets the same scores, log-likelihoods and generated texts."""
    hf_dir, _, checkpoint = tiny
    out = tmp_path / "results.json"
    argv = ["lm-eval", "--checkpoint_path", str(checkpoint), "--tasks", ",".join(TASKS), "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--include_path", str(task_dir), "--output_path", str(out)])
    printed = capsys.readouterr()
    assert exit_info.value.code == 0, printed.err
    assert "tiny_mc" in printed.out and "tiny_gen" in printed.out and "acc_norm" in printed.out
    command = json.loads(out.read_text())["results"]
    ours = evaluate(GptFastLM(engine), task_dir)
    server = Server(
        "--checkpoint_path", str(checkpoint), "--max_batch", "4", "--max_seq_length", "256", "--model_name", "tiny"
    )
    try:
        args = f"base_url={server.url}/v1/completions,model=tiny,tokenizer_backend=huggingface,tokenizer={hf_dir}"
        served = evaluate("local-completions", task_dir, model_args=f"{args},add_bos_token=True,max_length=256")
    finally:
        server.stop()
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_mc", "acc_norm,none"), ("tiny_gen", "exact_match,none")):
        assert command[task][metric] == ours["results"][task][metric] == served["results"][task][metric]
    mine, theirs = responses(ours), responses(served)
    assert mine["tiny_gen"] == theirs["tiny_gen"] and any(text for texts in mine["tiny_gen"] for text in texts)
    for a, b in zip(mine["tiny_mc"], theirs["tiny_mc"], strict=True):
        assert [lp for lp, _ in a] == pytest.approx([lp for lp, _ in b], abs=1e-4)
        assert [g for _, g in a] == [g for _, g in b]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", " "], "--tasks needs task names"),
        (["--tasks", "x", "--limit", "0"], "--limit must be"),
        (["--tasks", "x", "--limit", "1.5"], "--limit must be"),
        (["--tasks", "x", "--num_fewshot", "-1"], "--num_fewshot must be >= 0"),
        (["--tasks", "x", "--include_path", "/no/such/folder"], "is not a folder"),
        (["--tasks", "x", "--output_path", "/no/such/folder/r.json"], "does not exist"),
    ],
)
def test_bad_arguments_end_in_one_line_before_anything_loads(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["lm-eval", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_without_lm_eval_the_command_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "gpt_fast.jobs.lm_eval_model")
    with pytest.raises(SystemExit) as exit_info:
        main(["lm-eval", "--tasks", "arc_easy"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err == (
        "error: lm-eval needs lm-evaluation-harness, which is not installed: pip install 'gpt-fast[lm-eval]'\n"
    )


@pytest.mark.parametrize("argv", [["--help"], ["lm-eval", "--help"], ["lm-eval", "--tasks", "x", "--limit", "-1"]])
def test_help_and_argument_errors_import_neither_torch_nor_lm_eval(argv):
    code = (
        "import sys\nfrom gpt_fast.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, 'lm_eval' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split()[-2:] == ["False", "False"], done.stderr
