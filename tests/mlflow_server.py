"""A real MLflow tracking server (`mlflow server`, full mlflow from its own venv: `make install-tools`) on 127.0.0.1,
its runs in a SQLite file of its own, for the tests of spec.tracking.mlflow. Started ~10-15 s before it answers."""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from support.paths import ROOT
from support.processes import running
from kube.harness import free_port

# Set by the Makefile; the default is where `make install-tools` puts it.
MLFLOW = Path(os.environ.get("HYBRIDFLOW_TEST_MLFLOW", ROOT / ".tools" / "mlflow" / "bin" / "mlflow"))


@contextlib.contextmanager
def mlflow_server(workdir: Path, timeout_s: float = 120) -> Iterator[str]:
    """The server's tracking URI while the block runs; the server (its whole process group) ends with it."""
    assert MLFLOW.is_file(), f"no MLflow server at {MLFLOW}: run `make install-tools`"
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
           "--default-artifact-root", str(workdir / "artifacts")]
    with open(workdir / "mlflow-server.log", "w") as out, running(cmd, stdout=out, stderr=subprocess.STDOUT) as proc:
        uri = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout_s
        while True:
            assert proc.poll() is None, (workdir / "mlflow-server.log").read_text()[-3000:]
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, f"mlflow server not up in {timeout_s:.0f} s"
            time.sleep(0.3)
        yield uri
