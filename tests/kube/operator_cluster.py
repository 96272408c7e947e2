"""What the operator's kopf tests share (tests/operator/test_operator_kopf_*.py, and the tests that start the
operator too): a cluster of the API server double and a real `kopf run`, example jobs, reading a job's status and
events, and the fixtures: one API server double and one operator per test module (starting them costs more than
most tests), each test in a namespace of its own and checked clean afterwards (`cluster`); a cluster-wide install
acting in labelled namespaces only (`labelled_cluster`), and a cluster of a test's own (`own_cluster`). A module
imports the fixtures it uses: a second conftest.py would take the name `conftest`, which tests import helpers from."""
import contextlib
import copy
import itertools
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes.client.rest import ApiException

from hybridflow_operator.policy import NAMESPACE_LABEL
from kube.apiserver_double import RunningApiServer
from kube.harness import Kube, Operator, wait_for


ROOT = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
SEVERAL = 3  # reconcile ticks that "nothing more happens" waits for
_NAMESPACES = itertools.count()


def job_doc(name: str, **run_policy) -> dict:
    """The tiny example under another name; no namespace: it goes where the test's client creates it."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name}
    doc["spec"]["runPolicy"] = {"backoffLimit": 2, **run_policy}
    return doc


@contextlib.contextmanager
def _started_cluster(tmp_path):
    """The API server double and the operator: (api, kubeconfig, operator), both stopped at the end. The operator
    watches every namespace (the harness names none to watch), as the tests' own namespaces need. Most of a test is
    waiting for the next reconcile tick to act on what the test did, so ticks come every 0.25 s (the harness's
    default is 0.5 s, a cluster's 5 s); "nothing more happens" waits count ticks (`_wait_ticks`), not seconds."""
    kubeconfig = str(tmp_path / "kubeconfig")
    with RunningApiServer(kubeconfig) as api:
        op = Operator(kubeconfig, tmp_path / "operator.log", interval=0.25).start()
        try:
            wait_for(lambda: api.watching("rlhfjobs"), 60, "kopf's watch on rlhfjobs")
            yield api, kubeconfig, op
        finally:
            op.stop()


def _live(op) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{op.liveness_port}/healthz", timeout=5).status == 200
    except OSError:
        return False


def _leave_clean(api, kube, op) -> str:
    """Delete the test's jobs (the operator removes their children and finalizers) and admit creates again; if the
    operator is not well (exited, not live, not releasing jobs), start a new one. Returns what was wrong, if any."""
    api.handler.refusals.clear()
    for name in kube.jobs():
        try:
            kube.delete_job(name)
        except ApiException as err:
            if err.status != 404:
                raise
    problems = []
    if op.proc is None or op.proc.poll() is not None:
        problems.append(f"the operator exited ({op.proc and op.proc.returncode})")
    else:
        try:
            wait_for(lambda: not kube.jobs(), 30, f"the operator to release the jobs of {kube.namespace}")
        except AssertionError as err:
            problems.append(str(err))
        if not _live(op):
            problems.append("the operator's liveness probe failed")
    if problems:
        problems.append("operator log, last lines:\n" + "\n".join(line[:300] for line in op.log().splitlines()[-30:]))
        op.stop(kill=True)
        for name in kube.jobs():  # nobody will remove the finalizers now
            kube.patch_job(name, {"metadata": {"finalizers": []}})
        wait_for(lambda: not kube.jobs(), 30, f"the jobs of {kube.namespace} gone")
        watches = api.watches("rlhfjobs")
        op.start()
        wait_for(lambda: api.watches("rlhfjobs") > watches, 60, "the new operator's watch")
    return "\n".join(problems)


def _wait_ticks(op, kube, *names, n=SEVERAL, since=None) -> None:
    """Until the operator has finished n reconcile ticks of each job (kopf logs each) after the log offset `since`
    (default: now): what "nothing more happens" waits for, however slow the machine. A resting job (suspended,
    finished, waiting for an input with a backoff) still ticks, and kopf logs each: such a tick returns at once,
    which is exactly "nothing more happens"."""
    offset = len(op.log()) if since is None else since
    done = [f"[{kube.namespace}/{m}] Timer 'reconcile' succeeded." for m in names]
    wait_for(lambda: (log := op.log()[offset:]) and all(log.count(d) >= n for d in done), 30,
             f"{n} more reconcile ticks of {', '.join(names)}")


def _phase(kube, name):
    return kube.status(name).get("phase")


def _message(kube, name):
    return kube.status(name).get("message", "")


def _reasons(kube, name):
    return [e.reason for e in kube.events() if e.involved_object.name == name]


def _pod_names(kube, job):
    return sorted(p.metadata.name for p in kube.pods(job))


def _run_all(kube, job):
    for p in kube.pods(job):
        if not p.metadata.deletion_timestamp:
            kube.set_pod_phase(p.metadata.name, "Running")


def _start_running(kube, name, **run_policy):
    """Create a job, let the kubelet double report its pods Running, wait for phase Running."""
    kube.create_job(job_doc(name, **run_policy))
    wait_for(lambda: len(kube.pods(name)) == 2, 30, "pods")
    _run_all(kube, name)
    wait_for(lambda: _phase(kube, name) == "Running", 30, "Running")


VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}
GROUPS = {"rlhfjobs": "hybridflow.io", "networkpolicies": "networking.k8s.io", "podgroups": "scheduling.volcano.sh",
          "customresourcedefinitions": "apiextensions.k8s.io"}

