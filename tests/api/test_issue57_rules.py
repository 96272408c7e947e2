"""Issue 57's fields, refused at validation with the field named and the way out: spec.trainer.profileSteps names
steps the job runs, each once."""
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
