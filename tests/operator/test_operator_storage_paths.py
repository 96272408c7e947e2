"""Where a job's checkpoints, models and caches live: every path resolved inside the job's own volumes or
object-storage prefix, or refused naming the field."""
import json

import kubernetes_validate
import pytest

from hybridflow.api import SpecError, parse_job
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import iso
from hybridflow_operator.progress import merge_progress
from support.operator_views import K8S_VERSIONS, NOW, _raw, _all_manifests, _pods, CK, RM, _with_trainer, _Cluster


@pytest.mark.parametrize("checkpoint_dir, expected", [
    ("s3://bucket/runs", "s3://bucket/runs/ml/tiny-grpo"),
    ("s3://bucket/runs/", "s3://bucket/runs/ml/tiny-grpo"),
    ("s3://bucket", "s3://bucket/ml/tiny-grpo"),
    ("gs://bucket/a/b", "gs://bucket/a/b/ml/tiny-grpo"),
    ("s3://bucket/runs/ml/tiny-grpo", "s3://bucket/runs/ml/tiny-grpo"),  # already the job's own: kept
])
def test_object_storage_checkpoint_dir_stays_a_url_with_the_jobs_own_prefix_and_needs_no_pvc(checkpoint_dir,
                                                                                              expected):
    from hybridflow_operator.accept import look_up_inputs
    from hybridflow_operator.policy import Policy

    trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], "checkpointDir": checkpoint_dir}
    raw = _raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointSecret": "team-s3"})
    job = parse_job(raw)
    objs = _all_manifests(raw)
    ran = parse_job(json.loads(next(o for o in objs if o["kind"] == "ConfigMap")["data"][mf.SPEC_KEY]))
    assert ran.spec.trainer.checkpoint_dir == expected  # not the PVC mount, and `s3://` not collapsed to `s3:/`
    assert mf.resolved_job(ran) == ran  # resolving again changes nothing
    for pod in _pods(objs):
        assert "checkpoints" not in {v["name"] for v in pod["spec"]["volumes"]}
        assert mf.CHECKPOINT_MOUNT not in {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    # nothing to look up: no PVC is needed (and the Secret is never read)
    assert look_up_inputs(_Cluster(), Policy.from_env(), job, "ml", {}) == ("", None)
    status: dict = {}
    merge_progress(status, {"step": 2, "lastCheckpointStep": 2}, ran.spec.trainer.checkpoint_dir, iso(NOW))
    assert status["lastCheckpoint"] == f"{expected}/step_00000002"
    # a checkpointPvc as well: the URL still names where checkpoints go
    raw["spec"]["kubernetes"]["checkpointPvc"] = "ck"
    assert mf.resolved_job(parse_job(raw)).spec.trainer.checkpoint_dir == expected


@pytest.mark.parametrize("live_dir, counts_as_a_change", [
    ("s3://bucket/runs", False),  # as accepted
    ("s3://other-bucket/runs", True),  # the job would go on writing to the old bucket: say so
    ("./runs/elsewhere", True),  # from object storage to the claim
])
def test_editing_an_object_storage_checkpoint_dir_on_a_live_job_is_a_spec_change(live_dir, counts_as_a_change):
    """The operator compares the live spec with the accepted one (all but runPolicy) to report SpecChangeIgnored.
    A checkpoint directory on the claim is the operator's own choice and never compared; an s3:// URL is the
    author's."""
    from hybridflow_operator.accept import spec_fields

    def job(checkpoint_dir: str, **k8s):
        trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], "checkpointDir": checkpoint_dir}
        return parse_job(_raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointPvc": "ck",
                                                                            "checkpointSecret": "team-s3", **k8s}))

    accepted = mf.resolved_job(job("s3://bucket/runs"))
    live = mf.resolved_job(job(live_dir))
    assert (spec_fields(live) != spec_fields(accepted)) is counts_as_a_change
    # on the claim, whatever the spec says is replaced by the job's own directory: not a change
    assert spec_fields(mf.resolved_job(job("./a"))) == spec_fields(mf.resolved_job(job("./b")))


