"""Reward rules and generated prompt sets."""
import pytest

from hybridflow.data.tasks import PromptStream, arithmetic_samples, increment_samples, split_train_eval
from hybridflow.rewards.rules import arithmetic_exact, final_answer, get_rule, increment, successor


def test_successor_wraps_and_skips_padding():
    assert successor(3, 16) == 4 and successor(15, 16) == 1


def test_increment_reward_counts_each_correct_continuation():
    assert increment([1, 2, 3], [4, 5, 6], 16) == 1.0
    assert increment([1, 2, 3], [4, 9, 10], 16) == pytest.approx(2 / 3)  # a slip costs one token, not the rest
    assert increment([14, 15], [1, 2], 16) == 1.0
    assert increment([1], [], 16) == 0.0


@pytest.mark.parametrize("text,answer", [("3 + 5 = 8", 8), ("12 + 7 = 9\n\nThis is", 9), ("The answer is 19.", 19),
                                         ("no number", None), ("x = -4", -4)])
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_arithmetic_exact_uses_the_decoder():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    assert arithmetic_exact([], [ord(c) for c in "3 + 5 = 8"], 8, decode) == 1.0
    assert arithmetic_exact([], [ord(c) for c in "3 + 5 = 9"], 8, decode) == 0.0
    with pytest.raises(ValueError, match="needs a tokenizer"):
        arithmetic_exact([], [1], 8, None)


def test_unknown_rule():
    with pytest.raises(KeyError, match="registered rules: arithmetic_exact, final_number_exact, increment"):
        get_rule("nope")


def test_increment_prompts_count_up_and_are_deterministic():
    a = increment_samples(50, 16, 6, seed=1)
    assert a == increment_samples(50, 16, 6, seed=1)
    for s in a:
        assert 2 <= len(s.prompt) <= 6
        assert all(successor(x, 16) == y for x, y in zip(s.prompt, s.prompt[1:]))


def test_held_out_prompts_never_appear_in_training():
    samples = increment_samples(500, 16, 6, seed=2)
    train, held = split_train_eval(samples, 64)
    assert len(held) == 64
    assert not {tuple(s.prompt) for s in held} & {tuple(s.prompt) for s in train}


def test_arithmetic_truth():
    s = arithmetic_samples(20, 0, encode=lambda t: [ord(c) for c in t])
    for x in s:
        text = "".join(map(chr, x.prompt))
        a, b = text.removeprefix("What is ").split("?")[0].split(" + ")
        assert int(a) + int(b) == x.truth


def test_prompt_stream_resumes_at_its_position():
    samples = increment_samples(40, 16, 6, seed=3)
    s1 = PromptStream(samples, 8, seed=0)
    batches = [s1.next_batch() for _ in range(7)]  # crosses an epoch boundary (5 batches per epoch)
    s2 = PromptStream(samples, 8, seed=0, position=4)
    assert [s2.next_batch() for _ in range(3)] == batches[4:]
    assert batches[5] != batches[0]  # a new epoch is reshuffled


def test_too_few_generated_prompts_after_holding_out_is_bad_input_saying_why():
    """A task with few distinct prompts (tiny's 16 ids: about 100 counting sequences) loses every training prompt
    that repeats a held-out one; too few left is refused before anything starts, naming the cause and the fields,
    not as the prompt stream's bare count once Ray and the workers run."""
    from pathlib import Path

    from hybridflow.api import RLHFJob, SpecError
    from hybridflow.trainer.task import build_task

    job = RLHFJob.model_validate({"spec": {
        "models": {"actor": {"source": "tiny", "tiny": {"vocabSize": 16}}},
        "data": {"task": "increment", "trainPrompts": 32, "evalPrompts": 64},
        "rollout": {"maxPromptLength": 8}, "trainer": {"promptsPerStep": 32}}})
    with pytest.raises(SpecError, match=r"spec.data.trainPrompts = 32: only \d+ generated prompts are left to train "
                                        r"on once those repeating one of the 64 held-out prompts are dropped .*"
                                        r"fewer than spec.trainer.promptsPerStep = 32; raise trainPrompts"):
        build_task(job, Path("."))
