"""Prompts for the guess-the-number environment (examples/guess-the-number.yaml), generated from a seed
(nothing is downloaded): one JSON object per line, `{"prompt", "secret", "low", "high"}`. The yaml points
`answerKey` at `secret` (the environment's ground truth); `low` and `high` reach the environment in `extra_info`.

    python examples/data/make_guess_the_number.py [--out examples/data] [--train 1000] [--test 32] [--seed 0]

Writes guess_the_number/train.jsonl and test.jsonl; no (secret, range) pair of the test file is in the train file.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HIGHS = (20, 50, 100)  # every game starts at 1; its top is one of these


def game(rng: random.Random) -> dict:
    high = rng.choice(HIGHS)
    return {"prompt": f"I am thinking of a whole number from 1 to {high}. Guess it: reply with one number only. "
                      "I will answer Higher, Lower or Correct.",
            "secret": rng.randint(1, high), "low": 1, "high": high}


def generate(n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Test games first, then train games whose (secret, high) no test game has (there are 170 pairs in all, so
    train rows repeat among themselves)."""
    rng = random.Random(seed)
    test, held = [], set()
    while len(test) < n_test:
        g = game(rng)
        test.append(g)
        held.add((g["secret"], g["high"]))
    if len(held) >= sum(HIGHS):
        raise SystemExit(f"--test {n_test} holds out every (secret, range) pair: use fewer test games")
    train = []
    while len(train) < n_train:
        g = game(rng)
        if (g["secret"], g["high"]) not in held:
            train.append(g)
    return train, test


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--train", type=int, default=1000)
    ap.add_argument("--test", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train, test = generate(args.train, args.test, args.seed)
    out = Path(args.out) / "guess_the_number"
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    print(f"wrote {len(train)} train and {len(test)} test games to {out}")


if __name__ == "__main__":
    main()