def test_checkpoint_url_refuses_names_that_would_leave_the_prefix():
    assert mf.job_checkpoint_url("s3://b/p", None, "j") == "s3://b/p/j"
    for ns, name in (("..", "j"), ("ml", "a/b"), ("ml", "")):
        with pytest.raises(ValueError):
            mf.job_checkpoint_url("s3://b/p", ns, name)
    assert not mf.is_url("./runs/x") and not mf.is_url("/var/x") and not mf.is_url("s3:/b/x")
    assert mf.is_url("s3://b") and mf.is_url("gs://b/x")


def _ran(objs: list[dict]):
    """The spec the pods run: the ConfigMap's."""
    return parse_job(json.loads(next(o for o in objs if o["kind"] == "ConfigMap")["data"][mf.SPEC_KEY]))


def _claim_mounts(objs: list[dict], volume: str) -> list[list[dict]]:
    """Per pod (container and init containers), the mounts of `volume`, each pod validated strictly."""
    out = []
    for pod in _pods(objs):
        for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
            kubernetes_validate.validate(pod, version, strict=True)
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            out.append([m for m in c.get("volumeMounts", []) if m["name"] == volume])
    return out


@pytest.mark.parametrize("resume_from, source", [
    ("tiny-grpo-2pods", "ml/tiny-grpo-2pods"),  # the old job's newest intact checkpoint
    ("tiny-grpo-2pods/step_00000006", "ml/tiny-grpo-2pods/step_00000006"),
    (f"{CK}/ml/tiny-grpo-2pods", "ml/tiny-grpo-2pods"),  # as the whole claim was once mounted: the same checkpoint
    (f"{RM}/ml/tiny-grpo-2pods/", "ml/tiny-grpo-2pods"),  # already resolved: kept
])
def test_resume_from_names_a_checkpoint_of_this_namespace_on_the_claim(resume_from, source):
    """How a job is resized: a new job (another pool size or tensorParallel) resumes from the old one's checkpoint
    in this namespace's directory on the shared claim. Issue 24 N6: the claim is never mounted whole; the job's own
    directory read-write, the source job's read-only by its own subPath, each where the spec the pods run names it.
    Issue 51 L2: that subPath is `<namespace>/<job>` only, also when resumeFrom names one of its checkpoints (the
    kubelet would follow a step_N planted as a link; the runtime opens step_N inside, never through a link)."""
    objs = _all_manifests(_with_trainer(resumeFrom=resume_from, kubernetes={"checkpointPvc": "ck"}))
    ran = _ran(objs)
    assert ran.spec.trainer.resume_from == f"{RM}/{source}"
    assert ran.spec.trainer.checkpoint_dir == f"{CK}/ml/tiny-grpo"
    assert mf.resolved_job(ran) == ran
    mounts = _claim_mounts(objs, "checkpoints")
    assert len(mounts) >= 3  # the head's controller, the worker, the worker's init container
    for per_container in mounts:
        if not per_container:
            continue  # an init container that only waits for the head
        assert per_container == [
            {"name": "checkpoints", "mountPath": f"{CK}/ml/tiny-grpo", "subPath": "ml/tiny-grpo"},
            {"name": "checkpoints", "mountPath": f"{RM}/ml/tiny-grpo-2pods", "subPath": "ml/tiny-grpo-2pods",
             "readOnly": True}]
    assert sum(1 for m in mounts if m) >= 2


def test_the_checkpoint_claim_is_mounted_by_the_jobs_own_subpath_only():
    """Issue 24 N6: job A cannot reach job B's step_N on a shared claim; without resumeFrom only the job's own
    `<namespace>/<job>` directory of it is in the pods, read-write; the claim volume itself is unchanged."""
    objs = _all_manifests(_with_trainer(kubernetes={"checkpointPvc": "ck"}))
    mounts = [m for per in _claim_mounts(objs, "checkpoints") for m in per]
    assert mounts and all(m == {"name": "checkpoints", "mountPath": f"{CK}/ml/tiny-grpo", "subPath": "ml/tiny-grpo"}
                          for m in mounts)
    for pod in _pods(objs):
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ck"}} in pod["spec"]["volumes"]


