"""Combinations each field allows alone but not together: pure checks over a spec's parsed fields (JobFields; the
JobSpec of api.schema runs them), one message per problem naming the fields. What an engine supports comes from its
registered facts (hybridflow.api.engines), never from its name."""
from __future__ import annotations

import re
from pathlib import Path

from pydantic.alias_generators import to_camel

from hybridflow.algorithms import ALGORITHMS
from hybridflow.api.agents import code_files, runs_user_code
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS
from hybridflow.algorithms.corrections import OFF_POLICY_CORRECTIONS
from hybridflow.api.engines import (
    ROLLOUT_ENGINES, TRAIN_ENGINES, lora_train_engines, model_parallel_train_engines, standalone_rollout_engines,
    tensor_parallel_rollout_engines,
)
from hybridflow.api.names import DATA_MOUNT, reward_configmap_key
from hybridflow.api.roles import ROLE_KINDS
from hybridflow.api.scaling import elastic_problems
from hybridflow.api.sections import JobFields
from hybridflow.api.training import (FSDP_ONLY_SWITCHES, LORA_PROJECTIONS, MEGATRON_LINEAR_PARTS,
                                     fsdp_switches_forced_on)
from hybridflow.api.reward_rules import judge_problems, reward_source_problems
from hybridflow.api.storage import is_url
from hybridflow.rewards.rules import RULES, TASK_DEFAULT_RULE


def cross_field_problems(spec: JobFields) -> list[str]:
    """Combinations each field allows alone but not together; one message per problem, naming the fields."""
    out = reward_source_problems("spec.models.reward", spec.models.reward)
    if spec.models.cost is not None:
        out += reward_source_problems("spec.models.cost", spec.models.cost)
    if spec.tracking.tensorboard and is_url(spec.trainer.checkpoint_dir):
        out.append(f"spec.tracking.tensorboard: event files are written beside the checkpoints on a file system, "
                   f"and spec.trainer.checkpointDir is object storage ({spec.trainer.checkpoint_dir}); use a PVC or "
                   f"a local checkpointDir, or turn tracking.tensorboard off")
    wandb = spec.tracking.wandb
    if wandb is not None and wandb.mode == "offline" and is_url(spec.trainer.checkpoint_dir):
        out.append(f"spec.tracking.wandb.mode: offline runs are written beside the checkpoints on a file system, and "
                   f"spec.trainer.checkpointDir is object storage ({spec.trainer.checkpoint_dir}); use a PVC or a "
                   f"local checkpointDir, or mode online")
    return out + _layout_and_pieces_problems(spec) + elastic_problems(spec)


