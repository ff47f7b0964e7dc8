"""lm-eval 0.4.13 against the fleet, as its users run it: `local-completions` on a multiple-choice
task (prompts scored through echo and logprobs) and a `loglikelihood_rolling` one, and
`local-chat-completions` on a generation task. The data is written here (no hub): JSONL files read
through task YAMLs (`dataset_path: json`). The multiple-choice accuracy through the fleet equals
lm-eval's own `hf` model on the same checkpoint and task, in float32 on this CPU."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow

# Questions a 135M instruct model answers better than chance, four choices each.
MC = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What colour is the sky on a clear day?", ["Green", "Blue", "Red", "Black"], 1),
    ("How many legs does a spider have?", ["Six", "Four", "Eight", "Ten"], 2),
    ("Which animal says 'moo'?", ["Dog", "Cat", "Duck", "Cow"], 3),
    ("What is 2 + 2?", ["4", "5", "3", "22"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do bees make?", ["Milk", "Silk", "Honey", "Wool"], 2),
    ("What is frozen water called?", ["Steam", "Sand", "Glass", "Ice"], 3),
    ("Which season is the coldest?", ["Winter", "Summer", "Spring", "Autumn"], 0),
    ("What is the opposite of 'hot'?", ["Warm", "Cold", "Big", "Fast"], 1),
    ("Which organ pumps blood?", ["Lung", "Liver", "Heart", "Brain"], 2),
    ("What do you use to write on paper?", ["Spoon", "Shoe", "Plate", "Pen"], 3),
]
TEXTS = [
    "The sun rises in the east and sets in the west. Every morning the birds begin to sing.",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    "A library is a quiet place where people read books, study, and borrow stories to take home.",
]
# The model answers in a sentence ("The capital of France is Paris."): its last capitalised word.
QA = [("What is the capital of France? Answer with one word.", "Paris"),
      ("What is the capital of Italy? Answer with one word.", "Rome"),
      ("What is the capital of Germany? Answer with one word.", "Berlin")]


def write_tasks(root: Path) -> Path:
    with open(root / "mc.jsonl", "w") as f:
        for question, choices, answer in MC:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(root / "texts.jsonl", "w") as f:
        for text in TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    with open(root / "qa.jsonl", "w") as f:
        for question, answer in QA:
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (root / "tf_mc.yaml").write_text(
        f"task: tf_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    (root / "tf_rolling.yaml").write_text(
        f"task: tf_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (root / "tf_gen.yaml").write_text(
        f"task: tf_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'qa.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n"
        "filter_list:\n  - name: last_word\n    filter:\n      - function: regex\n"
        "        regex_pattern: \"([A-Z][a-z]+)\"\n        group_select: -1\n      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))))


def evaluate(tasks, names: list[str], model: str, model_args: str, **kwargs) -> dict:
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names, task_manager=tasks,
                                      batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0, **kwargs)
    return results["results"]


def completions_args(fleet) -> str:
    return (f"model={fleet.model},base_url={fleet.url}/v1/completions,tokenizer={fleet.folder},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")


def hf_args(fleet) -> str:
    return f"pretrained={fleet.folder},dtype=float32,device=cpu"


def test_multiple_choice_accuracy_through_the_fleet_equals_lm_eval_hf(client_fleet, tasks, record_property):
    fleet = evaluate(tasks, ["tf_mc"], "local-completions", completions_args(client_fleet))["tf_mc"]
    hf = evaluate(tasks, ["tf_mc"], "hf", hf_args(client_fleet))["tf_mc"]
    record_property("fleet_acc", fleet["acc,none"])
    record_property("hf_acc", hf["acc,none"])
    print(f"tf_mc acc: fleet {fleet['acc,none']:.4f}, hf {hf['acc,none']:.4f}")
    assert fleet["acc,none"] == hf["acc,none"]
    assert fleet["acc,none"] > 0.25  # better than chance: the scores mean something


def test_loglikelihood_rolling_through_the_fleet_matches_lm_eval_hf(client_fleet, tasks):
    fleet = evaluate(tasks, ["tf_rolling"], "local-completions", completions_args(client_fleet))["tf_rolling"]
    hf = evaluate(tasks, ["tf_rolling"], "hf", hf_args(client_fleet))["tf_rolling"]
    print(f"tf_rolling word_perplexity: fleet {fleet['word_perplexity,none']:.4f}, "
          f"hf {hf['word_perplexity,none']:.4f}")
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isfinite(fleet[metric])
        assert fleet[metric] == pytest.approx(hf[metric], rel=1e-3), metric


def test_generation_through_local_chat_completions(client_fleet, tasks):
    args = (f"model={client_fleet.model},base_url={client_fleet.url}/v1/chat/completions,"
            "num_concurrent=1,max_retries=1")
    result = evaluate(tasks, ["tf_gen"], "local-chat-completions", args, apply_chat_template=True)["tf_gen"]
    print(f"tf_gen exact_match: {result['exact_match,last_word']:.4f}")
    assert result["exact_match,last_word"] >= 2 / 3
