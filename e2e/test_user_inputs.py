"""Scenario: the user's own data and reward on Kubernetes. The word problems sit on a PVC (mounted read-only in the
head pod) and the reward function in a ConfigMap. The job waits with a reason while the ConfigMap is missing, then
trains SmolLM2 to Succeeded, every response scored by the user's file. A job whose data file is not on the volume
fails once with the driver's own message, and is not restarted."""
from __future__ import annotations

import subprocess
import sys

import yaml
from hybridflow_operator.policy import FOR_JOBS_LABEL
from kube.harness import wait_for

from e2e import containment
from e2e.helpers import PVC, ROOT, phase
from e2e.worlds import LocalWorld

EXAMPLE = ROOT / "examples" / "word-problems.yaml"
REWARD = ROOT / "examples" / "rewards" / "word_problem_reward.py"
DATA_CLAIM, REWARD_CM = "word-problems", "word-problem-reward"
STEPS = 1  # one step shows the data read from the volume and scored by the ConfigMap's file

# Appended to the user's file in the ConfigMap: each call also runs the containment probe (e2e/containment.py: the
# job's credentials in any environment it can read, a connection to the head pod's Ray GCS, a daemon out of its
# session) and reports it as extra keys, which become step metrics (`reward_<key>_mean`). The GCS is reachable from
# the job's pods by construction (the worker pods' raylets connect to it, or the job would not run): only where the
# function runs, a sandbox pod that holds no credential and may connect nowhere, keeps it out.
PROBE = """

_scored = compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    out = dict(_scored(data_source, solution_str, ground_truth, extra_info))
    out.update(_containment(%(head)r))
    return out
"""


def _claim(name: str) -> dict:
    doc = yaml.safe_load(PVC.read_text())
    doc["metadata"]["name"] = name
    return doc


