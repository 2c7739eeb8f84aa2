"""A warm interpreter: fresh import state for fsdp2-compat and the frameworks, without a fresh start-up.

Many tests run a few lines in a new process to see what happens at import
(a requested patch, an environment switch, what ``status`` prints).  A fresh
interpreter spends most of its ~5 s importing torch and transformers, and a
pinned set runs dozens of them on 2 cores.  ``WarmPython`` starts one server
per test process that imports ``PRELOAD`` once and forks a child per request:
the child gets the request's environment, its own stdout/stderr files,
``sys.argv == ["-c"]`` and a fresh ``__main__``, and runs the code there.

The contract, and where it differs from ``subprocess.run([python, "-c", code])``:
- torch and transformers (only the packages in ``PRELOAD``, never a model
  module, a framework or fsdp2_compat) are already imported, with the
  server's environment: a test about what gets imported, about start-up
  (``.pth`` files), or about an environment variable torch or transformers
  read at import must use a fresh interpreter (``conftest.run_python``);
- everything else is imported by the child, in the order its code says, so
  the patches still meet their targets on first import;
- a child that runs past ``timeout`` is killed with its process group and
  ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` would.
"""

import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "transformers", "transformers.modeling_utils")

SERVER = r'''
import atexit, importlib, json, os, signal, sys, time, traceback, types

for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
base_path = list(sys.path)
import gc
gc.freeze()  # the preloaded modules outlive every child: its collections walk only what the child made


def child(req):
    os.setpgid(0, 0)  # the server kills the whole group on a timeout
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin is the server's request pipe
    os.dup2(os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC), 1)
    os.dup2(os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC), 2)
    os.environ.clear()
    os.environ.update(req["env"])
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in base_path]
    sys.path[:] = base_path[:1] + extra + base_path[1:]
    sys.argv = ["-c"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(req["code"], "<string>", "exec"), main.__dict__)
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return rc


for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = child(req)
        finally:
            os._exit(code & 0xFF)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = None
            break
        time.sleep(0.02)
    try:
        os.killpg(pid, signal.SIGKILL)  # anything the child left running
    except (ProcessLookupError, PermissionError):
        pass
    sys.stdout.write(json.dumps({"rc": rc}) + "\n")
    sys.stdout.flush()
'''


class WarmPython:
    """One warm server (started on first use); ``run(code, env, timeout)`` -> ``CompletedProcess``."""

    def __init__(self, env):
        self._env = dict(env)
        self._proc = None
        self._dir = tempfile.mkdtemp(prefix="fsdp2_compat_warm_")

    def _server(self):
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, *PRELOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=self._env, text=True, start_new_session=True,
            )
        return self._proc

    def run(self, code, env, timeout=300):
        code = textwrap.dedent(code)
        out, err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        for path in (out, err):
            open(path, "w").close()
        proc = self._server()
        proc.stdin.write(json.dumps({"code": code, "env": env, "stdout": out, "stderr": err,
                                     "timeout": timeout}) + "\n")
        proc.stdin.flush()
        # the server answers after the child ends or is killed at ``timeout``; the margin covers the
        # first request's preload (~5-40 s, a cold page cache included)
        ready, _, _ = select.select([proc.stdout], [], [], timeout + 120)
        line = proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError("the warm interpreter (tests/support/warm.py) stopped answering")
        rc = json.loads(line)["rc"]
        stdout, stderr = open(out).read(), open(err).read()
        args = [sys.executable, "-c", code]
        if rc is None:
            raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(args, rc, stdout, stderr)

    def stop(self):
        """End the server (the next ``run`` starts another)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self):
        import shutil

        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
