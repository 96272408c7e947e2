"""A job's task: its prompts (generated, or the user's files tokenized once) and its one `Reward`, which decides,
once, how responses are scored: on the controller (a rule over token ids, a reward function or scorer over the
decoded text, an environment's episode rewards, or these summed) or by the job's reward and cost models."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from hybridflow.agents.places import job_tools
from hybridflow.api.storage import is_url
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.worker_group import RoleHandle, resolve
from hybridflow.trainer.step import Scorer
from hybridflow.data.files import PromptRenderer, load_prompt_files
from hybridflow.data.packing import unpack_prompts, unpack_responses
from hybridflow.data.tasks import Sample, arithmetic_samples, increment_samples, products_samples, split_train_eval
from hybridflow.rewards.rules import TASK_DEFAULT_RULE, RewardRule, get_rule
from hybridflow.rewards.judge import Generate, Judge
from hybridflow.rewards.text import TextReward, check_failures
from hybridflow.rewards.verdicts import agreement, question_text
from hybridflow.roles.protocols import JudgeRole
from hybridflow.api import JobSpec, RLHFJob, SpecError

log = logging.getLogger("hybridflow.trainer.task")

Decode = Callable[[list[int]], str]


@dataclass
class JobJudge:
    """The controller's end of the judge role: the verdicts (templates, cache, parser) and the judge model's files,
    which its workers load."""

    verdicts: Judge
    model_dir: Path
    stop_token_ids: list[int]

    def asker(self, role: RoleHandle[Any]) -> Generate:
        """The judge role as a Generate: requests padded to a multiple of its data-parallel size (a shard per rank),
        answers back in order."""
        ranks = role.dp_sizes["train"]

        def generate(ids: list[list[int]]) -> list[list[int]]:
            padded = ids + [ids[-1]] * (-len(ids) % ranks)
            out = resolve(role.typed(JudgeRole).call.judge(Batch(non_tensors={"judge_prompt_ids": padded})))
            return [list(a) for a in out["verdict_ids"][:len(ids)]]

        return generate


@dataclass
class Reward:
    """How the job's responses are scored, decided here once and asked by the step's stages and the held-out
    evaluation alike: `scorers` are the stages scored on the controller; every other stage is its model's."""

    rule: Callable[..., float] | None = None  # over token ids (a generated task's)
    texts: dict[str, TextReward] = field(default_factory=dict)  # "function", "scorers": over decoded responses
    decode: Decode | None = None
    episode_score: str | None = None  # multi-turn rollouts: reward, environment or both (spec.rollout.agent.score)
    cost_rule: RewardRule | None = None  # safe_rlhf with a cost rule
    judge: JobJudge | None = None  # a generative judge (its role asked through `scorers(roles)`)
    weights: dict[str, float] = field(default_factory=dict)  # the summed parts (empty: the rule, if any)
    error_policy: Any = None  # spec.models.reward (errorScore, maxErrorFraction) for the judge's failures

    def scorers(self, roles: Mapping[str, Any] | None = None) -> dict[str, Scorer]:
        """The stages scored on the controller rather than by a model: rules, reward functions, judges and
        environments. (A generated task always has its rule: with a reward model, the model scores training and
        the rule the held-out evaluation.) `roles`: the job's, where a judge's are asked."""
        out: dict[str, Scorer] = {}
        ask = self.judge.asker(roles["judge"]) if self.judge is not None and roles and "judge" in roles else None
        if self.rule is not None or self.weights or self.episode_score not in (None, "reward"):
            out["reward"] = functools.partial(self.score, ask=ask)
        if self.cost_rule is not None:
            out["cost"] = self.cost
        return out

    def held_out(self, batch: Batch, roles: Mapping[str, Any]) -> tuple[float, float | None]:
        """Mean reward and cost (None: the job has none) of the batch's responses, each by its controller scorer
        where there is one, else by its model."""
        scorers = self.scorers(roles)

        def mean(stage: str) -> float | None:
            if stage in scorers:
                return float(scorers[stage](batch)[0].mean())
            if stage == "reward" or stage in roles:
                return float(resolve(roles[stage].compute_rm_scores(batch))["rm_scores"].mean())
            return None

        reward = mean("reward")
        assert reward is not None
        return reward, mean("cost")

    def score(self, batch: Batch, ask: Generate | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores of the batch's responses: the weighted sum of the rule, text rewards and judge the job names (plus
        or instead the environment's), and reward statistics for the step log (failed samples, a reward function's
        extra metrics, the judge's costs and its agreement with the rule)."""
        if self.episode_score is not None and self.episode_score != "reward":  # the environment's rewards
            env = batch["env_reward"].float()
            if self.episode_score == "environment":
                return env, {}
            scores, stats = replace(self, episode_score=None).score(batch, ask)
            return scores + env, stats
        prompts, responses = unpack_prompts(batch), unpack_responses(batch)
        texts = [self.decode(r) for r in responses] if self.decode is not None and (self.texts or self.judge) else []
        weights = self.weights or {"rule": 1.0}
        parts: dict[str, list[float]] = {}
        stats: dict[str, float] = {}
        if "rule" in weights or ("judge" in weights and self.rule is not None):  # the judge's agreement with it
            assert self.rule is not None
            parts["rule"] = [self.rule(p, r, t, self.decode) for p, r, t in zip(prompts, responses, batch["truth"])]
        for name, text in self.texts.items():
            out = text.score(list(batch["data_source"]), texts, list(batch["truth"]),
                             [dict(x) for x in batch["extra_info"]])
            parts[name] = out.scores
            _count_errors(stats, out.errors, len(texts), "samples could not be scored")
            for key, values in out.extras.items():
                got = [v for v in values if v == v]  # NaN: that sample's result had no such key
                if got:
                    stats[f"reward_{key}_mean"] = float(np.mean(got))
        if "judge" in weights:
            parts["judge"] = self._judged(batch, texts, ask, stats, parts.get("rule"))
        total = sum(w * torch.tensor(parts[name], dtype=torch.float32) for name, w in weights.items())
        return torch.as_tensor(total, dtype=torch.float32), stats

    def _judged(self, batch: Batch, texts: list[str], ask: Generate | None, stats: dict[str, float],
                rule: list[float] | None) -> list[float]:
        """The judge's scores of the batch (its costs, failures and agreement with the rule's `rule` into
        `stats`)."""
        if self.judge is None or ask is None:
            raise RuntimeError("the reward weighs a judge, and this job's judge role was not given to the scorer")
        questions = [question_text(q) for q in batch["raw_prompt"]] if "raw_prompt" in batch else [""] * len(texts)
        call = self.judge.verdicts.score(ask, questions, texts, list(batch["truth"]))
        stats.update(call.stats())
        _count_errors(stats, call.result.errors, len(texts), "samples the judge could not score")
        check_failures("judge", call.result.errors, len(texts), self.error_policy)
        if rule is not None:
            stats["judge_rule_agreement"] = agreement(call.result.scores, rule)
        return call.result.scores

    def cost(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The cost rule over each response (safe_rlhf with spec.models.cost.type rule)."""
        assert self.cost_rule is not None
        prompts, responses = unpack_prompts(batch), unpack_responses(batch)
        costs = [self.cost_rule(p, r, t, self.decode) for p, r, t in zip(prompts, responses, batch["truth"])]
        return torch.tensor(costs, dtype=torch.float32), {}

    def close(self) -> None:
        for text in self.texts.values():
            text.close()  # a reward function's worker processes


def _count_errors(stats: dict[str, float], errors: Sequence[Any], n: int, what: str) -> None:
    """A part's failed samples: counted in the step log's reward_errors, the first logged."""
    stats["reward_errors"] = stats.get("reward_errors", 0.0) + len(errors)
    if errors:
        log.warning("%d of %d %s; first: %s", len(errors), n, what, errors[0])


def build_reward(s: JobSpec, decode: Decode | None, judge_dir: Path | None = None) -> Reward:
    """The job's one Reward, from spec.models.reward and .cost and the agent's episode score."""
    r, c = s.models.reward, s.models.cost
    # A generated task always has its rule: with a reward model it still scores the held-out evaluation.
    rule = get_rule(r.rule or TASK_DEFAULT_RULE[s.data.task]) if s.data.source == "generated" else None
    weights = {part: w for part, w in r.parts().items() if part != "model"}
    texts = {part: TextReward(r, "function" if part == "function" else "scorer")
             for part in weights if part in ("function", "scorers")}
    judge = None
    if "judge" in weights:
        from transformers import AutoTokenizer

        assert r.judge is not None and judge_dir is not None
        tok = AutoTokenizer.from_pretrained(judge_dir)
        judge = JobJudge(Judge(r.judge, tok, r.error_score), judge_dir, _stop_ids(tok.eos_token_id, judge_dir))
    cost_rule = get_rule(c.rule) if c is not None and c.type == "rule" and c.rule else None
    score = s.rollout.agent.episode_score if s.rollout.agent else None
    return Reward(rule, texts, decode, score, cost_rule, judge, weights, r)


def _stop_ids(eos: int | None, model_dir: Path) -> list[int]:
    """Where a model's answer ends: its tokenizer's end of sequence and its generation config's (a chat model's end
    of turn, e.g. Llama 3's <|eot_id|>, is often only there)."""
    import json

    ids = [] if eos is None else [eos]
    config = model_dir / "generation_config.json"
    if config.is_file():
        found = json.loads(config.read_text()).get("eos_token_id")
        ids += [int(i) for i in (found if isinstance(found, list) else [found]) if isinstance(i, int)]
    return list(dict.fromkeys(ids))


@dataclass
class Task:
    train: Sequence[Sample]
    eval: Sequence[Sample]
    reward: Reward = field(default_factory=Reward)
    decode: Decode | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    data_fingerprint: str | None = None  # prompts from files: a resumed job checks it reads the same rows

    def close(self) -> None:
        self.reward.close()


def data_cache_default(checkpoint_dir: str) -> Path:
    """<checkpointDir>/data-cache, or a local directory when checkpoints go to object storage (the cache is read
    as files)."""
    if is_url(checkpoint_dir):
        import tempfile

        return Path(tempfile.gettempdir()) / "hybridflow-data-cache"
    return Path(checkpoint_dir) / "data-cache"


def build_task(job: RLHFJob, model_dir: Path, judge_dir: Path | None = None) -> Task:
    """The prompts (generated, or the user's files tokenized once) and how responses are scored."""
    s = job.spec
    decode, stop, fingerprint = None, [], None
    if s.data.source == "generated" and s.data.task == "increment":
        vocab = s.models.actor.tiny.vocab_size if s.models.actor.source == "tiny" else _vocab_size(model_dir)
        n = s.data.train_prompts + s.data.eval_prompts
        train, held_out = split_train_eval(increment_samples(n, vocab, min(8, s.rollout.max_prompt_length),
                                                             s.data.seed), s.data.eval_prompts)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        tools = [t.offered() for t in job_tools(s.rollout.agent).values()] if s.rollout.agent else []
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
        if s.data.source == "files":
            cache = Path(s.data.cache_dir or data_cache_default(s.trainer.checkpoint_dir))
            files = load_prompt_files(s.data, tok, s.rollout.max_prompt_length, cache, s.trainer.prompts_per_step,
                                      tools)
            train, held_out, fingerprint = files.train, files.eval, files.fingerprint
        else:
            renderer = PromptRenderer(tok, None, None, tools)  # the model's chat template, one user message
            make = products_samples if s.data.task == "products" else arithmetic_samples
            samples = make(s.data.train_prompts + s.data.eval_prompts, s.data.seed,
                           lambda text: renderer.ids(text, f"the {s.data.task} task"))
            too_long = max(len(x.prompt) for x in samples)
            if too_long > s.rollout.max_prompt_length:
                raise ValueError(
                    f"spec.rollout.maxPromptLength={s.rollout.max_prompt_length} is shorter than the task's prompts "
                    f"({too_long} tokens); raise it"
                )
            train, held_out = split_train_eval(samples, s.data.eval_prompts)
    if s.data.source == "generated" and len(train) < s.trainer.prompts_per_step:  # the stream would refuse later
        raise SpecError(f"spec.data.trainPrompts = {s.data.train_prompts}: only {len(train)} generated prompts are "
                        f"left to train on once those repeating one of the {len(held_out)} held-out prompts are "
                        f"dropped (the {s.data.task} task has few distinct prompts), fewer than "
                        f"spec.trainer.promptsPerStep = {s.trainer.prompts_per_step}; raise trainPrompts or lower "
                        "promptsPerStep or evalPrompts")
    return Task(train, held_out, build_reward(s, decode, judge_dir), decode, stop, fingerprint)


def _vocab_size(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def prompt_batch(samples: Sequence[Sample], uid_offset: int = 0) -> Batch:
    return Batch(
        non_tensors={
            "prompt_ids": [s.prompt for s in samples],
            "truth": [s.truth for s in samples],
            "data_source": [s.data_source for s in samples],
            "extra_info": [s.extra_info for s in samples],
            "raw_prompt": [s.raw_prompt for s in samples],
            "uid": list(range(uid_offset, uid_offset + len(samples))),
        }
    )