@pytest.mark.parametrize("resume_from", [
    f"{CK}/other-team/their-job",  # another namespace's, as the whole claim was once mounted
    f"{RM}/other-team/their-job",
    "other-team/their-job",  # <job>/<something> that is not one of its checkpoints
    "tiny-grpo-2pods/step_6",
    "tiny-grpo-2pods/step_00000006/actor",
    "/etc/hybridflow",  # elsewhere in the pod
    "Not-A-Job",
])
def test_resume_from_outside_this_namespace_on_the_claim_is_refused(resume_from):
    """Issue 24 N3/N6: before, another namespace's path was nested under this one's (a checkpoint that is not
    there); now the job is refused, naming the field and what to give instead."""
    raw = _with_trainer(resumeFrom=resume_from, kubernetes={"checkpointPvc": "ck"})
    with pytest.raises(SpecError, match=r"spec\.trainer\.resumeFrom: .* is not a checkpoint of namespace ml on "
                                        r"kubernetes\.checkpointPvc 'ck'; name a job of this namespace"):
        _all_manifests(raw)


@pytest.mark.parametrize("resume_from, expected", [
    ("old-job", "s3://bucket/runs/ml/old-job"),
    ("old-job/step_00000002", "s3://bucket/runs/ml/old-job/step_00000002"),
    ("s3://bucket/runs/ml/old-job", "s3://bucket/runs/ml/old-job"),
    ("s3://bucket/runs/ml/old-job/step_00000002/", "s3://bucket/runs/ml/old-job/step_00000002"),
])
def test_resume_from_on_object_storage_resolves_under_the_base_prefix_and_namespace(resume_from, expected):
    objs = _all_manifests(_with_trainer(checkpointDir="s3://bucket/runs", resumeFrom=resume_from,
                                        kubernetes={"checkpointSecret": "team-s3"}))
    ran = _ran(objs)
    assert (ran.spec.trainer.checkpoint_dir, ran.spec.trainer.resume_from) == ("s3://bucket/runs/ml/tiny-grpo",
                                                                                 expected)
    assert mf.resolved_job(ran) == ran
    assert not [m for per in _claim_mounts(objs, "checkpoints") for m in per]  # no claim: nothing mounted


@pytest.mark.parametrize("resume_from", [
    "s3://bucket/runs/team-b/job",  # another namespace's, the attack of issue 24 N3
    "s3://bucket/runs/team-b/job/step_00000002",
    "s3://other-bucket/runs/ml/old-job",  # another bucket
    "s3://bucket/elsewhere/ml/old-job",  # another prefix
    "s3://bucket/runs/ml/old-job/../../team-b/job",
    "gs://bucket/runs/ml/old-job",
    "s3://bucket/runs/ml",
])
def test_resume_from_another_namespace_on_object_storage_is_refused(resume_from):
    raw = _with_trainer(checkpointDir="s3://bucket/runs", resumeFrom=resume_from,
                        kubernetes={"checkpointSecret": "team-s3"})
    with pytest.raises(SpecError, match=r"spec\.trainer\.resumeFrom: .* is not a checkpoint of namespace ml under "
                                        r"s3://bucket/runs/ml/; .* or a URL under s3://bucket/runs/ml/"):
        mf.resolved_job(parse_job(raw))


def test_resume_from_on_object_storage_needs_a_checkpoint_dir_there():
    raw = _with_trainer(resumeFrom="s3://bucket/runs/ml/old-job",
                        kubernetes={"checkpointPvc": "ck", "checkpointSecret": "team-s3"})
    with pytest.raises(SpecError, match=r"spec\.trainer\.resumeFrom: .* is on object storage, but "
                                        r"spec\.trainer\.checkpointDir is not"):
        mf.resolved_job(parse_job(raw))


@pytest.mark.parametrize("trainer", [{"checkpointDir": "s3://bucket/runs"},
                                     {"checkpointDir": "az://container/runs", "resumeFrom": "old-job"},
                                     {"resumeFrom": "s3://bucket/runs/ml/old-job"}])
def test_object_storage_without_a_checkpoint_secret_is_refused(trainer):
    """Issue 24 N3: without the job's own credentials the SDKs would use the node's cloud identity."""
    raw = _with_trainer(**trainer)
    with pytest.raises(SpecError, match=r"spec\.kubernetes\.checkpointSecret: spec\.trainer\.(checkpointDir|"
                                        r"resumeFrom) '.*' is on object storage, and no Secret gives the pods"):
        mf.resolved_job(parse_job(raw))