def _layout_and_pieces_problems(spec: JobFields) -> list[str]:
    """Pools, placement and parallelism first (the rest assumes them), then algorithm, data and reward."""
    out: list[str] = []
    names = [p.name for p in spec.resource_pools]
    if len(set(names)) != len(names):
        out.append(f"spec.resourcePools: pool names must be unique, got {names}")
    for role, pool in spec.placed.items():
        if role not in ROLE_KINDS:
            out.append(f"spec.placement.{role}: unknown role; use one of {', '.join(ROLE_KINDS)}")
        elif pool not in names:
            out.append(f"spec.placement.{role}: no resource pool named '{pool}'; pools are {names}")
    if out:
        return out
    out += _rollout_mode_problems(spec)
    out += judge_problems(spec)
    out += _agent_problems(spec)
    out += _cuda_graph_problems(spec)
    t = spec.training
    actor_pool = spec.pool("actor")
    mp = t.tensor_parallel * t.pipeline_parallel
    if actor_pool.world_size % mp:
        out.append(
            f"spec.training.tensorParallel*pipelineParallel = {mp} does not divide the actor pool's "
            f"{actor_pool.world_size} devices"
        )
        return out
    if not TRAIN_ENGINES[t.engine].model_parallel and mp != 1:
        out.append(f"spec.training.tensorParallel/pipelineParallel: only the "
                   f"{'/'.join(model_parallel_train_engines())} engine supports them; set 1")
    out += _hybrid_engine_problems(spec)
    out += _lora_problems(spec)
    out += _fsdp_switch_problems(spec)
    dp = actor_pool.world_size // mp
    if spec.trainer.prompts_per_step % dp:
        out.append(
            f"spec.trainer.promptsPerStep = {spec.trainer.prompts_per_step} is not divisible by the actor's "
            f"data-parallel size {dp}"
        )
    mini = t.mini_batch_size or spec.trainer.prompts_per_step
    if spec.trainer.prompts_per_step % mini:
        out.append(f"spec.training.miniBatchSize = {mini} does not divide spec.trainer.promptsPerStep")
    elif mini % dp:
        out.append(f"spec.training.miniBatchSize = {mini} is not divisible by the data-parallel size {dp}")
    out += _algorithm_problems(spec)
    if spec.algorithm.kl_coef > 0 and not spec.models.reference:
        out.append("spec.algorithm.klCoef > 0 needs spec.models.reference: true")
    out += _data_problems(spec)
    r = spec.models.reward
    if r.type == "rule" and spec.data.source == "generated" and (
        r.rule or TASK_DEFAULT_RULE[spec.data.task]) == "arithmetic_exact" and (
        spec.models.actor.source == "tiny"
    ):
        out.append("spec.models.reward.rule: arithmetic_exact needs a model with a tokenizer (source smollm2 or path)")
    if r.type in ("scorer", "function", "judge", "combined") and spec.models.actor.source == "tiny":
        out.append(f"spec.models.reward.type: {r.type} scores decoded text and needs a model with a tokenizer "
                   "(source smollm2 or path)")
    m = spec.models.actor
    head_sizes = ROLLOUT_ENGINES[spec.rollout.engine].head_sizes
    if m.source == "tiny" and head_sizes is not None:
        head_dim = m.tiny.hidden_size // m.tiny.num_heads
        if head_dim not in head_sizes:
            out.append(
                f"spec.models.actor.tiny: head size hiddenSize/numHeads = {head_dim} is not one the "
                f"{spec.rollout.engine} engine's CPU attention supports ({', '.join(map(str, head_sizes))}); change "
                "hiddenSize or numHeads"
            )
    if m.source == "tiny" and spec.data.source == "generated" and spec.data.task == "increment" and (
        m.tiny.vocab_size < 4
    ):
        out.append("spec.models.actor.tiny.vocabSize: the increment task needs at least 4 tokens")
    return out


