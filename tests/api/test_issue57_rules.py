"""Issue 57's fields, refused at validation with the field named and the way out: spec.trainer.profileSteps names
steps the job runs, each once; FSDP's communication switches (spec.training.keepGatheredForBackward,
reduceGradientsPerStep) are not "on" with an engine that gathers nothing, which would ignore them."""
import pytest

from hybridflow.api import SpecError, parse_job


def _job(**spec) -> dict:
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"}, "spec": spec}


def test_profile_steps_are_steps_the_job_runs_each_once():
    assert parse_job(_job(trainer={"steps": 5, "profileSteps": [5, 2]})).spec.trainer.profile_steps == [5, 2]
    with pytest.raises(SpecError, match=r"spec.trainer.profileSteps: steps \[6, 9\] are beyond spec.trainer.steps "
                                        r"= 5: the job never runs them; name steps from 1 to 5, or raise "
                                        r"spec.trainer.steps"):
        parse_job(_job(trainer={"steps": 5, "profileSteps": [9, 2, 6]}))
    with pytest.raises(SpecError, match=r"spec.trainer.steps = 20"):  # the default's 20 steps
        parse_job(_job(trainer={"profileSteps": [21]}))
    with pytest.raises(SpecError, match=r"spec.trainer.profileSteps: steps \[2\] are named more than once; name each "
                                        r"step once"):
        parse_job(_job(trainer={"profileSteps": [2, 3, 2]}))
    with pytest.raises(SpecError) as err:  # steps itself invalid: said once, on steps
        parse_job(_job(trainer={"steps": 0, "profileSteps": [3]}))
    assert "spec.trainer.steps: Input should be greater than 0" in str(err.value)
    assert "profileSteps" not in str(err.value)


@pytest.mark.parametrize("field", ["keepGatheredForBackward", "reduceGradientsPerStep"])
def test_an_fsdp_switch_on_with_an_engine_that_gathers_nothing_is_refused(field):
    with pytest.raises(SpecError, match=rf'spec.training.{field}: "on" does nothing with the megatron engine, which '
                                        r'shards by tensorParallel x pipelineParallel and gathers nothing \(the switch '
                                        r'is FSDP\'s\); leave it "auto" or set it "off"'):
        parse_job(_job(training={"engine": "megatron", field: "on"}))
    for value in ("auto", "off"):
        parse_job(_job(training={"engine": "megatron", field: value}))
    parse_job(_job(training={field: "on"}))  # FSDP gathers
