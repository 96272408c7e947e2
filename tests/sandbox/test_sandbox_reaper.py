"""Where a sandbox has no PID namespace (a default cluster's pods: no bubblewrap), a daemon its program starts out
of its session (double fork, setsid) would outlive it. The sandbox pool's server is the subreaper of everything it
starts and kills such leftovers (hybridflow.sandbox.reaper). Each case runs in a process of its own: a subreaper
adopts every orphan below it, which pytest's own process must not."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import os, subprocess, sys, time
    from hybridflow import sandbox
    from hybridflow.sandbox import reaper

    if sys.argv[1] == "reaper":
        assert reaper.start(period=0.2)
    # what a partial sandbox is on a default cluster: no bwrap, the launcher and its rlimits only
    layers = sandbox.Layers(None, how="no bwrap")
    mark = sys.argv[2]  # the daemon writes its pid there (no filesystem layer here: it can)
    daemon = ("import os, sys, time\\n"
              "if os.fork() == 0:\\n"
              "    os.setsid()\\n"
              "    if os.fork() == 0:\\n"
              f"        open({mark!r}, 'w').write(str(os.getpid()))\\n"
              "        time.sleep(60)\\n"
              "    os._exit(0)\\n"
              "os.wait()\\n"
              "time.sleep(60)\\n")  # the program itself hangs past its deadline
    box = sandbox.spawn([sys.executable, "-c", daemon], sandbox.Limits(), layers, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not os.path.exists(mark) or not open(mark).read():
        assert time.monotonic() < deadline, "the daemon never started"
        time.sleep(0.05)
    daemons = [int(open(mark).read())]
    time.sleep(1.0)
    assert box.popen.poll() is None, "the sandbox ended by itself"
    box.kill()  # its deadline
    time.sleep(1.0)
    def alive(p):
        try:
            return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    alive = [p for p in daemons if alive(p)]
    for p in alive:
        os.kill(p, 9)
    print(len(daemons), len(alive))
''')


def _run(mode: str, tmp_path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(tmp_path / "daemon.pid")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    started, alive = map(int, out.stdout.split()[-2:])
    return started, alive


def test_a_daemon_that_left_its_sandboxs_session_dies_with_the_sandbox(tmp_path):
    assert _run("reaper", tmp_path) == (1, 0)


def test_without_the_reaper_the_daemon_outlives_its_sandbox(tmp_path):
    """What the reaper is for: the same program, and nothing kills the daemon."""
    assert _run("plain", tmp_path) == (1, 1)