def _job(tmp_path, name: str, train: list[str]):
    """examples/word-problems.yaml, shaped for the cluster and cut to two small steps."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    s = doc["spec"]
    s["data"].update(train=train, evalPrompts=4)
    s["models"]["reward"]["function"]["path"] = REWARD.name  # the ConfigMap's key
    s["rollout"].update(responsesPerPrompt=2, maxResponseLength=16)
    s["training"]["microBatchSize"] = 4
    s["trainer"] = {"steps": STEPS, "promptsPerStep": 4, "saveFreq": 1}
    s["resourcePools"] = [{"name": "default", "nodes": 2, "devicesPerNode": 1}]
    s["metrics"] = {"port": 8000, "lingerSeconds": 0}
    s["runPolicy"] = {"backoffLimit": 2}
    s["kubernetes"] = {"image": "hybridflow/worker-cpu:0.1.0", "checkpointPvc": f"{name}-checkpoints",
                       "dataPvc": DATA_CLAIM, "rewardConfigMap": REWARD_CM, "headMemory": "4Gi"}
    # the e2e pods run as a cluster's would (non-root, seccomp RuntimeDefault: no user namespaces, so no bubblewrap):
    # the sandbox pod's own containment is what holds, and the job says so in its SandboxPartial condition
    s["sandbox"] = {"allowPartial": True}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all([_claim(f"{name}-checkpoints"), doc], sort_keys=False))
    return path


def _condition(world, name: str, ctype: str) -> dict | None:
    return next((c for c in world.kube.status(name).get("conditions", []) if c["type"] == ctype), None)


def test_data_on_a_pvc_and_reward_in_a_configmap(world, tmp_path):
    name = "user-inputs"
    subprocess.run([sys.executable, str(ROOT / "examples" / "data" / "make_word_problems.py"), "--out",
                    str(tmp_path), "--train", "64", "--test", "8"], check=True, capture_output=True)
    claim = tmp_path / "claim.yaml"
    claim.write_text(yaml.safe_dump(_claim(DATA_CLAIM)))
    world.kubectl("apply", "--validate=false", "-f", str(claim))
    world.fill_volume(DATA_CLAIM, {"word_problems/train.jsonl": (tmp_path / "word_problems" / "train.jsonl").read_bytes()})

    world.bake_models()  # SmolLM2 as the worker image holds it
    world.kubectl("apply", "--validate=false", "-f", str(_job(tmp_path, name, ["word_problems/train.jsonl"])))
    waiting = wait_for(lambda: (c := _condition(world, name, "InputsReady")) and c["status"] == "False" and c, 60,
                       "InputsReady=False while the ConfigMap is missing")
    assert f"ConfigMap '{REWARD_CM}' not found" in waiting["message"] and phase(world, name) == "Pending"
    assert world.kube.pods(name) == []
    cm = tmp_path / "reward.yaml"  # what `kubectl create configmap --from-file` makes, applied (the double speaks JSON)
    reward = REWARD.read_text() + containment.SOURCE + PROBE % {"head": f"{name}-head-g0"}
    cm.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": {"name": REWARD_CM, "labels": {FOR_JOBS_LABEL: "true"}},
                                  "data": {REWARD.name: reward}}))
    world.kubectl("apply", "--validate=false", "-f", str(cm))

    head = f"{name}-head-g0"
    outliving: set[int] = set()

    def ended() -> bool:  # meanwhile: no daemon a reward call started outlives it (the pool's reaper kills it)
        if isinstance(world, LocalWorld):
            outliving.update(containment.daemons_outliving(seconds=3.0))
        return phase(world, name) in ("Succeeded", "Failed")

    wait_for(ended, 900, lambda: f"the end; {world.logs(head)[-4000:]}")
    st = world.kube.status(name)
    assert st["phase"] == "Succeeded", f"{st}; {world.logs(head)[-3000:]}"
    assert st["restarts"] == 0 and _condition(world, name, "InputsReady")["status"] == "True"
    logs = world.logs(head)
    assert "prompts: 60 for training, 4 held out" in logs, logs[-3000:]  # 64 rows on the volume, 4 held out
    records = world.step_records(name)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # scored by the ConfigMap's file: its extra key is there, nothing failed
        assert r["reward_errors"] == 0 and 0 <= r["reward_answered_mean"] <= 1, r
    # Issue 51, containment on a default cluster: the function ran in the sandbox pod (no layer of bubblewrap under
    # the seccomp profile: the job's condition says which), found the head's address and never reached it, saw no
    # credential in any environment it could read, and left no daemon behind. Run in the head pod it would have
    # seen the Ray token (its driver's /proc/<pid>/environ) and connected.
    partial = _condition(world, name, "SandboxPartial")
    assert partial and partial["status"] == "True" and "network" in partial["message"], st.get("conditions")
    for r in records:
        assert r["reward_head_target_mean"] == 1.0, r  # the probe had its target: the refusal below means it
        assert r["reward_head_connected_mean"] == 0.0, r
        assert r["reward_credentials_seen_mean"] == 0.0, r
    assert not outliving, f"daemons a reward call started outlived it: {sorted(outliving)}"


def test_a_data_file_missing_from_the_volume_fails_once_with_the_drivers_message(world, tmp_path):
    name = "user-inputs-bad"
    world.bake_models()  # the driver prepares SmolLM2 before it reads the data
    world.kubectl("apply", "--validate=false", "-f", str(_job(tmp_path, name, ["word_problems/missing.jsonl"])))
    wait_for(lambda: phase(world, name) in ("Succeeded", "Failed"), 300,
             f"the end; {world.logs(f'{name}-head-g0')[-4000:]}")
    st = world.kube.status(name)
    assert st["phase"] == "Failed" and st["reason"] == "InvalidInput", st
    assert "spec.data.train: '/data/word_problems/missing.jsonl' does not exist" in st["message"], st
    assert st["restarts"] == 0, "a bad input was retried"
    # kopf posts events from a background task after the status is written: wait for it, do not read it at once
    wait_for(lambda: any(e.reason == "InvalidInput" for e in world.kube.events() if e.involved_object.name == name),
             30, "the InvalidInput event")
