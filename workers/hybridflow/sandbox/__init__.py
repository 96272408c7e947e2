"""User code in an OS sandbox: reward functions, and an agent's tools and environments (hybridflow.agents).

`spawn(argv, limits)` starts `argv` (a program of the user's, or a worker that loads the user's code) in separate
processes that the operating system contains, each layer stopping something of its own:

- network: bwrap --unshare-net, a network namespace with only a loopback of its own. Stops any connection: to the
  job's Ray (GCS, raylets, dashboard), to the pod's 127.0.0.1 services, to the cloud's metadata endpoint, outside.
- processes: bwrap --unshare-pid with a --proc of its own, --die-with-parent, --new-session. Stops seeing or
  signalling the driver or any other process and reading their /proc/<pid>/environ; stops outliving the sandbox:
  every process in it (setsid and double forks included) is killed when its PID namespace's init dies, which it
  does when the sandbox is killed, when its parent dies and when the driver is killed (kill -9 included). And
  TIOCSTI on a terminal.
- filesystem: bwrap --ro-bind / /, a fresh --dev remounted read-only, tmpfs (sized) over /tmp and /dev/shm (mounted
  after the remount: writable), an empty tmpfs over the
  driver's home, /root and the secrets directories. Stops writing anything of the machine's (checkpoints, the code,
  the user's own files, /var/tmp); reading what the driver keeps in /tmp (Ray's session and sockets) or in its home
  (~/.ray, ~/.aws, tokens) and a Kubernetes service-account token. The caller's `private` paths (an agent's job:
  its prompt files and checkpoints) are hidden too, even inside a bound directory. Everything else stays readable,
  read-only: it is what a program needs (Python, its packages).
- user: started as root, a uid of its own (a fresh one per sandbox, no capability left); not root, a user namespace
  (uid 65534 inside, the caller's uid outside). Stops, as root: reading root's files (/root, 0600 keys), signalling
  or tracing the driver, any capability; everywhere: gaining privileges (no_new_privs).
- limits: rlimits set before the program runs, soft = hard so that they cannot be raised: CPU seconds, address
  space, file size, processes (and threads), open files, no core dumps. Stops a busy loop past its CPU budget
  (SIGKILL), a memory blow-up (MemoryError, a failed mmap), a disk filler (EFBIG), a fork bomb (fork fails, EAGAIN).
- environment: a new, clean one (bwrap --clearenv, and the process is started with it too). Stops the job's
  credentials from reaching it: RAY_AUTH_TOKEN, AWS_*, anything in the driver's environment.
- syscalls: a seccomp filter (seccomp.py, built with libseccomp, loaded by bwrap --seccomp), and in a user namespace
  bwrap --disable-userns (bwrap >= 0.8; older: a note, the filter alone holds). Stops namespaces of its own (unshare,
  setns, clone with CLONE_NEW*; clone3 answers ENOSYS), mounts, keyrings, ptrace and process_vm_*, bpf,
  perf_event_open, userfaultfd, io_uring, modules, kexec, open_by_handle_at, personality, TIOCSTI: the kernel
  surface a reward, tool or environment never needs. Python, numpy, threads and subprocesses run under it.
- cgroup (advisory: recorded when missing, never a refusal of a required sandbox): where a cgroup v2 is delegated
  (cgroup.py: HYBRIDFLOW_SANDBOX_CGROUP, or this process's cgroup or its parent), one of its own per sandbox, entered
  before anything of it runs. Stops its processes together from using more memory (memory.max) or processes
  (pids.max) than the sandbox's limits, which the rlimits bound per process only.

The caller adds the wall-clock deadline (the reward pool kills a sandbox past its call's deadline; the PID
namespace takes everything in it along).

`probe()` finds which layers this machine or pod offers, by starting a sandbox of each kind, best first: bwrap as
root (namespaces made without a user namespace, the launcher then drops to a fresh uid), bwrap in a user namespace,
no bwrap; where a fresh /proc cannot be mounted (a container's masked /proc in a user namespace), an empty one.
Where a layer is missing (bwrap not installed; user namespaces refused, as under seccomp RuntimeDefault or
`kernel.unprivileged_userns_clone=0`) the others still hold: rlimits, the clean environment, a new session, a
private temporary directory, a fresh uid when root can hand one the Python; the caller says so once (`warn_once`)
or refuses to run (`check_required`: its argument, or HYBRIDFLOW_SANDBOX=require).

What it does not stop: reading world-readable files of the machine (read-only); using CPU and memory up to its
limits (without a delegated cgroup RLIMIT_AS bounds each process, so a sandbox can hold up to processes x memory: the
pod's cgroup is the outer bound); kernel exploits through the calls the filter allows;
connecting to a Unix socket of the machine that is outside /tmp and the hidden directories and writable by its uid.
Without a user namespace or root, the process-count limit is not set (RLIMIT_NPROC counts every process of the uid,
the driver's threads included).

The modules, by job: limits (the vocabulary: Limits, Layers, the constants), launcher (the command line, pure),
process (starting and killing a sandbox, and probing which kinds this machine runs: the probe starts trial
sandboxes; a kind whose filter, --disable-userns or cgroup fails to start gives that part up, reported), seccomp
(the filter), cgroup (the delegated cgroup and each sandbox's), policy (refusing or warning once where a layer is
missing). This package re-exports what callers use.
"""
from __future__ import annotations

from hybridflow.sandbox.launcher import (clean_env, code_binds, command, default_hidden, default_needed, fresh_uid,
                                         is_under, python_module)
from hybridflow.sandbox.limits import (ADVISORY, FRESH_UIDS, INSIDE_UID, LAYERS, PRIVATE_TMP, REQUIRE_ENV, SECRET_DIRS,
                                       THREADS_ENV, WORKDIR, Layers, Limits, SandboxUnavailable)
from hybridflow.sandbox.policy import LAYER_TEXT, check_required, required, warn_once
from hybridflow.sandbox.process import Sandboxed, candidates, missing_layers, probe, spawn, try_layers

__all__ = ["ADVISORY", "FRESH_UIDS", "INSIDE_UID", "LAYERS", "LAYER_TEXT", "PRIVATE_TMP", "REQUIRE_ENV", "SECRET_DIRS",
           "THREADS_ENV", "WORKDIR", "Layers", "Limits", "SandboxUnavailable", "Sandboxed", "candidates",
           "check_required", "clean_env", "code_binds", "command", "default_hidden", "default_needed", "fresh_uid",
           "is_under", "missing_layers", "python_module", "probe", "required", "spawn", "try_layers", "warn_once"]
