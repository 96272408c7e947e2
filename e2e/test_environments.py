"""Scenario: a multi-turn job with its environment pool (examples/tiny-agent-k8s.yaml, spec.environments). The
operator creates the two environment pods with the job (and their Service and NetworkPolicy); the rollout's episodes
reach them by their stable names and use them (the servers' request counts); one of them is killed mid-run and
replaced under its name without a gang restart, its episodes retried, and the job Succeeds; the pool goes when the
job finishes, and its Service and NetworkPolicy with the job. The environment is the user's file (the built-in
guess_number's game, from a ConfigMap) whose first step of each session also runs the containment probe: with the
reward scenario's probe and the `python` tool's here, a reward function, a tool and an environment step are each
shown to run in a sandbox pod (issue 51)."""
from __future__ import annotations

import base64
import json
import time
import urllib.request

import yaml
from hybridflow_operator import manifests as mf
from hybridflow_operator.policy import FOR_JOBS_LABEL
from kube.harness import wait_for
from kubernetes import client

from e2e import containment
from e2e.helpers import PVC, ROOT, live_pod_names, phase
from e2e.worlds import _pod_ip

EXAMPLE = ROOT / "examples" / "tiny-agent-k8s.yaml"
NAME = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
STEPS = 3  # the example's own 4, less one, and no held-out evaluation: what is asserted needs a running job only
POOL = [f"{NAME}-env-0", f"{NAME}-env-1"]


CODE_CM, ENV_KEY = f"{NAME}-user-env", "probed_guess.py"
# The user's environment file (appended to e2e/containment.py's probe, as the reward scenario appends its function):
# the built-in guess_number's game, whose first step of each session also runs the probe and puts what it saw in
# the step's info. A rollout's step whose probe saw anything (a credential, a connection to the head, no head to
# try) fails its episode, naming it: the job's agent_episodes_failed, which the scenario asserts is 0.
ENVIRONMENT = """

from hybridflow.agents.envs.guess_number import GuessNumber


class ProbedGuess(GuessNumber):
    def reset(self, sample):
        self.probed = False
        return super().reset(sample)

    def step(self, action):
        seen = {}
        if not self.probed:
            self.probed = True
            seen = _containment(%(head)r)
            if seen != %(contained)r:
                raise RuntimeError("the containment probe in an environment step saw %%r" %% (seen,))
        observation, reward, done, info = super().step(action)
        return observation, reward, done, {**info, **seen}
"""
CONTAINED = {"credentials_seen": 0.0, "head_target": 1.0, "head_connected": 0.0}  # what a sandbox pod's code sees


def _requests(world, pod: str) -> float:
    """Authenticated requests the replica served (its /metrics, from its pod address on the bridge)."""
    ip = _pod_ip(world.kube, pod, "default")
    try:
        text = urllib.request.urlopen(f"http://{ip}:{mf.ENVIRONMENT_PORT}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hybridflow_environment_requests_total{"))


def _tool_probe(world, pod: str, head: str) -> dict:
    """The containment probe (e2e/containment.py) as the `python` tool's code, on replica `pod`, over the pool's
    HTTP API with the job's sandbox token (read from its Secret, as the operator hands it to the job's pods)."""
    code = containment.SOURCE + f"\nimport json\nprint(json.dumps(_containment({head!r})))\n"
    answer = _pool_call(world, pod, "POST", "/v1/tools/call", {"name": "python", "arguments": {"code": code}})
    assert not answer.get("error"), answer
    return json.loads(answer["text"].strip().splitlines()[-1])


def _sandbox_token(world) -> str:
    secret = world.kube.core.read_namespaced_secret(f"{NAME}-sandbox-token", "default")
    return base64.b64decode(secret.data["token"]).decode()


