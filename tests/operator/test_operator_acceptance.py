"""Accepting a job: the accepted spec (read back from its own ConfigMap), spec changes, and the code files
copied, checked and owned."""
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hybridflow.api import SpecError, parse_job
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import transition
from support.operator_views import K8S_VERSIONS, NOW, _raw, pods, _files_job, CK, _with_trainer, _Cluster


def test_an_accepted_job_is_compared_resolved_and_an_edit_it_may_not_have_is_only_ignored():
    """A spec accepted by an older operator (resumeFrom below the whole claim's mount, a relative cacheDir) is the
    same job, not an edit; once accepted, an edit naming another namespace's checkpoint or object storage without
    credentials is a change to ignore (the job keeps running), not a SpecError that fails it."""
    from hybridflow_operator.accept import accepted_job

    def job(**trainer):
        raw = _with_trainer(kubernetes={"checkpointPvc": "ck"}, **trainer)
        raw["spec"]["data"] = {**raw["spec"]["data"], "cacheDir": "prompt-cache"}
        return raw, parse_job(raw)

    raw, live = job(resumeFrom="tiny-grpo-2pods")
    _, old = job(checkpointDir=f"{CK}/ml/tiny-grpo", resumeFrom=f"{CK}/ml/tiny-grpo-2pods")
    memo = {"accepted": old}
    accepted, changed = accepted_job(_Cluster(), live, "1234-abcd", {}, memo)
    assert accepted == old and not changed
    for edit in ({"resumeFrom": "s3://bucket/runs/team-b/job"}, {"resumeFrom": f"{CK}/team-b/job"},
                 {"checkpointDir": "s3://bucket/runs"}):
        _, edited = job(**edit)
        with pytest.raises(SpecError):
            mf.resolved_job(edited)  # refused at acceptance
        accepted, changed = accepted_job(_Cluster(), edited, "1234-abcd", {}, memo)
        assert accepted == old and changed, edit


def test_a_job_created_suspended_is_accepted_at_once():
    """Issue 24 N1: its spec ConfigMap (and digest) is made at the first tick, suspended or not, so a spec edited
    while it waits is a change to ignore, never what its first pods are made of."""
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"suspend": True}))
    plan = transition(job, None, {}, [], NOW)
    assert plan.status["phase"] == "Suspending" and plan.create_static and plan.create_gang is None
    later = transition(job, None, {"phase": "Running", "restarts": 0}, pods(), NOW)
    assert later.status["phase"] == "Suspending" and not later.create_static  # a suspend later: nothing to make


