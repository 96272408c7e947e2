"""`hybridflow-operator`: kopf with our handlers, cluster-wide or for the namespaces given, and a liveness probe."""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from kopf.cli import main as kopf_main

    args = list(sys.argv[1:] if argv is None else argv)
    namespaces = [ns for ns in os.environ.get("HYBRIDFLOW_WATCH_NAMESPACES", "").split(",") if ns]
    scope = [f"--namespace={ns}" for ns in namespaces] or ["--all-namespaces"]
    liveness = os.environ.get("HYBRIDFLOW_LIVENESS", "http://0.0.0.0:8081/healthz")
    cmd = ["run", "--standalone", *scope, f"--liveness={liveness}", "-m", "hybridflow_operator.handlers", *args]
    try:
        kopf_main(cmd, standalone_mode=False)
    except SystemExit as exc:  # click's exit
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
