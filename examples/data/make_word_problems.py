"""Small grade-school word problems, generated from a seed (nothing is downloaded), in two layouts:

- `word_problems/train.jsonl` and `test.jsonl`: one `{"question", "answer", "level"}` object per line, the shape of
  a user's own data (examples/word-problems.yaml points promptKey/answerKey at it);
- `gsm8k_style/train.parquet` and `test.parquet`: verl's GSM8K layout, unchanged: `data_source`, `prompt` (chat
  messages), `ability`, `reward_model: {style, ground_truth}`, `extra_info: {split, index, question, answer}`
  (examples/gsm8k-style.yaml).

    python examples/data/make_word_problems.py [--out examples/data] [--train 2000] [--test 200] [--seed 0]

Test questions never appear in the train files.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Mia", "Sam", "Ana", "Leo", "Ivy", "Ben", "Zoe", "Max", "Eva"]
ITEMS = ["apple", "book", "card", "shell", "pencil", "marble", "sticker", "coin"]
VERL_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def problem(rng: random.Random) -> tuple[str, int, str, str]:
    """(question, answer, worked solution ending in '#### answer', level)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} {item}s and buys {b} more. How many {item}s does {name} have now?"
        ans, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == 1:
        a, b = max(a, b) + b, min(a, b)
        q = f"{name} had {a} {item}s and gave {b} away. How many {item}s are left?"
        ans, work = a - b, f"{a} - {b} = {a - b}"
    elif kind == 2:
        q = f"{name} finds {a} {item}s on Monday and {b} on Tuesday. How many {item}s did {name} find in total?"
        ans, work = a + b, f"{a} + {b} = {a + b}"
    else:
        a, b = rng.randint(2, 5), rng.randint(2, 4)
        q = f"Each bag holds {a} {item}s. How many {item}s are in {b} bags?"
        ans, work = a * b, f"{a} * {b} = {a * b}"
    return q, ans, f"{work}\n#### {ans}", ("one-step" if kind < 3 else "product")


def generate(n_train: int, n_test: int, seed: int) -> tuple[list[tuple], list[tuple]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n_train + n_test:
        p = problem(rng)
        if p[0] not in seen:  # unique questions: a test question never appears in training
            seen.add(p[0])
            rows.append(p)
    return rows[n_test:], rows[:n_test]


def write_jsonl(path: Path, rows: list[tuple]) -> None:
    with path.open("w") as f:
        for q, ans, _, level in rows:
            f.write(json.dumps({"question": q, "answer": ans, "level": level}) + "\n")


def verl_rows(rows: list[tuple], split: str) -> list[dict]:
    return [{
        "data_source": "gsm8k_style",
        "prompt": [{"role": "user", "content": f"{q} {VERL_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(ans)},
        "extra_info": {"split": split, "index": i, "question": q, "answer": solution},
    } for i, (q, ans, solution, _) in enumerate(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import datasets

    datasets.disable_progress_bars()
    train, test = generate(args.train, args.test, args.seed)
    out = Path(args.out)
    (out / "word_problems").mkdir(parents=True, exist_ok=True)
    (out / "gsm8k_style").mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "word_problems" / "train.jsonl", train)
    write_jsonl(out / "word_problems" / "test.jsonl", test)
    for split, rows in (("train", train), ("test", test)):
        datasets.Dataset.from_list(verl_rows(rows, split)).to_parquet(str(out / "gsm8k_style" / f"{split}.parquet"))
    print(f"wrote {len(train)} train and {len(test)} test problems to {out}/word_problems (JSONL) and "
          f"{out}/gsm8k_style (verl Parquet)")


if __name__ == "__main__":
    main()