def test_pods_use_only_what_the_accepted_spec_names():
    """At every gang start the pods are checked against the accepted spec: a Secret, ConfigMap, PVC or
    ServiceAccount it does not name, or the user's reward ConfigMap mounted in place of the job's copy, is
    refused."""
    accepted = parse_job(_files_job(rewardConfigMap="my-reward", dataPvc="prompts"))
    raw = _files_job(rewardConfigMap="my-reward", dataPvc="prompts")
    uid = raw["metadata"]["uid"]
    assert mf.foreign_references(mf.gang_pods(accepted, uid, 0), accepted) == []
    assert ("ConfigMap", "word-problems-reward") in mf.pod_references(mf.gang_pods(accepted, uid, 0))
    edited = _files_job(rewardConfigMap="my-reward", dataPvc="other-data", rayAuthSecret="builder-token",
                        checkpointSecret="s3-admin", serviceAccountName="deployer")
    assert mf.foreign_references(mf.gang_pods(parse_job(edited), edited["metadata"]["uid"], 0), accepted) == [
        "PersistentVolumeClaim other-data", "Secret builder-token", "Secret s3-admin", "ServiceAccount deployer"]
    pods_ = mf.gang_pods(accepted, uid, 0)
    pods_[0]["spec"]["volumes"].append({"name": "x", "configMap": {"name": "my-reward"}})
    pods_[0]["spec"]["volumes"].append({"name": "p", "projected": {"sources": []}})
    pods_[1]["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "db"}}]
    assert mf.foreign_references(pods_, accepted) == ["ConfigMap my-reward", "Secret db", "projected volume p"]


def test_the_reward_copy_is_immutable_owned_and_bounded():
    raw = _files_job(rewardConfigMap="my-reward")
    job = parse_job(raw)
    cm = mf.reward_configmap(job, raw["metadata"]["uid"], "def compute_score(*a): return 1\n")
    assert cm["immutable"] is True and cm["metadata"]["name"] == "word-problems-reward"
    assert cm["data"] == {"word_problem_reward.py": "def compute_score(*a): return 1\n"}
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
    kubernetes_validate.validate(cm, K8S_VERSIONS[-1], strict=True)
    assert mf.reward_copy_problem("r.py", "x" * (mf.MAX_CONFIGMAP_BYTES - 4)) == ""
    assert "a ConfigMap holds at most 1048576 (1 MiB)" in mf.reward_copy_problem("r.py", "x" * mf.MAX_CONFIGMAP_BYTES)


def _owned(uid: str, **data) -> dict:
    return {"metadata": {"ownerReferences": [{"uid": uid, "controller": True}]}, "data": data}


def test_the_accepted_spec_is_json_only_and_never_replaced_by_an_edited_live_one():
    """Issue 24 N7: a spec ConfigMap without job.json (an older operator's job.yaml, or a YAML alias bomb) is not
    the job's spec, even owned by the job: YAML is never parsed. N1: once a digest is recorded, a spec ConfigMap
    that is gone is not replaced by the live spec unless that is exactly the one accepted."""
    from hybridflow_operator import accept

    raw = _raw("tiny-grpo.yaml")
    live = parse_job(raw)
    text = mf.spec_text(live)
    yaml_only = _Cluster(**{"ConfigMap:tiny-grpo-spec": _owned("1234-abcd", **{"job.yaml": yaml.safe_dump(raw)})})
    with pytest.raises(SpecError, match=r"does not hold the spec this job started with \(digest none \(no key job"):
        accept.accepted_job(yaml_only, live, "1234-abcd", {}, {})
    gone = _Cluster()
    accepted = {"acceptedSpecDigest": mf.content_digest(text)}
    assert accept.accepted_job(gone, live, "1234-abcd", accepted, {}) == (live, False)  # a create to retry
    edited = parse_job(_raw("tiny-grpo.yaml", kubernetes={"rayAuthSecret": "builder-token"}))
    with pytest.raises(SpecError, match="which held the spec this job was accepted with, is gone"):
        accept.accepted_job(gone, edited, "1234-abcd", accepted, {})


def test_a_reward_copy_is_used_only_when_it_is_the_jobs_and_remade_only_from_the_accepted_file():
    from hybridflow_operator import children
    from hybridflow_operator.policy import Policy

    raw = _files_job(rewardConfigMap="my-reward")
    job = parse_job(raw)
    key, good = "word_problem_reward.py", "def compute_score(*a): return 1\n"
    status = {"rewardDigest": mf.content_digest(good)}
    marked = {"metadata": {"labels": {"hybridflow.io/for-jobs": "true"}}}

    def copy_in(world: _Cluster):
        return children.reward_to_copy(world, Policy.from_env(), job, raw["metadata"]["uid"], status, None)

    # there, and the job's: nothing to make
    assert copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned("1234-abcd", **{key: good})})) is None
    with pytest.raises(SpecError, match="word-problems-reward exists but was not made for this job"):
        copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned("someone-else", **{key: good})}))
    with pytest.raises(SpecError, match="word-problems-reward does not hold what this job was accepted with"):
        copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned("1234-abcd", **{key: "import os\n"})}))
    # the copy gone: made again from the same file
    assert copy_in(_Cluster(**{"ConfigMap:my-reward": {**marked, "data": {key: good}}})) == {key: good}
    with pytest.raises(SpecError, match="no longer holds the files accepted"):  # ... never from an edited one
        copy_in(_Cluster(**{"ConfigMap:my-reward": {**marked, "data": {key: "import os\n"}}}))


