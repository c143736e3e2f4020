"""A real SGLang ``Engine`` on CPU, in a subprocess of its own, driven over a pipe.

SGLang 0.5.23's Engine runs a Llama-family model on this kind of CPU (no GPU) with the ``torch_native``
attention backend when ``SGLANG_USE_CPU_ENGINE=1`` is set and ``sgl_kernel`` imports (here: windowkit's
stand-in, ``cpu_kernel_shim/``, on the engine processes' path only; see docs/backends.md). The Engine is
hosted in a child process (``python -m windowkit.backends.sglang.cpu_engine``) because

* ``Engine.shutdown()`` SIGKILLs every child of the calling process (a test runner's other children too),
  and two Engines in one process kill each other's schedulers;
* the caller keeps ``SGLANG_USE_CPU_ENGINE`` unset (windowkit's pool tests import SGLang's pools without it);
* the scheduler and detokenizer are *spawned*, so they re-import the host's ``__main__``, which is this
  small module and not a test file.

The host reads one JSON request per line on stdin and answers one JSON line on a private pipe (SGLang's
own logging goes to the log file). ``CPUEngine`` is the client; ``generate`` takes ``Engine.generate``'s
keyword arguments and returns its output dict, so ``SGLangBackend(CPUEngine(...), hf, page_size=16)``
serves windows through the real runtime.

    eng = CPUEngine.start(str(smollm2.checkpoint_dir()), linker=linker_config(hf.fingerprint(), stats))
    out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8, "temperature": 0.0})
    eng.close()                                  # shuts the Engine down and kills the host's process group

If the Engine cannot start, ``start`` raises ``EngineStartError`` carrying SGLang's own reason (the
exception and the tail of its log).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from windowkit.errors import WindowkitError

SHIM_DIR = Path(__file__).resolve().parent / "cpu_kernel_shim"  # holds the sgl_kernel stand-in package

# The arguments that run SGLang 0.5.23 on a CPU without AMX (checked: greedy ids equal transformers').
CPU_ENGINE_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    "dtype": "float32",
    "max_total_tokens": 16384,  # without it the KV pool is sized from free memory (a ~55 s start)
    "context_length": 4096,
    "random_seed": 0,
    "sleep_on_idle": True,  # an idle scheduler otherwise busy-polls one core
}


class EngineStartError(WindowkitError):
    """The SGLang Engine did not start; the message carries SGLang's reason and the tail of its log."""


class EngineRequestError(WindowkitError):
    """The running Engine failed a request (its traceback is in the message)."""