def _algorithm_problems(spec: JobFields) -> list[str]:
    """What the algorithm and its pieces need of the rest of the job: group sizes, a critic, a cost."""
    a = spec.algorithm
    algorithm, needs = ALGORITHMS[a.name], ADVANTAGE_ESTIMATORS.info(a.advantage_estimator or "")["needs"]
    out = []
    n = spec.rollout.responses_per_prompt
    if n < algorithm.min_group or ("groups" in needs and n < 2):
        out.append(f"spec.rollout.responsesPerPrompt: {a.name} with the {a.advantage_estimator} estimator needs at "
                   f"least 2 responses per prompt (it compares the responses to the same prompt), got {n}")
    if "values" in needs and not algorithm.critic:
        out.append(f"spec.algorithm.advantageEstimator: {a.advantage_estimator} needs a critic's values; "
                   f"{a.name} has no critic (use ppo or safe_rlhf, or another estimator)")
    if "baseline" in needs and not algorithm.greedy_baseline:
        makers = ", ".join(name for name in ALGORITHMS.names() if ALGORITHMS[name].greedy_baseline)
        out.append(f"spec.algorithm.advantageEstimator: {a.advantage_estimator} needs the greedy-response baseline "
                   f"only the {makers} algorithm generates")
    if algorithm.critic and "values" not in needs:
        out.append(f"spec.algorithm.advantageEstimator: {a.name} trains a critic on GAE returns; "
                   f"{a.advantage_estimator} gives none (use gae, or an algorithm without a critic)")
    c = a.off_policy_correction
    corrected = "tisCap" if a.tis_cap is not None else None if c is None else "offPolicyCorrection"
    if corrected is not None and spec.rollout.top_p < 1:
        out.append(f"spec.algorithm.{corrected}: the generation engines report log-probs over the top-p nucleus, the "
                   "trainer over the whole vocabulary, so the weights would be biased; set rollout.topP: 1")
    if c is not None:
        reads = OFF_POLICY_CORRECTIONS[c.name].defaults
        for key in sorted(type(c).model_fields.keys() - {"name"} - reads.keys()):
            if getattr(c, key) is not None:
                out.append(f"spec.algorithm.offPolicyCorrection.{key}: {c.name} does not read it (it reads "
                           f"{', '.join(reads) or 'nothing'}); remove it")
        if "cap" in reads and c.cap is not None and c.cap < 1:
            out.append(f"spec.algorithm.offPolicyCorrection.cap = {c.cap}: below 1 even an on-policy token (ratio 1) "
                       "would lose its weight; set cap > 1 (e.g. 2)")
        if "low" in reads and not c.low < 1 < c.high:
            out.append(f"spec.algorithm.offPolicyCorrection: {c.name} keeps ratios in [low, high], which must hold "
                       f"the on-policy ratio 1 (low < 1 < high); got low {c.low}, high {c.high}")
    if a.overlong_buffer > spec.rollout.max_response_length:
        out.append(f"spec.algorithm.overlongBuffer = {a.overlong_buffer} exceeds rollout.maxResponseLength = "
                   f"{spec.rollout.max_response_length}: every response, even an empty one, would be penalised")
    if algorithm.cost and spec.models.cost is None:
        out.append(f"spec.models.cost: {a.name} needs a cost, e.g. cost: {{type: rule, rule: top_ids}}")
    if not algorithm.cost and spec.models.cost is not None:
        out.append(f"spec.models.cost: only a constrained algorithm (safe_rlhf) uses a cost; {a.name} would ignore it")
    c = spec.models.cost
    if c is not None and c.type not in ("rule", "model"):
        out.append(f"spec.models.cost.type: a cost is a rule or a model, got {c.type}")
    if c is not None and c.type == "rule" and c.rule is None:  # a name not registered: RewardSpec.rule refuses it
        out.append(f"spec.models.cost.rule: a rule cost needs one; name a registered rule ({', '.join(RULES.names())})")
    elif c is not None and c.type == "rule" and c.rule == "arithmetic_exact" and spec.models.actor.source == "tiny":
        out.append("spec.models.cost.rule: arithmetic_exact needs a model with a tokenizer (source smollm2 or path)")
    return out


def _data_problems(spec: JobFields) -> list[str]:
    d, k, r = spec.data, spec.kubernetes, spec.models.reward
    out = []
    if d.source == "generated":
        if d.train_prompts < spec.trainer.prompts_per_step:
            out.append("spec.data.trainPrompts must be at least spec.trainer.promptsPerStep")
        if d.train or d.eval:
            out.append("spec.data.train/eval: files are only read with spec.data.source: files")
    else:
        if not d.train:
            out.append("spec.data.train: source is 'files' but no file is given, e.g. train: [data/train.parquet]")
        if spec.models.actor.source == "tiny":
            out.append("spec.models.actor.source: prompts from files need a model with a tokenizer (smollm2 or path)")
        # An episode scored by its environment alone needs no job reward; any other reward source is checked by
        # reward_source_problems.
        env_scored = spec.rollout.agent is not None and spec.rollout.agent.episode_score == "environment"
        if r.type == "combined" and "rule" in r.weights:
            out.append("spec.models.reward.weights.rule: a rule scores the token ids of a generated task; for "
                       "prompts from files weigh scorers, function or judge")
        if r.type == "rule" and r.sources_given() in ([], ["rule"]) and not env_scored:
            out.append("spec.models.reward.type: rule scores the token ids of a generated task; for prompts from "
                       "files use scorer (e.g. scorers: [{name: math}]), function or model")
    if k.data_pvc:
        for field, paths in (("train", d.train), ("eval", d.eval)):
            for i, p in enumerate(paths):
                if (Path(p).is_absolute() and not p.startswith(DATA_MOUNT + "/")) or ".." in Path(p).parts:
                    out.append(f"spec.data.{field}[{i}]: with kubernetes.dataPvc, give a path inside the volume "
                               f"(relative, no '..'), got '{p}'")
    return out + kubernetes_code_problems(spec)