def test_model_claim_is_mounted_read_only_by_each_models_subpath():
    """Issue 24 N6: kubernetes.modelPvc shows the pods the directories the spec names, not the claim's others."""
    objs = _all_manifests(_raw("gpu-grpo-7b.yaml"))
    mounts = [m for per in _claim_mounts(objs, "models") for m in per]
    assert mounts and all(m == {"name": "models", "mountPath": "/models/Qwen2.5-7B-Instruct", "readOnly": True,
                                "subPath": "Qwen2.5-7B-Instruct"} for m in mounts)
    # a path relative to the claim, and one model inside another's directory (seen through the outer mount)
    models = {"actor": {"source": "path", "path": "team/base"},
              "reward": {"type": "model", "model": {"source": "path", "path": "/models/team/base/rm"}}}
    raw = _raw("gpu-grpo-7b.yaml", models=models)
    ran = _ran(objs := _all_manifests(raw))
    assert (ran.spec.models.actor.path, ran.spec.models.reward.model.path) == ("/models/team/base",
                                                                              "/models/team/base/rm")
    assert {m["subPath"] for per in _claim_mounts(objs, "models") for m in per} == {"team/base"}


def test_a_judges_model_on_the_model_claim_is_mounted_by_its_subpath():
    """A judge's `path` model is a model of the job like the others: its path resolved onto the claim, its
    directory mounted on the pods that load it."""
    base = _raw("gpu-grpo-7b.yaml")["spec"]
    judges = {**base["resourcePools"][0], "name": "judges", "nodes": 1}
    raw = _raw("gpu-grpo-7b.yaml", models={**base["models"], "reward": {
        "weights": {"scorers": 0.5, "judge": 0.5}, "scorers": base["models"]["reward"]["scorers"],
        "judge": {"model": {"source": "path", "path": "team/judge"}, "parser": "matches"}}},
        resourcePools=[base["resourcePools"][0], judges], placement={"judge": "judges"})
    objs = _all_manifests(raw)
    assert _ran(objs).spec.models.reward.judge.model.path == "/models/team/judge"
    assert "team/judge" in {m["subPath"] for per in _claim_mounts(objs, "models") for m in per}


@pytest.mark.parametrize("path", ["/opt/models/x", "/models/../etc", "team/../../etc"])
def test_a_model_path_off_the_model_claim_is_refused(path):
    models = {**_raw("gpu-grpo-7b.yaml")["spec"]["models"], "actor": {"source": "path", "path": path}}
    raw = _raw("gpu-grpo-7b.yaml", models=models)
    with pytest.raises(SpecError, match=r"spec\.models\.actor\.path: with kubernetes\.modelPvc, give the model's "
                                        r"directory on that claim"):
        mf.resolved_job(parse_job(raw))


@pytest.mark.parametrize("cache_dir, expected", [
    ("prompt-cache", "/tmp/prompt-cache"),  # relative: the pod's scratch
    ("/tmp/x", "/tmp/x"),
    (f"{CK}/ml/tiny-grpo/cache", f"{CK}/ml/tiny-grpo/cache"),  # inside the job's own directory on the claim
    (f"{CK}/ml/other-job/cache", None),  # another job's directory
    ("/etc/hybridflow/cache", None),
    ("/tmp/../etc", None),
])
def test_cache_dir_is_confined_to_the_jobs_own_directories(cache_dir, expected):
    raw = _with_trainer(kubernetes={"checkpointPvc": "ck"})
    raw["spec"]["data"] = {**raw["spec"]["data"], "cacheDir": cache_dir}
    if expected is None:
        with pytest.raises(SpecError, match=r"spec\.data\.cacheDir: .* is outside this job's own directories"):
            mf.resolved_job(parse_job(raw))
        return
    ran = _ran(objs := _all_manifests(raw))
    assert ran.spec.data.cache_dir == expected and mf.resolved_job(ran) == ran
    _claim_mounts(objs, "checkpoints")  # the pods validate


def test_resume_from_may_not_climb_out_of_its_directory():
    trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], "resumeFrom": "../other-team/their-job"}
    with pytest.raises(SpecError, match=r"resumeFrom.*climbs out of its directory"):
        parse_job(_raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointPvc": "ck"}))
    # nor around it: a path in URL clothes (file://, local://) would not be confined; http(s) would fetch anything
    for field in ("resumeFrom", "checkpointDir"):
        for url in (f"file://{CK}/other-team/their-job", f"local://{CK}/other-team/x", "http://10.0.0.1/x"):
            trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], field: url}
            with pytest.raises(SpecError, match=rf"{field}.*is not object storage; use a plain path"):
                parse_job(_raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointPvc": "ck"}))