def _agent_job(tools="tools.py", env="game.py", **k8s) -> dict:
    """The word-problems job with an agent whose tools and environment are the user's files."""
    raw = _files_job(**k8s)
    raw["spec"]["rollout"]["agent"] = {k: v for k, v in (("toolsFile", tools), ("environmentFile", env)) if v}
    return raw


def test_tools_and_environment_files_are_keys_of_the_code_configmap_and_resolved_into_its_copy():
    """Issue 51 M5: kubernetes.rewardConfigMap holds every code file of the job; the spec the pods run names each
    inside the mount of the job's copy, the sandbox pods mount that copy (never the user's ConfigMap, never the data
    claim), and every key is copied."""
    from hybridflow_operator import environments as envs

    raw = _agent_job(dataPvc="prompts", rewardConfigMap="my-code")
    job = parse_job(raw)
    assert mf.code_keys(job) == {"word_problem_reward.py": "spec.models.reward.function.path",
                                 "tools.py": "spec.rollout.agent.toolsFile",
                                 "game.py": "spec.rollout.agent.environmentFile"}
    ran = mf.resolved_job(job)
    agent = ran.spec.rollout.agent
    assert (agent.tools_file, agent.environment_file) == (f"{mf.REWARD_MOUNT}/tools.py", f"{mf.REWARD_MOUNT}/game.py")
    assert ran.spec.models.reward.function.path == f"{mf.REWARD_MOUNT}/word_problem_reward.py"
    assert mf.resolved_job(ran) == ran  # idempotent
    assert mf.code_keys(ran) == mf.code_keys(job)
    pod = envs.environment_pod(job, "1234-abcd", 0)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["reward"] == {"name": "reward", "configMap": {"name": "word-problems-reward"}}
    assert not [v for v in vols.values() if "persistentVolumeClaim" in v]  # the data claim: prompts only, head only
    files = {"word_problem_reward.py": "def compute_score(*a): return 1\n", "tools.py": "def add(a: int): ...\n",
             "game.py": "class Environment: ...\n"}
    cm = mf.reward_configmap(job, "1234-abcd", files)
    assert cm["data"] == files and cm["immutable"] is True
    assert mf.code_digests(files) == {k: mf.content_digest(v) for k, v in sorted(files.items())}
    assert mf.code_copy_problem(files) == ""
    big = {**files, "game.py": "x" * mf.MAX_CONFIGMAP_BYTES}
    assert "the job's code files (game.py, tools.py, word_problem_reward.py) are" in mf.code_copy_problem(big)
    # an agent job scored by its environment alone: the code ConfigMap holds its tools and environment, no reward
    raw = _agent_job(rewardConfigMap="my-code")
    raw["spec"]["models"]["reward"] = {"type": "scorer", "scorers": [{"name": "math"}]}
    job = parse_job(raw)
    assert set(mf.code_keys(job)) == {"tools.py", "game.py"} and mf.reward_key(job) == ""
    assert {v["name"] for v in envs.environment_pod(job, "1234-abcd", 0)["spec"]["volumes"]} >= {"reward"}


@pytest.mark.parametrize("change, field", [
    ({"tools": "tools.py"}, "spec.rollout.agent.toolsFile"),
    ({"tools": None, "env": "envs/game.py"}, "spec.rollout.agent.environmentFile"),
    ({"tools": None, "env": None, "reward": "/data/rewards/r.py"}, "spec.models.reward.function.path"),
])
def test_a_code_file_on_the_data_claim_is_refused_naming_the_field_and_the_way_out(change, field, tmp_path, capsys):
    """Issue 51 M5: the operator cannot read a claim, so code read from kubernetes.dataPvc could change under a
    running job: refused at validation (parse_job: the operator's acceptance and `hybridflow validate` alike), and by
    resolved_job for a spec edited past it; the message names the field and the ConfigMap key to use instead."""
    from hybridflow.cli import main

    raw = _agent_job(tools=change.get("tools"), env=change.get("env"), dataPvc="prompts")
    if change.get("reward"):
        raw["spec"]["rollout"]["agent"] = {"tools": ["calculator"]}
        raw["spec"]["models"]["reward"]["function"]["path"] = change["reward"]
    key = Path(change.get("reward") or change.get("env") or change["tools"]).name
    with pytest.raises(SpecError) as err:
        parse_job(raw)
    msg = str(err.value)
    assert f"{field}: '" in msg and "would be read from kubernetes.dataPvc" in msg, msg
    assert f"put the file in kubernetes.rewardConfigMap (the job's code ConfigMap) under the key '{key}'" in msg, msg
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(manifest)]) == 2
    assert "would be read from kubernetes.dataPvc" in capsys.readouterr().err
    # the same spec with the code ConfigMap: accepted, the file a key of it
    raw["spec"]["kubernetes"]["rewardConfigMap"] = "my-code"
    if change.get("reward"):
        raw["spec"]["models"]["reward"]["function"]["path"] = key
    elif change.get("env"):
        raw["spec"]["rollout"]["agent"]["environmentFile"] = key
    job = parse_job(raw)
    assert key in mf.code_keys(job)
    # resolved_job refuses it too (a spec changed after parsing, or an older operator's accepted one)
    job.spec.kubernetes.reward_config_map = None
    if change.get("reward"):
        job.spec.models.reward.function.path = change["reward"]
    with pytest.raises(SpecError, match="would be read from kubernetes.dataPvc"):
        mf.resolved_job(job)