def kubernetes_code_problems(spec: JobFields) -> list[str]:
    """On Kubernetes the job's code files (its reward function's, its agent's tools file, environment file and
    program) come from kubernetes.rewardConfigMap, the job's code ConfigMap, each under the key its field names: the
    operator copies them at acceptance into an immutable ConfigMap of the job's own and records their digests, so
    the code a job runs is the code it was accepted with. A code file on kubernetes.dataPvc cannot be pinned (the
    operator cannot read a claim, and anyone who may write to it could change the code under a running job):
    refused."""
    k, files = spec.kubernetes, code_files(spec)
    out = []
    if k.reward_config_map:
        if not files:
            out.append("spec.kubernetes.rewardConfigMap: holds the job's code files, and this job names none: set "
                       "spec.models.reward.function.path, rollout.agent.toolsFile, rollout.agent.environmentFile or "
                       "rollout.agent.program to a key of it (a reward function needs spec.models.reward.type function "
                       "or combined), or drop it")
        for field, path in files.items():
            if not _CONFIGMAP_KEY.fullmatch(reward_configmap_key(path)):
                example = "my_reward.py" if field.startswith("spec.models") else "tools.py"
                out.append(f"{field}: with kubernetes.rewardConfigMap it is the ConfigMap's key (a file name such as "
                           f"{example}), got '{path}'")
    elif k.data_pvc:
        for field, path in files.items():
            agent_file = not field.startswith("spec.models")  # made a path on the claim, as data.train is
            if agent_file or path.startswith(DATA_MOUNT + "/"):
                key = Path(path).name
                out.append(f"{field}: '{path}' would be read from kubernetes.dataPvc, which the operator cannot read "
                           f"to pin and anyone who may write to the claim could change under a running job; put the "
                           f"file in kubernetes.rewardConfigMap (the job's code ConfigMap) under the key '{key}' "
                           f"(kubectl create configmap <name> --from-file={key}) and set {field} to '{key}'")
    return out


def _rollout_mode_problems(spec: JobFields) -> list[str]:
    """A rollout pool of its own (fed by the cross-pool weight stream) and the modes that overlap generation with
    training (which need one)."""
    r, out = spec.rollout, []
    own_pool = spec.pool("actor").name != spec.pool("rollout").name
    generator = ROLLOUT_ENGINES[r.engine]
    if own_pool and generator.fed_by is not None:
        out.append(f"spec.placement.rollout: {r.engine} generation runs on the actor's own processes (it is fed "
                   f"training shards); on a pool of its own use spec.rollout.engine "
                   f"{'/'.join(standalone_rollout_engines())}, or place rollout with the actor")
    if own_pool and r.tensor_parallel > 1:
        out.append(f"spec.rollout.tensorParallel = {r.tensor_parallel}: a rollout pool of its own holds one replica "
                   "per device for now (each receives whole tensors); set 1, and give the pool more devices for "
                   "more replicas")
    algorithm = ALGORITHMS[spec.algorithm.name]
    rows = spec.trainer.prompts_per_step * (r.responses_per_prompt + int(algorithm.greedy_baseline))
    ranks = spec.pool("rollout").world_size
    if own_pool and rows % ranks and spec.rollout_pool is None:  # (elastic: async pads a call to its replicas)
        extra = f" (+1 greedy baseline per prompt: {spec.algorithm.name})" if algorithm.greedy_baseline else ""
        out.append(f"spec.trainer.promptsPerStep x spec.rollout.responsesPerPrompt{extra} = {rows} responses a step "
                   f"do not split evenly over the rollout pool's {ranks} replicas; make it a multiple of {ranks}")
    if r.mode != "sync" and not own_pool and spec.placement != "auto":  # auto: the plan gives rollout its own
        out.append(f"spec.rollout.mode = {r.mode} generates while the actor trains, so rollout needs devices of "
                   "its own: add a resource pool and set spec.placement.rollout to it (or use mode sync)")
    if r.mode == "async" and algorithm.greedy_baseline:
        out.append(f"spec.rollout.mode = async: {spec.algorithm.name}'s baseline is a greedy response of the policy "
                   "being trained, made in the same engine call as its samples; queued samples come from older "
                   "policies, and so would their baseline. Use one_step_off (one version old, baseline and samples "
                   "alike) or sync")
    if r.mode != "async":
        for field in ("max_staleness", "partial_rollout_tokens", "queue_prompts"):
            if getattr(r, field) != type(r).model_fields[field].default:  # a dumped spec holds every field
                out.append(f"spec.rollout.{to_camel(field)} applies to mode async only (mode is {r.mode}); remove it "
                           "or set spec.rollout.mode: async")
    return out


