"""Scenario: the user's own data and reward on Kubernetes. The word problems sit on a PVC (mounted read-only in the
head pod) and the reward function in a ConfigMap. The job waits with a reason while the ConfigMap is missing, then
trains SmolLM2 to Succeeded, every response scored by the user's file. A job whose data file is not on the volume
fails once with the driver's own message, and is not restarted."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hybridflow_operator.policy import FOR_JOBS_LABEL
from kube.harness import wait_for

from e2e.helpers import PVC, ROOT, phase
from e2e.worlds import LocalWorld

EXAMPLE = ROOT / "examples" / "word-problems.yaml"
REWARD = ROOT / "examples" / "rewards" / "word_problem_reward.py"
DATA_CLAIM, REWARD_CM = "word-problems", "word-problem-reward"
STEPS = 1  # one step shows the data read from the volume and scored by the ConfigMap's file

# Appended to the user's file in the ConfigMap: each call also tries what a reward function must not be able to do
# (issue 24 N4), and reports it as extra keys, which become step metrics (`reward_<key>_mean`). The target is the
# head pod's Ray GCS (port 6379 at its own pod address, found in /etc/hosts by the pod's name): reachable from the
# pod outside the sandbox by construction (the worker pods' raylets connect to it, or the job would not run), and
# allowed by the job's NetworkPolicy, so only the sandbox's network namespace can refuse it.
EGRESS_PROBE = """

import os as _os
import socket as _socket

_scored = compute_score


def _head_address():
    with open("/etc/hosts") as f:  # the sandbox's read-only view of the pod's files; no DNS is needed
        found = [line.split()[0] for line in f if line.split()[1:2] == [%(head)r]]
    return found[0] if found else None


def _connects(address):
    try:
        _socket.create_connection((address, 6379), timeout=2).close()
        return 1.0
    except OSError:
        return 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    out = dict(_scored(data_source, solution_str, ground_truth, extra_info))
    address = _head_address()
    out["egress_target"] = float(address is not None)
    out["egress_connected"] = _connects(address) if address else 0.0
    out["egress_loopback"] = _connects("127.0.0.1")
    out["credentials_seen"] = float(any(k == "RAY_AUTH_TOKEN" or k.startswith("AWS_") for k in _os.environ))
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
    reward = REWARD.read_text() + EGRESS_PROBE % {"head": f"{name}-head-g0"}
    cm.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": {"name": REWARD_CM, "labels": {FOR_JOBS_LABEL: "true"}},
                                  "data": {REWARD.name: reward}}))
    world.kubectl("apply", "--validate=false", "-f", str(cm))

    head = f"{name}-head-g0"
    wait_for(lambda: phase(world, name) in ("Succeeded", "Failed"), 900,
             lambda: f"the end; {world.logs(head)[-4000:]}")
    st = world.kube.status(name)
    assert st["phase"] == "Succeeded", (st, world.logs(head)[-3000:])
    assert st["restarts"] == 0 and _condition(world, name, "InputsReady")["status"] == "True"
    logs = world.logs(head)
    assert "prompts: 60 for training, 4 held out" in logs, logs[-3000:]  # 64 rows on the volume, 4 held out
    records = world.step_records(name)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # scored by the ConfigMap's file: its extra key is there, nothing failed
        assert r["reward_errors"] == 0 and 0 <= r["reward_answered_mean"] <= 1, r
    # Issue 24 N4, the egress proof: the reward ran in the sandbox (the driver warns at start when a layer is
    # missing; here none may be), found the head's address, and never reached it, nor the pod's loopback, nor saw a
    # credential. NetworkPolicy is not enforced here (e2e/README.md): the sandbox's network namespace refused it.
    no_network = [line for line in logs.splitlines()
                  if "partial sandbox" in line and "network" in line.split("; it keeps")[0]]
    if no_network and not isinstance(world, LocalWorld):  # a cluster whose pods may not make namespaces
        pytest.skip(f"the sandbox has no network layer in this cluster's pods, so only the NetworkPolicy limits a "
                    f"reward function's egress here: {no_network[0]}")
    assert not no_network, no_network  # the e2e pods offer every layer: bwrap in a user namespace
    for r in records:
        assert r["reward_egress_target_mean"] == 1.0, r  # the probe had its target: the refusal below means it
        assert r["reward_egress_connected_mean"] == 0.0 and r["reward_egress_loopback_mean"] == 0.0, r
        assert r["reward_credentials_seen_mean"] == 0.0, r


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