def cpu_env(base: Optional[dict] = None, plugins: str = "windowkit") -> dict:
    """The environment of the engine processes: SGLang's CPU engine, the sgl_kernel stand-in on the path,
    and SGLang's plugin loader restricted to ``plugins`` (the ``sglang.srt.plugins`` entry points)."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if plugins:
        env["SGLANG_PLUGINS"] = plugins
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def engine_args(model_path: str, linker: Optional[dict] = None, **overrides: Any) -> dict:
    """``sglang.Engine`` keyword arguments for this CPU (``linker``: a ``linker_config()`` object, which
    turns on the dynamic external linker, i.e. ``WindowkitLinker``)."""
    kw = dict(CPU_ENGINE_ARGS, model_path=str(model_path))
    if linker is not None:
        kw.update(enable_unified_cache_external_linker=True, unified_cache_external_linker_backend="dynamic",
                  unified_cache_external_linker_config=linker)
    kw.update(overrides)
    return kw


def _tail(path: Path, n: int = 6000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


class CPUEngine:
    """Client of an SGLang Engine hosted in a child process (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, reply_fd: int, log_path: Path, info: dict):
        self.proc = proc
        self._reply = os.fdopen(reply_fd, "r", encoding="utf-8")
        self.log_path = log_path
        self.info = info  # what the host reported once ready: pid, start seconds, sgl_kernel file, plugins

    @classmethod
    def start(cls, model_path: str, *, linker: Optional[dict] = None, log_path: Optional[str] = None,
              timeout: float = 240.0, env: Optional[dict] = None, **overrides: Any) -> "CPUEngine":
        """Start the host and its Engine; returns once the Engine is ready, else raises EngineStartError."""
        kw = engine_args(model_path, linker, **overrides)
        log = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="windowkit-sglang-", suffix=".log")[1])
        r, w = os.pipe()
        with open(log, "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "windowkit.backends.sglang.cpu_engine", str(w), json.dumps(kw)],
                                    stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT, env=env or cpu_env(),
                                    pass_fds=(w,), start_new_session=True, text=True)
        os.close(w)
        eng = cls(proc, r, log, {})
        try:
            msg = eng._read(timeout)
        except EngineStartError as e:
            eng.kill()
            raise EngineStartError(f"{e}\n--- SGLang log ({log}) ---\n{_tail(log)}") from None
        if not msg.get("ok"):
            eng.kill()
            raise EngineStartError(f"SGLang's Engine did not start: {msg.get('error')}\n--- SGLang log ({log}) ---\n"
                                   f"{_tail(log)}")
        eng.info = msg
        return eng

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartError(f"no answer from the SGLang engine host within {timeout:.0f} s")
            ready, _, _ = select.select([self._reply], [], [], min(left, 1.0))
            if ready:
                line = self._reply.readline()
                if line:
                    return json.loads(line)
                code = self.proc.wait(timeout=30)
                raise EngineStartError(f"the SGLang engine host exited (status {code}) without an answer")
            if self.proc.poll() is not None:
                raise EngineStartError(f"the SGLang engine host exited (status {self.proc.returncode})")

    def _call(self, op: str, timeout: float = 600.0, **kw: Any) -> Any:
        if self.proc.poll() is not None:
            raise EngineRequestError(f"the SGLang engine host is not running (status {self.proc.returncode})\n"
                                     f"{_tail(self.log_path)}")
        self.proc.stdin.write(json.dumps({"op": op, "kw": kw}) + "\n")
        self.proc.stdin.flush()
        try:
            msg = self._read(timeout)
        except EngineStartError as e:
            raise EngineRequestError(f"{op}: {e}\n{_tail(self.log_path)}") from None
        if not msg.get("ok"):
            raise EngineRequestError(f"{op} failed in the SGLang engine: {msg.get('error')}")
        return msg.get("result")

    def generate(self, **kwargs: Any) -> Any:
        """``sglang.Engine.generate(**kwargs)`` in the host (JSON-able arguments and result)."""
        return self._call("generate", **kwargs)

    def flush_cache(self) -> Any:
        """``Engine.flush_cache()``: empties SGLang's radix tree."""
        return self._call("flush_cache")

    def close(self, timeout: float = 60.0) -> None:
        """Shut the Engine down and make sure no process of the host's group is left."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "shutdown", "kw": {}}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()

    shutdown = close  # what SGLangBackend.shutdown calls

    def kill(self) -> None:
        """SIGKILL the host's process group (the host, SGLang's scheduler and detokenizer)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for f in (self._reply, self.proc.stdin):
            try:
                f.close()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> "CPUEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- the host (child process)
def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "tolist"):
        return x.tolist()
    return repr(x)


def _host(reply_fd: int, kwargs: dict) -> int:
    reply = os.fdopen(reply_fd, "w", encoding="utf-8")

    def send(msg: dict) -> None:
        reply.write(json.dumps(_jsonable(msg)) + "\n")
        reply.flush()

    t0 = time.perf_counter()
    try:
        import sgl_kernel
        import sglang

        engine = sglang.Engine(**kwargs)
    except BaseException as e:  # SGLang's reason goes back to the caller
        send({"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return 1
    from importlib.metadata import entry_points

    send({"ok": True, "pid": os.getpid(), "start_s": time.perf_counter() - t0,
          "sgl_kernel": getattr(sgl_kernel, "__file__", None), "sgl_kernel_is_shim": bool(getattr(sgl_kernel, "SHIM", False)),
          "plugins": [f"{ep.name}={ep.value}" for ep in entry_points(group="sglang.srt.plugins")],
          "sglang": sglang.__version__})
    code = 0
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op, kw = req["op"], req.get("kw") or {}
            if op == "shutdown":
                break
            if op == "generate":
                result = engine.generate(**kw)
            elif op == "flush_cache":
                result = engine.flush_cache()
            else:
                raise ValueError(f"unknown op {op!r}")
            send({"ok": True, "result": result})
        except BaseException as e:
            send({"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    try:
        engine.shutdown()  # kills this process's children (scheduler, detokenizer)
    except BaseException:
        code = 1
    return code


if __name__ == "__main__":
    os._exit(_host(int(sys.argv[1]), json.loads(sys.argv[2])))