_NOT_LORA_TARGETS = {"embed_tokens", "lm_head", "score", "norm", "model.norm"}
# The projections megatron-core fuses into one linear (linear_qkv, linear_fc1): a target set takes all of a group or
# none of it
_MEGATRON_FUSED = tuple(tuple(p.split(".")[-1] for p in parts) for parts in MEGATRON_LINEAR_PARTS.values()
                        if len(parts) > 1)


def _megatron_targets_problem(targets: list[str]) -> str:
    """What the megatron LoRA engine cannot adapt of spec.training.lora.targetModules ("" if nothing): bare
    projection names only, fused groups whole (empty targets: every projection)."""
    names = set(targets)
    if not names:
        return ""
    if names - set(LORA_PROJECTIONS):
        return (f"spec.training.lora.targetModules: {sorted(names - set(LORA_PROJECTIONS))}: the megatron engine "
                f"adapts the layers' projections by their bare names ({', '.join(LORA_PROJECTIONS)})")
    for group in _MEGATRON_FUSED:
        if names & set(group) and not set(group) <= names:
            return (f"spec.training.lora.targetModules: the megatron engine fuses {list(group)} into one linear; "
                    f"target all of them or none")
    return ""


def _lora_problems(spec: JobFields) -> list[str]:
    """LoRA (spec.training.lora) needs an engine that builds it, and its reference policy is the actor's own base
    (adapters off), so a reference placed apart from the actor would be a pool holding nothing."""
    t = spec.training
    if t.lora is None:
        return []
    out = []
    kind = TRAIN_ENGINES[t.engine]
    if not kind.lora:
        out.append(f"spec.training.lora: LoRA is not built for the {t.engine} engine; use spec.training.engine: "
                   f"{'/'.join(lora_train_engines())} (or remove spec.training.lora)")
    elif kind.model_parallel and _megatron_targets_problem(t.lora.target_modules):
        out.append(_megatron_targets_problem(t.lora.target_modules))
    elif kind.model_parallel and (t.tensor_parallel, t.pipeline_parallel) != (1, 1):
        out.append(f"spec.training.tensorParallel = {t.tensor_parallel}, spec.training.pipelineParallel = "
                   f"{t.pipeline_parallel}: LoRA on the {t.engine} engine trains at tensorParallel 1 and "
                   "pipelineParallel 1 (data parallel only); set both to 1 or remove spec.training.lora")
    most = ROLLOUT_ENGINES[spec.rollout.engine].max_lora_rank
    if most == 0:
        loading = [n for n in ROLLOUT_ENGINES.names() if ROLLOUT_ENGINES[n].max_lora_rank != 0]
        out.append(f"spec.rollout.engine: the {spec.rollout.engine} generation engine takes no LoRA adapters; use "
                   f"spec.rollout.engine: {'/'.join(loading)} (or remove spec.training.lora)")
    elif most is not None and t.lora.rank > most:
        out.append(f"spec.training.lora.rank = {t.lora.rank}: the {spec.rollout.engine} generation engine serves "
                   f"LoRA ranks up to {most}; use a lower rank")
    not_linear = sorted(set(t.lora.target_modules) & _NOT_LORA_TARGETS)
    if not_linear:
        out.append(f"spec.training.lora.targetModules: {not_linear} are not a decoder layer's linear projections "
                   "(embeddings and heads are not adapted here); name projections such as q_proj, v_proj")
    if t.lora.critic and "critic" not in spec.roles():
        out.append("spec.training.lora.critic: this job has no critic (its algorithm uses none); remove it")
    if spec.models.reference and spec.pool("reference").name != spec.pool("actor").name:
        out.append(f"spec.placement.reference: with spec.training.lora the actor is its own reference (its base, "
                   f"adapters off); place reference on the actor's pool ({spec.pool('actor').name})")
    return out


