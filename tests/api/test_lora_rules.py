"""The spec's rules for LoRA (spec.training.lora, api.rules): what is not built is refused at validation, naming the
field and the way out, before any pod or process starts."""
import pytest

from hybridflow.api import SpecError, parse_job


def _job(training: dict, **spec) -> dict:
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
            "spec": {"training": training, **spec}}


LORA = {"rank": 4, "alpha": 8}
POOLS = {"resourcePools": [{"name": "a", "nodes": 1, "devicesPerNode": 1},
                           {"name": "b", "nodes": 1, "devicesPerNode": 1}]}


def test_lora_on_the_fsdp_engine_is_accepted():
    assert parse_job(_job({"lora": LORA})).spec.training.lora.rank == 4


def test_lora_on_the_megatron_engine_trains_at_tp1_and_generates_where_adapters_load():
    parse_job(_job({"engine": "megatron", "lora": LORA}, rollout={"engine": "hf"}))
    with pytest.raises(SpecError, match=r"spec.rollout.engine: the megatron generation engine takes no LoRA "
                                        r"adapters; use spec.rollout.engine: hf/vllm"):
        parse_job(_job({"engine": "megatron", "lora": LORA}, rollout={"engine": "megatron"}))


def test_megatron_lora_targets_take_its_fused_projections_whole():
    """Its one adapter per fused linear (q/k/v, gate/up): a part of a group, or a dotted name, fails at validation,
    not when the engine is built on the workers; FSDP takes both."""
    megatron = {"engine": "megatron"}
    for targets, problem in ((["q_proj", "v_proj"], r"fuses \['q_proj', 'k_proj', 'v_proj'\] into one linear"),
                             (["self_attn.q_proj"], r"\['self_attn.q_proj'\]: the megatron engine adapts the "
                                                    r"layers' projections by their bare names")):
        with pytest.raises(SpecError, match=problem):
            parse_job(_job({**megatron, "lora": {"targetModules": targets}}, rollout={"engine": "hf"}))
        parse_job(_job({"lora": {"targetModules": targets}}))  # FSDP: PEFT's own matching
    parse_job(_job({**megatron, "lora": {"targetModules": ["q_proj", "k_proj", "v_proj", "down_proj"]}},
                   rollout={"engine": "hf"}))


def test_what_the_generation_engine_and_the_model_cannot_take_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"spec.training.lora.rank = 1024: the vllm generation engine serves LoRA "
                                        r"ranks up to 512"):
        parse_job(_job({"lora": {"rank": 1024}}))
    parse_job(_job({"lora": {"rank": 1024}}, rollout={"engine": "hf"}))  # plain torch: any rank
    with pytest.raises(SpecError, match=r"spec.training.lora.targetModules: \['lm_head'\] are not a decoder "
                                        r"layer's linear projections"):
        parse_job(_job({"lora": {"targetModules": ["q_proj", "lm_head"]}}))
    with pytest.raises(SpecError, match=r"spec.training.lora.critic: this job has no critic"):
        parse_job(_job({"lora": {"critic": True}}))  # GRPO


def test_a_lora_job_keeps_its_reference_on_the_actors_pool():
    apart = {"actor": "a", "rollout": "a", "reference": "b"}
    with pytest.raises(SpecError, match=r"spec.placement.reference: with spec.training.lora the actor is its own "
                                        r"reference .* \(a\)"):
        parse_job(_job({"lora": LORA}, placement=apart, **POOLS))
    parse_job(_job({}, placement=apart, **POOLS))  # without LoRA the reference has a model of its own to place
    parse_job(_job({"lora": LORA}, placement={**apart, "reference": "a"}, **POOLS))



def test_a_lora_critic_is_accepted():
    assert parse_job(_job({"lora": {**LORA, "critic": True}}, algorithm={"name": "ppo"})).spec.training.lora.critic
