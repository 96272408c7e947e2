"""The rules of a job's reward: which sources it names (one, or several weighed into a sum) and where its
judge may run. Pure checks over parsed fields, one message per problem naming the fields (api.rules runs them)."""
from __future__ import annotations

from hybridflow.api.sections import JobFields
from hybridflow.api.sources import REWARD_SOURCES, WEIGHABLE, RewardSpec


def reward_source_problems(field: str, r: RewardSpec) -> list[str]:
    """A reward whose `type` and source fields disagree: `type: rule` with a function (it would be ignored), or
    several sources and no type to pick one."""
    given = r.sources_given()
    if r.type == "combined" or r.weights:
        return _combined_problems(field, r, given)
    if "type" not in r.model_fields_set and len(given) > 1:
        return [f"{field}: {', '.join(f'{field}.{f}' for f in given)} are given together; keep the one you mean (it "
                f"sets {field}.type), set {field}.type, or weigh them in {field}.weights to sum them"]
    own = next(f for f, t in REWARD_SOURCES.items() if t == r.type)  # the field this type reads
    out = []
    for f in (f for f in given if REWARD_SOURCES[f] != r.type):
        other_fix = f"remove {field}.{f}" if own in given or own == "rule" else f"give {field}.{own} in place of {f}"
        out.append(f"{field}.type is '{r.type}' but {field}.{f} is given; remove {field}.type ({f} alone means type "
                   f"{REWARD_SOURCES[f]}) or {other_fix}")
    return out


def _combined_problems(field: str, r: RewardSpec, given: list[str]) -> list[str]:
    """A combined reward weighs exactly the sources it is given (a rule may be the task's own), and no reward
    model (a stage of its own, not a score on the controller)."""
    if r.type != "combined":
        return [f"{field}.weights: weights combine several sources and {field}.type is '{r.type}'; remove "
                f"{field}.type (weights mean type combined) or remove {field}.weights"]
    if not r.weights:
        return [f"{field}.type: combined needs {field}.weights, e.g. {{rule: 0.5, judge: 0.5}}"]
    out = [f"{field}.weights.{f}: {field}.{f} is not given; set it or drop its weight"
           for f in r.weights if f != "rule" and f not in given]
    out += [f"{field}.{f}: a combined reward sums only {', '.join(WEIGHABLE)}; a reward model is scored as a "
            f"stage of its own" if f not in WEIGHABLE else f"{field}.{f} is given but {field}.weights names no "
            f"weight for it; add weights.{f} or remove it" for f in given if f not in r.weights]
    return out


def judge_problems(spec: JobFields) -> list[str]:
    """Where a judge may run: the planner does not place one yet, and on a GPU its vLLM takes a share of the device
    that no other role's memory is planned around."""
    if spec.models.reward.judge is None:
        return []
    agent = spec.rollout.agent
    if agent is not None and agent.episode_score == "environment":
        return ["spec.models.reward.judge: this job's episodes are scored by their environment or program alone "
                "(spec.rollout.agent.score: environment), so the judge would never be asked; drop it"]
    if spec.placement == "auto":
        return ["spec.placement: auto does not place a judge (spec.models.reward.judge) yet; place the roles by "
                "name, the judge on a pool of its own or beside others (spec.placement.judge)"]
    pool = spec.pool("judge")
    others = [r for r in spec.roles() if r != "judge" and spec.pool(r).name == pool.name]
    if pool.device == "gpu" and others:
        return [f"spec.placement.judge: on a GPU the judge's vLLM needs its pool to itself, and pool '{pool.name}' "
                f"also holds {', '.join(others)}; add a pool for it (spec.resourcePools) and place it there"]
    return []
