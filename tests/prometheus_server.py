"""A real Prometheus (Debian's package) on 127.0.0.1 with its own data directory, for tests that scrape our
exporters and run the dashboards' and alerts' PromQL."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path, "prometheus not found: `apt-get install -y --no-install-recommends prometheus` (make install does)"
    return path


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, str], port: int, interval: str = "1s") -> None:
        self.workdir, self.port = workdir, port
        self.interval = interval
        self.config_path = workdir / "prometheus.yml"
        self._write_config(targets)
        self.proc: subprocess.Popen | None = None

    def _write_config(self, targets: dict[str, str]) -> None:
        self.targets = dict(targets)
        config = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "scrape_configs": [{"job_name": name, "static_configs": [{"targets": [addr]}]}
                               for name, addr in targets.items()],
        }
        self.config_path.write_text(yaml.safe_dump(config))

    def retarget(self, targets: dict[str, str]) -> None:
        """Scrape other addresses from now on (a restarted pod has a new IP): rewrite the config, reload."""
        if targets != self.targets:
            self._write_config(targets)
            assert self.proc is not None
            self.proc.send_signal(signal.SIGHUP)

    def __enter__(self) -> "Prometheus":
        self.log = open(self.workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200:
                    return self
            except OSError:
                time.sleep(0.5)
        self.__exit__(None, None, None)  # __exit__ does not run when __enter__ raises
        raise RuntimeError("Prometheus did not become ready: " + (self.workdir / "prometheus.log").read_text()[-2000:])

    def __exit__(self, *exc: Any) -> None:
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read())

    def targets_up(self) -> dict[str, bool]:
        body = self.query("up")
        return {r["metric"]["job"]: r["value"][1] == "1" for r in body.get("data", {}).get("result", [])}
