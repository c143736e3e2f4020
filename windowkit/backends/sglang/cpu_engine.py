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
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Optional

from windowkit.backends.sglang import extend_rows
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


# The same hosted Engine on one CUDA GPU (scripts/gpu_check.sh runs the live tests with it): the plain SGLang
# install (its own sgl_kernel, no stand-in, no CPU engine), fp32 and torch_native attention as on CPU, so the
# comparisons with transformers' fp32 forward hold; only the device and its kernels (KV writes, RoPE) change.
GPU_ENGINE_ARGS: dict[str, Any] = dict(CPU_ENGINE_ARGS, device="cuda")


class EngineStartError(WindowkitError):
    """The SGLang Engine did not start; the message carries SGLang's reason and the tail of its log."""


class EngineRequestError(WindowkitError):
    """The running Engine failed a request (its traceback is in the message)."""


def cpu_env(base: Optional[dict] = None, plugins: str = "windowkit") -> dict:
    """The environment of the engine processes: SGLang's CPU engine, the sgl_kernel stand-in on the path,
    SGLang's plugin loader restricted to ``plugins`` (the ``sglang.srt.plugins`` entry points), and the plugin's
    row-only extend attention (``extend_rows.py``) unless ``WINDOWKIT_SGLANG_EXTEND_ROWS=0`` is already set."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault(extend_rows.ENV, "1")
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if plugins:
        env["SGLANG_PLUGINS"] = plugins
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def gpu_env(base: Optional[dict] = None, plugins: str = "windowkit") -> dict:
    """The environment of a hosted GPU Engine: SGLang's own kernels (no stand-in, no CPU engine); the
    ``torch_native`` attention there gets the plugin's row-only extend attention too (as in ``cpu_env``)."""
    env = dict(os.environ if base is None else base)
    env.setdefault(extend_rows.ENV, "1")
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and Path(p).resolve() != SHIM_DIR)
    if plugins:
        env["SGLANG_PLUGINS"] = plugins
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def engine_args(model_path: str, linker: Optional[dict] = None, device: str = "cpu", **overrides: Any) -> dict:
    """``sglang.Engine`` keyword arguments for this CPU (``device="cuda"``: for one GPU) (``linker``: a
    ``linker_config()`` object, which turns on the dynamic external linker, i.e. ``WindowkitLinker``)."""
    if device not in ("cpu", "cuda"):
        raise WindowkitError(f"device must be 'cpu' or 'cuda', got {device!r}")
    kw = dict(CPU_ENGINE_ARGS if device == "cpu" else GPU_ENGINE_ARGS, model_path=str(model_path))
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


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group and reap ``proc`` (waiting at most 30 s)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


class CPUEngine:
    """Client of an SGLang Engine hosted in a child process (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, reply_fd: int, log_path: Path, info: dict):
        self.proc = proc
        self._reply = os.fdopen(reply_fd, "r", encoding="utf-8")
        self.log_path = log_path
        self.info = info  # what the host reported once ready: pid, start seconds, sgl_kernel file, plugins

    @classmethod
    def start(cls, model_path: str, *, linker: Optional[dict] = None, log_path: Optional[str] = None,
              timeout: float = 240.0, env: Optional[dict] = None, device: str = "cpu",
              **overrides: Any) -> "CPUEngine":
        """Start the host and its Engine; returns once the Engine is ready, else raises EngineStartError.
        ``device="cuda"``: the same host around an Engine on one GPU (``GPU_ENGINE_ARGS``, ``gpu_env``)."""
        kw = engine_args(model_path, linker, device, **overrides)
        if env is None:
            env = cpu_env() if device == "cpu" else gpu_env()
        log = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="windowkit-sglang-", suffix=".log")[1])
        r, w = os.pipe()
        with open(log, "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "windowkit.backends.sglang.cpu_engine", str(w), json.dumps(kw)],
                                    stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT, env=env,
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
        _kill_group(self.proc)
        for f in (self._reply, self.proc.stdin):
            try:
                f.close()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> "CPUEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- the HTTP server (launch_server)
def server_command(model_path: str, *, port: int, linker: Optional[dict] = None, host: str = "127.0.0.1",
                   device: str = "cpu", **overrides: Any) -> list[str]:
    """``python -m sglang.launch_server`` arguments equivalent to ``engine_args`` (the server's own flag names:
    ``--cuda-graph-backend-* disabled`` instead of the deprecated ``--disable-cuda-graph``)."""
    kw = engine_args(model_path, linker, device, **overrides)
    kw.pop("disable_cuda_graph", None)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", host, "--port", str(int(port)),
           "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            cmd.append(flag)
        elif v is False or v is None:
            continue
        else:
            cmd += [flag, json.dumps(v) if isinstance(v, (dict, list)) else str(v)]
    return cmd


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class CPUServer:
    """SGLang's HTTP server (``sglang.launch_server``) on loopback, as a subprocess of its own session, with
    the windowkit linker and plugin; the same CPU arguments and environment as ``CPUEngine``.

        srv = CPUServer.start(folder, linker=linker_config(hf.fingerprint(), stats_path))
        srv.post("/generate", {"input_ids": ids, "sampling_params": {...}})
        srv.close()                       # SIGTERM, then SIGKILL, of the server's process group
    """

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, start_s: float):
        self.proc, self.url, self.log_path, self.start_s = proc, url, log_path, start_s

    @classmethod
    def start(cls, model_path: str, *, linker: Optional[dict] = None, log_path: Optional[str] = None,
              timeout: float = 300.0, port: Optional[int] = None, device: str = "cpu", env: Optional[dict] = None,
              **overrides: Any) -> "CPUServer":
        """Start the server and wait until ``/health_generate`` answers; raises EngineStartError with the
        server's log tail if it exits or does not become healthy in ``timeout`` seconds."""
        port = port or free_port()
        log = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="windowkit-sglang-server-", suffix=".log")[1])
        cmd = server_command(model_path, port=port, linker=linker, device=device, **overrides)
        t0 = time.perf_counter()
        with open(log, "ab") as logf:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=env or (cpu_env() if device == "cpu" else gpu_env()), start_new_session=True)
        srv = cls(proc, f"http://127.0.0.1:{port}", log, 0.0)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                srv.kill()
                raise EngineStartError(f"SGLang's server exited (status {proc.returncode}) before it was healthy\n"
                                       f"--- server log ({log}) ---\n{_tail(log)}")
            try:
                if srv.get("/health_generate", timeout=30.0) is not None:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                srv.kill()
                raise EngineStartError(f"SGLang's server was not healthy within {timeout:.0f} s\n"
                                       f"--- server log ({log}) ---\n{_tail(log)}")
            time.sleep(1.0)
        srv.start_s = time.perf_counter() - t0
        return srv

    def _request(self, method: str, path: str, body: Optional[dict], timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return raw.decode("utf-8", "replace")

    def get(self, path: str, timeout: float = 600.0) -> Any:
        return self._request("GET", path, None, timeout)

    def post(self, path: str, body: Optional[dict] = None, timeout: float = 600.0) -> Any:
        """POST JSON; an HTTP error raises ``urllib.error.HTTPError`` (its body has SGLang's message)."""
        return self._request("POST", path, body or {}, timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        _kill_group(self.proc)

    def __enter__(self) -> "CPUServer":
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
        import sgl_kernel  # optional heavy dependencies: only the engine's child process loads them
        import sglang

        engine = sglang.Engine(**kwargs)
    except BaseException as e:  # SGLang's reason goes back to the caller
        send({"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return 1
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
