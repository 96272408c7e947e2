"""What the operator's pure tests share: example jobs as dicts, pod views, the time they decide at."""
import datetime as dt

import yaml

from hybridflow.api import parse_job
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import PodView
from support.paths import ROOT


K8S_VERSIONS = [f"1.{m}" for m in range(29, 38)]
NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)


def _raw(example: str, **spec_changes) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc["metadata"] = {"name": doc["metadata"]["name"], "namespace": "ml", "uid": "1234-abcd"}
    for k, v in spec_changes.items():
        doc["spec"][k] = v
    return doc


def _all_manifests(raw: dict) -> list[dict]:
    job = parse_job(raw)
    uid = raw["metadata"]["uid"]
    return mf.static_children(job, uid, TOKEN, ["monitoring", "hybridflow-system"]) + mf.gang_pods(job, uid, 0)


TOKEN = "ab" * 32


def pods(gen=0, head="Running", worker="Running", deleting=False):
    return [PodView(f"h-g{gen}", "head", gen, head, deleting), PodView(f"w-g{gen}", "worker", gen, worker, deleting)]


def _files_job(**k8s):
    raw = _raw("word-problems.yaml", kubernetes={"image": "hybridflow/worker-cpu:0.1.0", **k8s})
    raw["spec"]["data"]["train"] = ["word_problems/train.jsonl", "more/*.jsonl"]
    raw["spec"]["models"]["reward"]["function"]["path"] = "word_problem_reward.py"
    return raw


def _pods(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] == "Pod"]


CK, RM = mf.CHECKPOINT_MOUNT, mf.RESUME_MOUNT


def _with_trainer(example: str = "tiny-grpo.yaml", kubernetes: dict | None = None, **trainer) -> dict:
    return _raw(example, trainer={**_raw(example)["spec"]["trainer"], **trainer},
                kubernetes={**_raw(example)["spec"].get("kubernetes", {}), **(kubernetes or {})})


class _Cluster:
    """What `Kube.read` would find, by (kind, name): the API double the handlers' helpers are handed."""

    def __init__(self, **objects):
        self.objects = {tuple(k.split(":")): v for k, v in objects.items()}

    def read(self, kind, namespace, name):
        return self.objects.get((kind, name))


ASYNC = parse_job(_raw("tiny-async-k8s.yaml"))


def _events(plan, reason: str) -> list[str]:
    return [m for _, r, m in plan.events if r == reason]


def plan_record(micro_batch: int | None = None, **summary) -> dict:
    """A record as a plan pod prints it (`hybridflow plan --auto`, hybridflow.api.plan): the async example with
    pools of the planner's own, not the user's; `micro_batch`: the training micro batch it chose (default: the
    example's), `summary`: more of what its summary says (a predicted step time, the candidates it weighed)."""
    from hybridflow.api.plan import plan_fields

    raw = _raw("tiny-async-k8s.yaml")
    raw["spec"]["resourcePools"] = [{"name": "learner", "nodes": 1, "devicesPerNode": 1},
                                    {"name": "gen", "nodes": 1, "devicesPerNode": 1}]
    raw["spec"]["placement"] = {"actor": "learner", "reference": "learner", "rollout": "gen"}
    if micro_batch is not None:
        raw["spec"]["training"]["microBatchSize"] = micro_batch
    job = parse_job(raw)
    said = {"placement": "hybrid (actor+reference:1, rollout:1)", "pools": {"learner": 1, "gen": 1}, "mode": "async",
            "layout": f"fsdp t_g=1 mb={job.spec.training.micro_batch_size}", "devices": 2, "accelerator": "cpu"}
    return {"summary": {**said, **summary}, "fields": plan_fields(job)}