REWARD = {"actor": {"source": "smollm2"}, "reward": {"type": "function", "function": {"path": "my_reward.py"}}}


def client_networking(kube):
    from kubernetes import client

    return client.NetworkingV1Api(kube.api)


OPERATOR_AGENTS = ("kopf", "hybridflow-operator")  # the User-Agents of the operator's requests (kopf's and ours)


def _operator_requests(api, namespace, since=0):
    """The operator's requests in one namespace since the request-log offset `since`, each with its answer."""
    return [r for r in list(api.handler.log)[since:]
            if r.namespace == namespace and r.agent.startswith(OPERATOR_AGENTS)]


CHILD_RESOURCES = {"Service": "v1/services", "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
                   "ConfigMap": "v1/configmaps"}


def _child(api, kube, kind, name):
    """The object of that kind and name in the test's namespace, as the API server holds it; None if there is none."""
    return next((o for o in api.objects(CHILD_RESOURCES[kind], kube.namespace) if o["metadata"]["name"] == name), None)


def _owned_by(obj, job_uid) -> bool:
    """Whether the object exists and its only controller is the job of that uid."""
    return obj is not None and [r["uid"] for r in obj["metadata"].get("ownerReferences") or []
                                if r.get("controller")] == [job_uid]


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    with _started_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture
def cluster(request, shared_cluster):
    """(api, kube, op) on the module's cluster; `kube` works in a namespace of this test's own (named after it).
    Afterwards the test's jobs are deleted and the operator checked; what was wrong fails this test's teardown,
    unless the test itself failed already (one failure, one report), and is repaired for the next test."""
    api, kubeconfig, op = shared_cluster
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_").lower()).strip("-")
    kube = Kube(kubeconfig, namespace=f"{slug[:50].rstrip('-')}-{next(_NAMESPACES)}")
    failed = request.session.testsfailed
    try:
        yield api, kube, op
    finally:
        problem = _leave_clean(api, kube, op)
        if problem and request.session.testsfailed == failed:  # a failed test already says what went wrong
            pytest.fail(f"after the test: {problem}", pytrace=False)


@pytest.fixture(scope="module")
def labelled_cluster(tmp_path_factory):
    """(api, kubeconfig, op) for a cluster-wide install as the chart's clusterWide mode configures it
    (HYBRIDFLOW_NAMESPACE_LABEL set). A cluster of its own: the shared operator acts in every namespace, so a job
    that must be left alone cannot be on its cluster."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HYBRIDFLOW_NAMESPACE_LABEL", NAMESPACE_LABEL)
        with _started_cluster(tmp_path_factory.mktemp("labelled")) as started:
            env.undo()  # the operator has its environment; nothing else started later should
            yield started


@pytest.fixture
def own_cluster(tmp_path):
    """(api, kube, op) on a cluster of this test's own, in namespace default."""
    with _started_cluster(tmp_path) as (api, kubeconfig, op):
        yield api, Kube(kubeconfig), op