def _fsdp_switch_problems(spec: JobFields) -> list[str]:
    """The FSDP engine's switches set "on" for a model-parallel engine, which would silently ignore them."""
    t = spec.training
    if not TRAIN_ENGINES[t.engine].model_parallel:
        return []
    return [f"spec.training.{field}: \"on\" does nothing with the {t.engine} engine, which {FSDP_ONLY_SWITCHES[field]} "
            f"(the switch is FSDP's); leave it \"auto\" or set it \"off\"" for field in fsdp_switches_forced_on(t)]


_CONFIGMAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _hybrid_engine_problems(spec: JobFields) -> list[str]:
    t, r, m = spec.training, spec.rollout, spec.models.actor
    trainer, generator = TRAIN_ENGINES[t.engine], ROLLOUT_ENGINES[r.engine]
    out = []
    if generator.fed_by is not None and t.engine not in generator.fed_by:
        out.append(f"spec.rollout.engine: {r.engine} generation is fed by the {'/'.join(sorted(generator.fed_by))} "
                   f"actor; set spec.training.engine: {'/'.join(sorted(generator.fed_by))} or pick "
                   f"{'/'.join(standalone_rollout_engines())}")
    if trainer.computes_in_model_dtype and t.compute_dtype == "bfloat16" and m.dtype != "bfloat16":
        out.append(f"spec.training.computeDtype = bfloat16: the {t.engine} engine computes in the model's dtype "
                   f"({m.dtype}); set spec.models.actor.dtype: bfloat16, or computeDtype auto")
    if r.tensor_parallel > 1 and not generator.tensor_parallel:
        out.append(f"spec.rollout.tensorParallel = {r.tensor_parallel}: only spec.rollout.engine "
                   f"{'/'.join(tensor_parallel_rollout_engines())} generates tensor-parallel")
    elif r.tensor_parallel > 1 and not trainer.model_parallel:
        out.append(f"spec.rollout.tensorParallel = {r.tensor_parallel}: tensor-parallel generation is fed shards by "
                   f"a model-parallel actor (spec.training.engine: {'/'.join(model_parallel_train_engines())}); the "
                   f"{t.engine} actor hands every rank whole tensors, so set 1")
    elif r.tensor_parallel > 1 and m.source == "tiny" and m.tiny.vocab_size % (generator.vocab_padding
                                                                               * r.tensor_parallel):
        out.append(f"spec.models.actor.tiny.vocabSize = {m.tiny.vocab_size}: {r.engine} pads the vocabulary to a "
                   f"multiple of {generator.vocab_padding}, so its {r.tensor_parallel} shards line up with the actor's "
                   f"only when vocabSize is a multiple of {generator.vocab_padding * r.tensor_parallel}")
    if t.tensor_parallel % r.tensor_parallel:
        out.append(f"spec.rollout.tensorParallel = {r.tensor_parallel} must divide spec.training.tensorParallel = "
                   f"{t.tensor_parallel}")
    if trainer.model_parallel and m.source == "tiny":
        for field, value in (("vocabSize", m.tiny.vocab_size), ("numKvHeads", m.tiny.num_kv_heads)):
            if value % t.tensor_parallel:
                out.append(f"spec.models.actor.tiny.{field} = {value} is not divisible by "
                           f"spec.training.tensorParallel = {t.tensor_parallel}")
        if m.tiny.num_layers % t.pipeline_parallel:
            out.append(f"spec.models.actor.tiny.numLayers = {m.tiny.num_layers} is not divisible by "
                       f"spec.training.pipelineParallel = {t.pipeline_parallel} (every stage holds as many layers)")
    return out