def test_a_tools_file_with_the_code_configmap_must_be_one_of_its_keys():
    with pytest.raises(SpecError, match=r"spec.rollout.agent.toolsFile: with kubernetes.rewardConfigMap it is the "
                                        r"ConfigMap's key \(a file name such as tools.py\), got 'agents/tools.py'"):
        parse_job(_agent_job(tools="agents/tools.py", rewardConfigMap="my-code"))


def test_every_code_file_is_copied_and_checked_and_a_missing_key_is_named():
    """Issue 51 M5: the copy must hold every key status.codeDigests recorded, and nothing else; a key missing from
    the user's ConfigMap holds the job Pending naming it; a job accepted before codeDigests (status.rewardDigest
    only) keeps its copy."""
    from hybridflow_operator import accept, children
    from hybridflow_operator.policy import Policy

    raw = _agent_job(rewardConfigMap="my-code")
    job, uid = parse_job(raw), raw["metadata"]["uid"]
    files = {"word_problem_reward.py": "def compute_score(*a): return 1\n", "tools.py": "def add(a: int): ...\n",
             "game.py": "class Environment: ...\n"}
    status = {"codeDigests": mf.code_digests(files)}
    marked = {"labels": {"hybridflow.io/for-jobs": "true"}}

    def copy_in(world: _Cluster, st=status):
        return children.reward_to_copy(world, Policy.from_env(), job, uid, st, None)

    assert copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned(uid, **files)})) is None
    for bad in ({**files, "tools.py": "import os\n"}, {k: v for k, v in files.items() if k != "game.py"},
                {**files, "extra.py": "x = 1\n"}):
        with pytest.raises(SpecError, match="word-problems-reward does not hold what this job was accepted with"):
            copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned(uid, **bad)}))
    assert copy_in(_Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": files}})) == files  # gone: remade
    with pytest.raises(SpecError, match=r"no longer holds the files accepted \(game.py sha256:"):
        copy_in(_Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": {**files, "game.py": "import os\n"}}}))
    # accepted by an operator that copied the reward file alone: its copy is still the job's
    reward = "word_problem_reward.py"
    legacy = {"rewardDigest": mf.content_digest(files[reward])}
    assert copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned(uid, **{reward: files[reward]})}),
                   legacy) is None
    # a key missing from the user's ConfigMap: named, with the field that names it; nothing read to copy
    world = _Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": {reward: files[reward], "tools.py": "x"}}})
    why, found = accept.look_up_inputs(world, Policy.from_env(), job, "ml", {})
    assert why == ("spec.rollout.agent.environmentFile: ConfigMap 'my-code' has no key 'game.py' (its keys: "
                   "tools.py, word_problem_reward.py)") and found is None
    world = _Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": files}})
    assert accept.look_up_inputs(world, Policy.from_env(), job, "ml", {}) == ("", files)
    assert accept.look_up_inputs(world, Policy.from_env(), job, "ml", status) == ("", None)  # copied already
