"""Issue 39, item 3: the isolated helper is a sandbox. An expert that calls kill, ptrace,
open, socket or fork -- from ffn_forward or from a constructor -- dies alone with a
reason (SIGSYS, the seccomp filter), and the engine goes on. Before: an isolated expert
calling kill(getppid(), SIGKILL) killed the engine.

Every case runs its helper from a throwaway parent process (a kill that got through
kills that parent, not pytest) under RLIMIT_NPROC (a fork that got through cannot
multiply); sockets on 127.0.0.1 only. Each escape is also run unsandboxed once, to show
that it does what it says (the tests can fail).
"""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from colibri_core.experts.hotplug import sandbox

from hotplug_helpers import reference_so

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sandbox.supported(), reason="the filter is x86-64 Linux")

ESCAPES = {
    "kill": "kill(getppid(), SIGKILL);",
    "ptrace": "ptrace(PTRACE_ATTACH, getppid(), 0, 0);",
    "open": 'int fd = open(getenv("ESCAPE_FILE"), O_WRONLY | O_CREAT, 0600); '
            'if (fd >= 0) { write(fd, "x", 1); close(fd); }',
    "socket": "int s = socket(AF_INET, SOCK_STREAM, 0); struct sockaddr_in a = {0}; "
              "a.sin_family = AF_INET; a.sin_port = htons(atoi(getenv(\"ESCAPE_PORT\"))); "
              "a.sin_addr.s_addr = htonl(INADDR_LOOPBACK); "
              "connect(s, (struct sockaddr *)&a, sizeof a); write(s, \"x\", 1);",
    "fork": 'pid_t p = fork(); if (p == 0) { int fd = open(getenv("ESCAPE_FILE"), '
            'O_WRONLY | O_CREAT, 0600); write(fd, "x", 1); _exit(0); } '
            'if (p > 0) waitpid(p, 0, 0);',
}

SOURCE = r"""
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static void escape(void) { if (getenv("ESCAPE_NOW")) { BODY } }
CTOR
int ffn_forward(const float *x, float *y, int n_tokens, int hidden)
{
    if (n_tokens == 3) escape();
    for (long i = 0; i < (long)n_tokens * hidden; i++) y[i] = x[i];
    return 0;
}
"""

# The helper's parent: starts the runner, calls it with 3 tokens, prints what happened.
DRIVER = textwrap.dedent("""
    import sys, numpy as np
    from colibri_core.experts.hotplug.errors import ExpertCrashed
    from colibri_core.experts.hotplug.isolated import IsolatedRunner
    try:
        r = IsolatedRunner(sys.argv[1], 8, call_timeout_s=10)
        r.forward(np.ones((3, 8), np.float32), np.zeros((3, 8), np.float32))
        print("RESULT survived")
    except ExpertCrashed as e:
        print("RESULT crashed:", e)
    print("RESULT parent alive")
""")

# Unsandboxed control: the same library, loaded and called in a plain process.
CONTROL = textwrap.dedent("""
    import ctypes, os, sys
    if os.fork() == 0:                       # the escape's getppid() is this process
        lib = ctypes.CDLL(sys.argv[1])
        x = (ctypes.c_float * 24)(); y = (ctypes.c_float * 24)()
        lib.ffn_forward(x, y, 3, 8)
        os._exit(0)
    os.wait()
""")


def _limits():
    resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))   # a broken filter: no fork bomb
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _build(tmp: Path, kind: str, where: str) -> Path:
    ctor = "__attribute__((constructor)) static void ctor(void) { escape(); }" \
        if where == "constructor" else ""
    src = SOURCE.replace("BODY", ESCAPES[kind]).replace("CTOR", ctor)
    return reference_so(tmp / f"{kind}_{where}.so", source=src)


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    s.settimeout(0.5)
    yield s
    s.close()


def _env(tmp: Path, listener) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), ESCAPE_NOW="1",
                ESCAPE_FILE=str(tmp / "escaped"), ESCAPE_PORT=str(listener.getsockname()[1]))


def _escaped(tmp: Path, kind: str, listener) -> bool:
    if kind in ("open", "fork"):
        return (tmp / "escaped").exists()
    if kind == "socket":                       # every pending connection (control: two)
        n = 0
        while True:
            try:
                listener.accept()[0].close()
                n += 1
            except OSError:
                return n > 0
    return False