def _pool_call(world, pod: str, method: str, path: str, body: dict | None) -> dict:
    """One call of the pool's HTTP API on replica `pod`, as the rollout makes it (with the job's sandbox token)."""
    request = urllib.request.Request(
        f"http://{_pod_ip(world.kube, pod, 'default')}:{mf.ENVIRONMENT_PORT}{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {_sandbox_token(world)}", "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def _environment_probe(world, pod: str) -> dict:
    """The user's environment (ENVIRONMENT) on replica `pod`: a session opened and stepped over the pool's HTTP API,
    as the rollout's are; its first step's info holds what the probe saw (or its error, what it saw that it must
    not)."""
    opened = _pool_call(world, pod, "POST", "/v1/sessions", {"sample": {
        "prompt": "What is 3 + 4? Answer with the number only.", "ground_truth": 7, "data_source": "containment-probe",
        "extra_info": {}}})
    assert not opened["observation"].get("error"), opened
    step = _pool_call(world, pod, "POST", f"/v1/sessions/{opened['session']}/step", {"action": "7"})
    assert not step.get("error") and step["done"], step  # "Correct!": the session ends with its step
    return {k: step["info"].get(k) for k in CONTAINED}


def _uid(world, pod: str) -> str | None:
    found = [p for p in world.kube.pods(NAME) if p.metadata.name == pod and not p.metadata.deletion_timestamp]
    return found[0].metadata.uid if found else None


def test_environment_pool_serves_the_rollout_and_survives_a_killed_replica(world, tmp_path):
    kube = world.kube
    claim = yaml.safe_load(PVC.read_text())
    claim["metadata"]["name"] = f"{NAME}-checkpoints"
    manifest = tmp_path / "job.yaml"
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["trainer"].update(steps=STEPS, eval=False, promptsPerStep=2)  # 4 episodes a step: 2 per replica
    # pods as a cluster runs them (non-root, seccomp RuntimeDefault: bubblewrap cannot make namespaces): the
    # sandbox pods' own containment holds, which the job records; `python` runs model-written code there
    doc["spec"]["sandbox"] = {"allowPartial": True}
    doc["spec"]["rollout"]["agent"]["tools"] = ["calculator", "python"]
    head = f"{NAME}-head-g0"
    # the user's environment (the built-in's game, probed), from the job's code ConfigMap
    del doc["spec"]["rollout"]["agent"]["environment"]
    doc["spec"]["rollout"]["agent"].update(environmentFile=ENV_KEY, environmentClass="ProbedGuess")
    doc["spec"]["kubernetes"]["rewardConfigMap"] = CODE_CM
    code = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CODE_CM, "labels": {FOR_JOBS_LABEL: "true"}},
            "data": {ENV_KEY: containment.SOURCE + ENVIRONMENT % {"head": head, "contained": CONTAINED}}}
    manifest.write_text(yaml.safe_dump_all([claim, code, doc], sort_keys=False))
    world.bake_models()  # SmolLM2 as the worker image holds it
    world.kubectl("apply", "--validate=false", "-f", str(manifest))

    def logs() -> str:
        return "\n".join(f"{p} log:\n{world.logs(p)[-2500:]}" for p in live_pod_names(kube, NAME))

    expected = sorted([head, f"{NAME}-default-0-g0", *POOL])
    wait_for(lambda: live_pod_names(kube, NAME) == expected, 60,
             lambda: f"gang + pool pods; {live_pod_names(kube, NAME)}")
    networking = client.NetworkingV1Api(kube.core.api_client)
    policy = networking.read_namespaced_network_policy(f"{NAME}-env", "default").spec
    assert policy.egress in (None, []) and policy.policy_types == ["Ingress", "Egress"]  # no egress at all
    assert kube.core.read_namespaced_service(f"{NAME}-env", "default").spec.cluster_ip == "None"
    head_env = {e.name: e.value for e in kube.core.read_namespaced_pod(head, "default").spec.containers[0].env}
    assert head_env[mf.ENVIRONMENT_URLS_ENV] == ",".join(
        f"http://env-{i}.{NAME}-env.default.svc:{mf.ENVIRONMENT_PORT}" for i in range(2))
    wait_for(lambda: phase(world, NAME) == "Running", 300, lambda: f"Running; {logs()}")

    # used: the rollout's episodes open sessions and step them on both replicas
    if world.local:
        wait_for(lambda: all(_requests(world, p) > 0 for p in POOL), 300,
                 lambda: f"requests on both replicas ({[_requests(world, p) for p in POOL]}); {logs()}")
    wait_for(lambda: (kube.status(NAME).get("environments") or {}).get("ready") == 2, 60, "pool Ready in status")

    # Issue 51: model-written code (the `python` tool, called here as the rollout calls it, with the job's sandbox
    # token) runs in a sandbox pod: it sees no credential, cannot reach the head, and leaves no daemon behind
    partial = wait_for(lambda: next((c for c in kube.status(NAME).get("conditions", [])
                                     if c["type"] == "SandboxPartial" and c["status"] == "True"), None), 120,
                       lambda: f"the SandboxPartial condition; {kube.status(NAME).get('conditions')}")
    assert "network" in partial["message"], partial
    probe = _tool_probe(world, POOL[1], head)
    assert probe == CONTAINED, probe
    # and the user's environment: its step (in a session of its own, as the rollout's) runs in a sandbox pod too
    probe = _environment_probe(world, POOL[1])
    assert probe == CONTAINED, probe
    if world.local:
        time.sleep(3.5)
        assert not containment.daemons_outliving(seconds=3.0), "the tool's or the step's daemon outlived its call"

    # a replica killed mid-run: replaced under its name, no gang restart, its episodes retried elsewhere
    victim, before = POOL[0], _uid(world, POOL[0])
    assert kube.status(NAME).get("step", 0) < STEPS, "the job finished before the kill"
    world.kill_pod_processes(victim)
    wait_for(lambda: (u := _uid(world, victim)) and u != before and world.pod_running(victim), 120,
             lambda: f"{victim} replaced; {logs()}")

    outliving: set[int] = set()

    def ended() -> bool:  # meanwhile: no daemon a rollout's environment step started outlives its step
        if world.local:
            outliving.update(containment.daemons_outliving(seconds=3.0))
        return phase(world, NAME) in ("Succeeded", "Failed")

    wait_for(ended, 900, lambda: f"the end; {logs()}")
    st = kube.status(NAME)
    assert st["phase"] == "Succeeded", f"{st}; {world.logs(head)[-3000:]}"
    assert st["restarts"] == 0, "a dead environment pod restarted the gang"
    assert world.step_log(NAME) == list(range(1, STEPS + 1))
    records = world.step_records(NAME)
    # retried, not lost; and no rollout's environment step saw what its sandbox must keep out (its episode fails)
    assert all(r.get("agent_episodes_failed", 0) == 0 for r in records), f"{records}; {world.logs(head)[-3000:]}"
    assert sum(r.get("agent_env_steps_mean", 0) for r in records) > 0, records
    assert not outliving, f"daemons an environment step started outlived it: {sorted(outliving)}"

    # the pool goes with the finished job (its head stays for its logs); its Service and policy with the job
    wait_for(lambda: not [p for p in live_pod_names(kube, NAME) if p in POOL], 120, "the pool's pods gone")
    world.kubectl("delete", "rlhfjob", NAME, "--wait=false")
    wait_for(lambda: kube.job(NAME) is None and not kube.pods(NAME), 120, "the job and its pods gone")
    services = [s.metadata.name for s in kube.core.list_namespaced_service("default").items]
    assert f"{NAME}-env" not in services and f"{NAME}-head" not in services, services
    policies = [p.metadata.name for p in networking.list_namespaced_network_policy("default").items]
    assert not [p for p in policies if p.startswith(f"{NAME}-")], policies
    if world.local:
        wait_for(lambda: not world.leftovers(NAME), 60, "every process of the job gone")