def _cuda_graph_problems(spec: JobFields) -> list[str]:
    """`cudaGraphs: on` where no graph can be captured: a CPU pool (vLLM's CPU build has none), or an engine that
    captures none. auto and off are valid everywhere (auto is eager where graphs are impossible)."""
    r = spec.rollout
    if r.cuda_graphs != "on":
        return []
    pool = spec.pool("rollout")
    if not ROLLOUT_ENGINES[r.engine].cuda_graphs:
        capturing = "/".join(n for n in ROLLOUT_ENGINES.names() if ROLLOUT_ENGINES[n].cuda_graphs)
        return [f"spec.rollout.cudaGraphs = on: the {r.engine} engine captures no CUDA graphs; set auto or off, or "
                f"spec.rollout.engine: {capturing}"]
    if pool.device != "gpu":
        return [f"spec.rollout.cudaGraphs = on: CUDA graphs need a GPU, and rollout runs on the {pool.device} pool "
                f"'{pool.name}'; set auto (eager on CPU) or off, or give that pool device: gpu"]
    return []


def _agent_problems(spec: JobFields) -> list[str]:
    """Multi-turn rollouts: what an episode needs that other sections decide."""
    a, r = spec.rollout.agent, spec.rollout
    if a is None:
        return ["spec.environments: the sandbox pool runs the job's reward function and spec.rollout.agent's tools "
                "and environment; this job has neither: set models.reward.function or rollout.agent, or drop "
                "environments"] if spec.environments is not None and not runs_user_code(spec) else []
    out = []
    if spec.models.actor.source == "tiny" or (spec.data.source == "generated" and spec.data.task == "increment"):
        out.append("spec.rollout.agent: multi-turn rollouts read the model's text and tokenize the answers of tools "
                   "and environments, so they need a model with a tokenizer (models.actor.source smollm2 or path) "
                   "and a text task (data.task arithmetic, or data.source files)")
    if r.partial_rollout_tokens:
        out.append("spec.rollout.partialRolloutTokens: partial rollouts continue a response token-wise, an episode "
                   "turn-wise; with rollout.agent set it to 0 (episodes started before new weights arrive finish "
                   "with the weights they began with)")
    if not a.tools and not a.tools_file and not a.has_environment and a.program is None:
        out.append("spec.rollout.agent: names no tools (tools, toolsFile), no environment (environment, "
                   "environmentFile) and no program: an episode would be a single turn; drop rollout.agent, or give "
                   "it some")
    if a.environment is not None and a.environment_file is not None:
        out.append("spec.rollout.agent: environment and environmentFile are both set; keep one")
    if a.program is not None and a.trajectory == "per_call" and ALGORITHMS[spec.algorithm.name].greedy_baseline:
        out.append(f"spec.rollout.agent.trajectory: per_call makes an episode several sequences, and "
                   f"{spec.algorithm.name}'s greedy baseline needs one per episode; use trajectory merged (a step "
                   "where a program still breaks its chain stops, saying so) or another algorithm")
    if a.episode_score != "reward" and not a.has_environment and a.program is None:
        out.append(f"spec.rollout.agent.score: {a.episode_score} needs an environment (environment or "
                   "environmentFile), whose rewards it adds")
    if not ROLLOUT_ENGINES[r.engine].per_row_sampling:
        out.append(f"spec.rollout.engine: {r.engine} generation takes one sampling setting per call, and an episode's "
                   "turns each have their own token budget; use an engine that takes one per row (vllm, hf)")
    if a.episode_score != "reward" and spec.models.reward.type == "model":
        out.append(f"spec.rollout.agent.score: {a.episode_score} adds the environment's rewards, which a reward model "
                   "(models.reward.type model) does not see; score with the environment (no reward model), or set "
                   "score: reward")
    if a.max_tokens_per_turn is not None and a.max_tokens_per_turn > r.max_response_length:
        out.append(f"spec.rollout.agent.maxTokensPerTurn = {a.max_tokens_per_turn} exceeds rollout.maxResponseLength "
                   f"= {r.max_response_length}, the whole episode's budget after its prompt")
    return out