@pytest.mark.parametrize("where", ["ffn_forward", "constructor"])
@pytest.mark.parametrize("kind", sorted(ESCAPES))
def test_escape_kills_only_the_helper(tmp_path, listener, kind, where):
    so = _build(tmp_path, kind, where)
    env = _env(tmp_path, listener)
    if kind in ("open", "fork", "socket"):                 # the escape works unsandboxed
        subprocess.run([sys.executable, "-c", CONTROL, str(so)], env=env, timeout=60,
                       preexec_fn=_limits, capture_output=True)
        assert _escaped(tmp_path, kind, listener), f"{kind}: the control did not escape"
        (tmp_path / "escaped").unlink(missing_ok=True)
    r = subprocess.run([sys.executable, "-c", DRIVER, str(so)], env=env, timeout=60,
                       preexec_fn=_limits, capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])      # the parent lives
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines[-1] == "RESULT parent alive", r.stdout
    assert lines[0].startswith("RESULT crashed") and "SIGSYS" in lines[0] \
        and "sandbox" in lines[0], r.stdout
    if where == "constructor":
        assert "failed to start" in lines[0]
    assert not _escaped(tmp_path, kind, listener)


def test_helper_keeps_only_its_pipes(tmp_path):
    """The helper's descriptors: its two pipes, stderr and stdout (stderr's copy)."""
    src = SOURCE.replace("BODY", "").replace("CTOR", "").replace(
        "if (n_tokens == 3) escape();",
        "if (n_tokens == 3) { int n = 0; for (int fd = 0; fd < 1024; fd++) "
        "n += fcntl(fd, F_GETFD) != -1; return 100 + n; }")
    so = reference_so(tmp_path / "fds.so", source=src)
    keep = os.open(os.devnull, os.O_RDONLY)        # inheritable: must not reach the expert
    os.set_inheritable(keep, True)
    try:
        from colibri_core.experts.hotplug.isolated import IsolatedRunner
        import numpy as np
        r = IsolatedRunner(str(so), 8)
        try:
            rc = r.forward(np.ones((3, 8), np.float32), np.zeros((3, 8), np.float32))
        finally:
            r.close()
    finally:
        os.close(keep)
    assert rc == 100 + 4


def test_engine_goes_on_when_an_isolated_expert_calls_kill(tiny_model_dir, tmp_path):
    """End to end: adopted isolated expert, kill(getppid(), SIGKILL) on its first 3-token
    call: removed as crashed, with the reason; the engine serves the next request."""
    script = textwrap.dedent("""
        import os, sys, time
        from pathlib import Path
        sys.path.insert(0, sys.argv[3])
        from hotplug_helpers import write_bundle
        from colibri_core.config import EngineConfig, HotplugConfig
        from colibri_core.engine import Engine
        model, tmp, src = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[4]
        (tmp / "experts").mkdir()
        eng = Engine(model, EngineConfig(experts_dir=str(tmp / "experts"), hotplug=
                     HotplugConfig(settle_s=0.02, isolation="isolated")))
        write_bundle(tmp / "scratch" / "killer.expert", name="killer", router_bias=50.0, hidden=128,
                     source=src)
        os.rename(tmp / "scratch" / "killer.expert", tmp / "experts" / "killer.expert")
        t0 = time.time()
        while not eng.model.expert_set.hot_experts() and time.time() - t0 < 30:
            eng.hotplug.wait_idle(10); eng.apply_expert_changes(); time.sleep(0.05)
        assert eng.model.expert_set.hot_experts(), "not adopted"
        os.environ["ESCAPE_NOW"] = "1"      # the helper started already: read per call
        try:
            list(eng.generate([1, 2, 3], max_new_tokens=2, temperature=0))
        except Exception as e:
            print("REQUEST", type(e).__name__)
        eng.apply_expert_changes()
        ev = [e for e in eng.expert_events.recent() if e["reason"] == "crashed"]
        print("REMOVED", ev[-1]["message"] if ev else None)
        print("TOKENS", len(list(eng.generate([1, 2, 3], max_new_tokens=4, temperature=0))))
        eng.close()
    """)
    src = SOURCE.replace("BODY", ESCAPES["kill"]).replace("CTOR", "").replace(
        'if (getenv("ESCAPE_NOW"))', "if (1)")
    r = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir), str(tmp_path),
                        str(REPO / "tests"), src], capture_output=True, text=True,
                       timeout=120, preexec_fn=_limits, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "SIGSYS" in r.stdout and "TOKENS 4" in r.stdout, (r.stdout, r.stderr[-2000:])


def test_abort_still_dies_of_sigabrt(tmp_path):
    """Signals to itself stay allowed: an expert that abort()s dies of SIGABRT, and the
    reason says so (not the sandbox)."""
    src = SOURCE.replace("BODY", "abort();").replace("CTOR", "")
    so = reference_so(tmp_path / "abort.so", source=src)
    r = subprocess.run([sys.executable, "-c", DRIVER, str(so)], env=dict(
        os.environ, PYTHONPATH=str(REPO), ESCAPE_NOW="1"), timeout=60, preexec_fn=_limits,
        capture_output=True, text=True)
    assert "RESULT crashed" in r.stdout and "SIGABRT" in r.stdout, r.stdout
