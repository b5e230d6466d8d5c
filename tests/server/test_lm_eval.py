"""lm-eval's `local-completions` against the server, run as docs/serving.md shows it (`lm_eval` CLI,
`tokenizer_backend=remote`: no local tokenizer), on two tiny local tasks: a multiple-choice one
(loglikelihood: echo + logprobs requests) and a generate_until one. Oracles: transformers float32 on
the same weights for the loglikelihoods, the engine's own greedy output for the generations."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from engine.request import SamplingParams
from server.app import create_app
from server.background import BackgroundServer
from harness.models import hf_logits, log_softmax, tiny_model_path
from tests.tiny_engine import MODEL, tiny_handle

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")

MC = [{"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
      {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
      {"question": "Water is", "choices": [" wet", " dry", " made of cheese"], "answer": 1}]
GEN = [{"question": "Q: Name a color.\nA:", "answer": " blue"},
       {"question": "Q: Count to three.\nA:", "answer": " 1 2 3"}]
MAX_GEN_TOKS = 8
TASKS = {
    "openinfer_mc": "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
                    "metric_list:\n  - metric: acc\n",
    "openinfer_gen": "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
                     f"generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
                     "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n",
}


def readme_model_args(url: str, model: str) -> str:
    """The lm_eval --model_args of docs/serving.md, for this server."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "serving.md")).read()
    args = re.search(r"lm_eval --model local-completions .*?--model_args (\S+)", readme, re.S).group(1)
    fields = dict(item.split("=", 1) for item in args.split(","))
    assert fields["tokenizer_backend"] == "remote" and fields["base_url"].endswith("/v1/completions")
    return ",".join(f"{k}={dict(fields, model=model, base_url=url + '/v1/completions')[k]}" for k in fields)


def write_tasks(folder) -> None:
    for name, rows in (("openinfer_mc", MC), ("openinfer_gen", GEN)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\ndoc_to_text: '{{{{question}}}}'\n" + TASKS[name])


@pytest.fixture(scope="module")
def path():
    return tiny_model_path(MODEL)


@pytest.fixture(scope="module")
def handle():
    h = tiny_handle(max_model_len=512)
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def run(handle, tmp_path_factory):
    """The lm_eval command of docs/serving.md; (results, samples by task)."""
    folder = tmp_path_factory.mktemp("lm_eval")
    write_tasks(folder)
    with BackgroundServer(create_app(handle, served_model_name="tiny")) as srv:
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
               "--model_args", readme_model_args(srv.url, "tiny"),
               "--tasks", "openinfer_mc,openinfer_gen", "--include_path", str(folder),
               "--output_path", str(folder / "out"), "--log_samples"]
        env = dict(os.environ, HF_DATASETS_CACHE=str(folder / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(open(glob.glob(str(folder / "out" / "*" / "results_*.json"))[0]).read())
    samples = {}
    for task in TASKS:
        lines = open(glob.glob(str(folder / "out" / "*" / f"samples_{task}_*.jsonl"))[0]).read().splitlines()
        samples[task] = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
    return results, samples


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair with the remote tokenizer (no special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def test_loglikelihoods_match_the_transformers_oracle(run, handle, path):
    results, samples = run
    predictions = []
    for doc, sample in zip(MC, samples["openinfer_mc"]):
        lls = []
        for i, choice_args in enumerate(sample["arguments"].values()):
            ctx, cont = encode_pair(handle.tokenizer, choice_args["arg_0"], choice_args["arg_1"])
            oracle = log_softmax(hf_logits(path, ctx + cont))[len(ctx) - 1:-1]
            expected = sum(float(row[t]) for row, t in zip(oracle, cont))
            greedy = all(int(np.argmax(row)) == t for row, t in zip(oracle, cont))
            ll, is_greedy = sample["resps"][i][0]
            assert float(ll) == pytest.approx(expected, abs=1e-4 * len(cont))
            assert (is_greedy == "True") == greedy
            lls.append(expected)
        predictions.append(int(np.argmax(lls)) == doc["answer"])
    assert results["results"]["openinfer_mc"]["acc,none"] == pytest.approx(np.mean(predictions))


def test_generations_are_the_engines_greedy_output(run, handle):
    results, samples = run
    tok = handle.tokenizer
    for doc, sample in zip(GEN, samples["openinfer_gen"]):
        ids = tok.encode(doc["question"], add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=["\n", tok.special_tokens["eos_token"]])
        expected = handle.generate([ids], params)[0].outputs[0].text
        assert sample["resps"][0][0] == expected and expected
    assert results["results"]["openinfer_gen"]["exact_match,none"] == 0.0     # a random-weight model
