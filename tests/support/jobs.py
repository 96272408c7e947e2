"""Running jobs as a user does: `hybridflow` CLI in a subprocess, an example job with a few spec fields changed,
and README.md's "Your own data" job saved as the README says."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from support.paths import ROOT


def run_cli(args, cwd, env_extra=None, timeout=900) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def job_variant(tmp_path: Path, src: Path, **spec_changes) -> Path:
    """`src` (an example job) saved in `tmp_path` with spec fields changed: `trainer__steps=2` sets
    spec.trainer.steps (double underscores separate the levels; missing ones are made)."""
    doc = yaml.safe_load(src.read_text())
    for dotted, value in spec_changes.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    out = tmp_path / src.name
    out.write_text(yaml.safe_dump(doc))
    return out


def readme_own_data_job() -> tuple[str, str]:
    """The job YAML and the reward file that README.md's "Your own data" section prints (its one yaml and one
    python block), as text: what a user copies."""
    section = (ROOT / "README.md").read_text().split("### Your own data\n", 1)[1].split("\n### ", 1)[0]
    jobs, rewards = re.findall(r"```yaml\n(.*?)```", section, re.S), re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(jobs) == 1 and len(rewards) == 1, "the section should print one job and one reward file"
    return jobs[0], rewards[0]


def save_readme_own_data_job(root: Path) -> tuple[Path, Path]:
    """README's own-data job saved as the README says (my-job.yaml, and the reward file it names) in `root`, which
    the caller lays out like the repository after `python examples/data/make_word_problems.py`; returns the job
    file and its checkpointDir."""
    job_text, reward_text = readme_own_data_job()
    doc = yaml.safe_load(job_text)
    # what a newcomer writes, and what this job checks stays accepted: one path for train and eval, no reward type
    assert isinstance(doc["spec"]["data"]["train"], str) and isinstance(doc["spec"]["data"]["eval"], str), doc
    assert "type" not in doc["spec"]["models"]["reward"], doc
    (root / "my-job.yaml").write_text(job_text)
    (root / doc["spec"]["models"]["reward"]["function"]["path"]).write_text(reward_text)
    return root / "my-job.yaml", root / doc["spec"]["trainer"]["checkpointDir"]
