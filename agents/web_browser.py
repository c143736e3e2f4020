"""A web agent on real pages: headless Chromium renders a local site, the Window keeps the task + last k observations.

    from agents.web_browser import BrowserAgent, Chromium, KeywordPolicy, LocalSite, demo_site
    with LocalSite(demo_site()) as site, Chromium(viewport=(336, 224)) as browser:
        agent = BrowserAgent(model, window=2, record="web.jsonl")        # a Qwen-VL model, or a text model
        report = agent.run(browser, site.url("/index.html"), TASK, steps=5, policy=KeywordPolicy(TASK))
    for row in report.steps: print(row.index, row.title, row.admitted, row.evicted, row.chosen)

Each step observes the page the browser shows and puts it in the Window:

* the real screenshot (``Page.captureScreenshot`` of the viewport) as an image chunk ``shot-<i>`` (Qwen-VL models:
  transformers' Pillow image processor, ``agents.long_video.FrameEncoder``); a text model has no image chunk;
* the page's text as a text chunk ``page-<i>``: the DOM's ``innerText`` (``text="dom"``) or a dump of Chromium's
  accessibility tree (``text="ax"``: one ``role name`` line per named node), after the title, cut to
  ``text_tokens`` tokens.

The window is ``[task] + the last k observations`` (one ``win.assign`` per step: the oldest observation's
chunks are evicted, the survivors relocate). The agent then reads the window once with a query that lists the
page's links (``win.forward``) and a policy picks the link to follow: ``KeywordPolicy`` (the unvisited link whose
words overlap the task most), ``ScriptedPolicy`` (labels in order) or ``ModelPolicy`` (the model itself: each
link label's mean token log-probability after the query, read off the window; a text model such as SmolLM2).
With ``record=PATH`` every step's window and query size go to a JSONL trace that ``windowkit simulate`` replays.

Chromium is Debian's ``chromium`` (``make chromium``), driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: no port, no extra package). Its resolver maps every host but 127.0.0.1 to
nothing, so pages reach loopback only. ``LocalSite`` serves the pages from memory on 127.0.0.1 (a free port),
stops itself after ``max_requests`` requests or ``timeout_s`` seconds, and on exit. Nothing is downloaded.
"""
from __future__ import annotations

import base64
import fcntl
import html
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from transformers import AutoTokenizer

from agents.common import common_prefix_tokens
from agents.long_video import FrameEncoder, byte_ids, sum_deltas
from agents.video_io import Frame
from agents.web import ScreenshotError
from windowkit.backends.hf import HFBackend
from windowkit.chunk import Chunk
from windowkit.errors import WindowkitError
from windowkit.kv.metrics import kl_divergence
from windowkit.trace.record import recording
from windowkit.trace.report import timeline, timeline_image
from windowkit.window import Window

CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium  (Debian's package; `make chromium` does this)"
STAT_FIELDS = ("encodes", "patch_forms", "patch_reuses", "patch_applies", "relocations", "prefill_tokens",
               "reused_tokens", "forwards", "fallbacks")


class BrowserError(WindowkitError):
    """Chromium is missing, failed to start, timed out, or could not load a page."""


# ====================================================================== a local site on loopback
class LocalSite:
    """Serve ``pages`` ({"/path.html": html}) from memory on 127.0.0.1 at a free port, in a background thread.

        with LocalSite(demo_site(), max_requests=200, timeout_s=120) as site:
            site.url("/index.html")        # "http://127.0.0.1:<port>/index.html"

    Bounded: the server stops itself after ``max_requests`` requests (later ones are refused) or ``timeout_s``
    seconds, whichever comes first, and always when the ``with`` block ends. ``site.requests`` lists the paths
    asked for, in order. Unknown paths get a 404.
    """

    def __init__(self, pages: dict[str, str], max_requests: int = 500, timeout_s: float = 300.0):
        bad = [p for p in pages if not p.startswith("/")]
        if bad:
            raise WindowkitError(f"page paths must start with '/', got {bad}")
        self.pages = dict(pages)
        self.max_requests = int(max_requests)
        self.timeout_s = float(timeout_s)
        self.requests: list[str] = []
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def _handler(self) -> type:
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with site._lock:
                    over = len(site.requests) >= site.max_requests
                    if not over:
                        site.requests.append(self.path)
                if over:
                    self.send_error(503, "request budget spent")
                    site._stop_soon()
                    return
                body = site.pages.get(self.path.split("?", 1)[0])
                if body is None:
                    self.send_error(404)
                    return
                data = body.encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet
                pass

        return Handler

    def start(self) -> "LocalSite":
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="windowkit-local-site", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.timeout_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise WindowkitError("the site is not started")
        return int(self._server.server_address[1])

    def url(self, path: str = "/index.html") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _stop_soon(self) -> None:
        threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            if self.stopped.is_set() or self._server is None:
                return
            self.stopped.set()
        if self._timer is not None:
            self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "LocalSite":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>
body {{ margin: 0; font: 15px/1.35 sans-serif; background: {bg}; color: #111; }}
header {{ background: {accent}; color: #fff; padding: 8px 12px; font-size: 20px; font-weight: bold; }}
main {{ padding: 8px 12px; }} nav a {{ display: inline-block; margin: 4px 6px 4px 0; padding: 4px 8px;
background: #fff; border: 2px solid {accent}; color: #000; text-decoration: none; border-radius: 4px; }}
.box {{ width: {box}px; height: 40px; background: {accent}; float: right; margin: 4px; }}
</style></head><body><header>{title}</header><main><div class="box"></div><p>{text}</p><nav>{links}</nav></main>
</body></html>"""


def page(title: str, text: str, links: Sequence[tuple[str, str]], bg: str = "#f4f4f4", accent: str = "#335",
         box: int = 60) -> str:
    """One page of a demo site: a coloured header with the title, a coloured box, a paragraph, links as buttons.

        page("Catalog", "Three products.", [("Red lamp", "/lamp.html")], accent="#2a7")
    """
    nav = " ".join(f'<a href="{html.escape(href)}">{html.escape(label)}</a>' for label, href in links)
    return _PAGE.format(title=html.escape(title), text=html.escape(text), links=nav, bg=bg, accent=accent, box=box)


def demo_site() -> dict[str, str]:
    """A small shop: home, catalog, three product pages, cart, checkout, help, about; every page has its own colours.

    The task ``DEMO_TASK`` is reached from /index.html by Catalog -> Red lamp -> Add to cart -> Checkout."""
    return {
        "/index.html": page("Tiny Shop", "Welcome to Tiny Shop. Browse the catalog or read the help pages.",
                            [("Catalog", "/catalog.html"), ("Help", "/help.html"), ("About us", "/about.html")],
                            bg="#eef3fb", accent="#2b4c9b", box=90),
        "/catalog.html": page("Catalog", "Three products are in stock today. Prices include tax.",
                              [("Red lamp", "/lamp.html"), ("Blue chair", "/chair.html"), ("Green mug", "/mug.html"),
                               ("Home", "/index.html")], bg="#effaf1", accent="#21814a", box=40),
        "/lamp.html": page("Red lamp", "A red desk lamp with a warm bulb. Price: 12 EUR. In stock.",
                           [("Add to cart", "/cart.html"), ("Catalog", "/catalog.html")], bg="#fdf0ee",
                           accent="#c0392b", box=140),
        "/chair.html": page("Blue chair", "A blue wooden chair. Price: 40 EUR.",
                            [("Add to cart", "/cart.html"), ("Catalog", "/catalog.html")], bg="#eef6fd",
                            accent="#1f6fb2", box=110),
        "/mug.html": page("Green mug", "A green mug that holds 300 ml. Price: 6 EUR.",
                          [("Add to cart", "/cart.html"), ("Catalog", "/catalog.html")], bg="#f1fbef",
                          accent="#4a9b2b", box=70),
        "/cart.html": page("Your cart", "Your cart holds one item. Total: 12 EUR.",
                           [("Checkout", "/checkout.html"), ("Home", "/index.html")], bg="#fff7e6",
                           accent="#d68910", box=180),
        "/checkout.html": page("Order placed", "Thank you. Your order number is 4711.",
                               [("Home", "/index.html")], bg="#f4effa", accent="#7d3c98", box=220),
        "/help.html": page("Help", "Questions about orders and delivery are answered here.",
                           [("Home", "/index.html"), ("About us", "/about.html")], bg="#f7f7f7", accent="#555", box=30),
        "/about.html": page("About us", "Tiny Shop is a demo shop served on loopback for windowkit's tests.",
                            [("Home", "/index.html")], bg="#fbfbe9", accent="#8a8a1f", box=20),
    }


DEMO_TASK = "Buy the red lamp: open the catalog, go to the red lamp, add it to the cart, then checkout."


# ====================================================================== headless Chromium over the DevTools pipe
def chromium_path() -> str:
    """The Chromium executable (Debian's ``chromium``), or ``BrowserError`` naming the install step."""
    for name in ("chromium", "chromium-browser"):
        exe = shutil.which(name)
        if exe:
            return exe
    raise BrowserError(f"headless Chromium is not installed: {CHROMIUM_INSTALL}")


@dataclass
class Link:
    label: str
    href: str


@dataclass
class Observation:
    """What the agent sees at one step: the page's URL, title, text (DOM text or an accessibility-tree dump), its
    links and the real screenshot (a PIL RGB image of the viewport)."""

    index: int
    url: str
    title: str
    text: str
    links: list[Link]
    screenshot: Any


_PAGE_INFO_JS = """JSON.stringify({url: location.href, title: document.title,
  text: document.body ? document.body.innerText : "",
  links: Array.from(document.querySelectorAll('a[href]')).map(a => ({label: a.innerText.trim(), href: a.href}))})"""


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe: navigate, read the page, take screenshots.

        with Chromium(viewport=(336, 224)) as browser:
            obs = browser.observe("http://127.0.0.1:8000/index.html", index=0)   # Observation
            obs.screenshot.size == (336, 224)

    Every wait is bounded by ``timeout_s`` (``BrowserError`` past it). The browser's resolver maps every host but
    127.0.0.1 to nothing, background networking is off, and the profile is a temporary folder removed on close.
    """

    def __init__(self, viewport: tuple[int, int] = (336, 224), timeout_s: float = 30.0,
                 executable: Optional[str] = None):
        self.viewport = (int(viewport[0]), int(viewport[1]))
        self.timeout_s = float(timeout_s)
        self.executable = executable or chromium_path()
        if not (os.path.isfile(self.executable) and os.access(self.executable, os.X_OK)):
            raise BrowserError(f"{self.executable} is not an executable file: {CHROMIUM_INSTALL}")
        self._proc: Optional[subprocess.Popen] = None
        self._profile: Optional[str] = None
        self._buf = b""
        self._id = 0
        self._events: list[dict] = []
        self._session: Optional[str] = None

    # ------------------------------------------------------------------ process
    def start(self) -> "Chromium":
        r_in, w_in = os.pipe()  # we write commands, Chromium reads them on fd 3
        r_out, w_out = os.pipe()  # Chromium writes replies on fd 4
        self._profile = tempfile.mkdtemp(prefix="wk-chromium-")
        args = [self.executable, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio",
                "--remote-debugging-pipe", f"--user-data-dir={self._profile}", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-default-apps", "--metrics-recording-only",
                "--disable-features=Translate,MediaRouter,OptimizationHints,AutofillServerCommunication",
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
                f"--window-size={self.viewport[0]},{self.viewport[1]}", "about:blank"]

        # Chromium reads the pipe on fds 3 and 4. A tiny Python trampoline puts our pipe ends there and execs it
        # (no preexec_fn, which is unsafe in a threaded parent such as one running LocalSite). The ends are first
        # moved to fds >= 10, so the dup2 onto 3 and 4 can never clobber them.
        a = fcntl.fcntl(r_in, fcntl.F_DUPFD_CLOEXEC, 10)
        b = fcntl.fcntl(w_out, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(r_in)
        os.close(w_out)
        r_in, w_out = a, b
        tramp = ("import os, sys; a, b = int(sys.argv[1]), int(sys.argv[2]); os.dup2(a, 3); os.dup2(b, 4); "
                 "os.close(a); os.close(b); os.execv(sys.argv[3], sys.argv[3:])")
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", tramp, str(r_in), str(w_out), *args],
                                          pass_fds=(r_in, w_out), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            for fd in (r_in, w_in, r_out, w_out):
                os.close(fd)
            self._cleanup_profile()
            raise BrowserError(f"cannot start {self.executable}: {e} ({CHROMIUM_INSTALL})") from None
        os.close(r_in)
        os.close(w_out)
        self._w, self._r = w_in, r_out
        try:
            try:
                self.call("Browser.getVersion")
            except BrowserError as e:
                try:
                    rc = self._proc.wait(timeout=5) if self._proc is not None else None
                except subprocess.TimeoutExpired:  # still running but not answering: close() ends it
                    rc = None
                raise BrowserError(f"{self.executable} did not start ({e}; exit code {rc}). Is it Chromium? "
                                   f"{CHROMIUM_INSTALL}") from None
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self._session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            self.call("Page.enable", session=True)
            self.call("Page.setLifecycleEventsEnabled", {"enabled": True}, session=True)
            self.call("Emulation.setDeviceMetricsOverride", {"width": self.viewport[0], "height": self.viewport[1],
                                                             "deviceScaleFactor": 1, "mobile": False}, session=True)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Close the browser (politely, then by kill after 5 s) and remove its profile folder."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None:
                    self._send("Browser.close", {}, None)
            except (BrowserError, OSError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # the browser's own process group (start_new_session): its helpers too
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()
                proc.wait(timeout=5)
            for fd in (self._w, self._r):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._cleanup_profile()

    def _cleanup_profile(self) -> None:
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None

    def __enter__(self) -> "Chromium":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol
    def _send(self, method: str, params: dict, session: Optional[str]) -> int:
        self._id += 1
        msg: dict = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        try:
            os.write(self._w, data)
        except OSError as e:
            raise BrowserError(f"Chromium is gone ({e})") from None
        return self._id

    def _next_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"Chromium did not answer within {self.timeout_s:g} s")
            ready, _, _ = select.select([self._r], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise BrowserError("Chromium closed the DevTools pipe (it crashed or exited)")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: Optional[dict] = None, session: bool = False) -> dict:
        """One DevTools command; its result (``BrowserError`` on a protocol error or past ``timeout_s``)."""
        if self._proc is None:
            raise BrowserError("the browser is not running (use it inside `with Chromium() as browser:`)")
        mid = self._send(method, params or {}, self._session if session else None)
        deadline = time.monotonic() + self.timeout_s
        while True:
            m = self._next_message(deadline)
            if m.get("id") == mid:
                if "error" in m:
                    raise BrowserError(f"{method}: {m['error'].get('message', m['error'])}")
                return m.get("result", {})
            if "method" in m:
                self._events.append(m)

    def _wait_event(self, method: str, deadline: float, **match: Any) -> dict:
        """The next event ``method`` whose params hold ``match`` (earlier ones are kept; unmatched ones dropped on
        the next ``goto``)."""
        def hit(m: dict) -> bool:
            p = m.get("params", {})
            return m.get("method") == method and all(p.get(k) == v for k, v in match.items())

        while True:
            for i, m in enumerate(self._events):
                if hit(m):
                    return self._events.pop(i)
            self._events.append(self._next_message(deadline))

    # ------------------------------------------------------------------ pages
    def goto(self, url: str) -> None:
        """Navigate the page to ``url`` and wait for THIS navigation's load event (matched by its loader id, so a
        late event of an earlier, failed navigation is never taken for it)."""
        self._events.clear()
        res = self.call("Page.navigate", {"url": url}, session=True)
        if res.get("errorText"):
            raise BrowserError(f"cannot load {url}: {res['errorText']}")
        deadline = time.monotonic() + self.timeout_s
        if res.get("loaderId"):
            self._wait_event("Page.lifecycleEvent", deadline, name="load", loaderId=res["loaderId"])
        else:  # a same-document navigation
            self._wait_event("Page.loadEventFired", deadline)

    def page_info(self) -> dict:
        """{url, title, text (the body's innerText), links [{label, href}]} of the current page."""
        res = self.call("Runtime.evaluate", {"expression": _PAGE_INFO_JS, "returnByValue": True}, session=True)
        return json.loads(res["result"]["value"])

    def ax_text(self) -> str:
        """The accessibility tree as text: one ``role name`` line per named node, in tree order (ignored nodes,
        inline text boxes and the document root left out)."""
        nodes = self.call("Accessibility.getFullAXTree", {}, session=True).get("nodes", [])
        lines = []
        for n in nodes:
            name = str((n.get("name") or {}).get("value", "")).strip()
            role = str((n.get("role") or {}).get("value", ""))
            if name and not n.get("ignored") and role not in ("InlineTextBox", "RootWebArea", "generic"):
                lines.append(f"{role} {name}")
        return "\n".join(lines)

    def screenshot(self) -> Any:
        """The viewport as a PIL RGB image of ``viewport`` size."""
        from PIL import Image

        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        img = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
        if img.size != self.viewport:
            raise BrowserError(f"screenshot is {img.size[0]}x{img.size[1]}, expected {self.viewport}")
        return img

    def observe(self, url: str, index: int = 0, text: str = "dom") -> Observation:
        """Load ``url`` and return what is on screen: screenshot, title, text (``"dom"`` | ``"ax"``) and links."""
        if text not in ("dom", "ax"):
            raise WindowkitError(f"text must be 'dom' or 'ax', got {text!r}")
        self.goto(url)
        info = self.page_info()
        body = self.ax_text() if text == "ax" else info["text"]
        links = [Link(str(x["label"]), str(x["href"])) for x in info["links"] if str(x["label"]).strip()]
        return Observation(int(index), str(info["url"]), str(info["title"]), str(body), links, self.screenshot())


# ====================================================================== policies
_WORD = re.compile(r"[a-z0-9]+")


def _words(s: str) -> set[str]:
    return set(_WORD.findall(s.lower()))


class KeywordPolicy:
    """Follow the link whose label shares the most words with the task, preferring pages not visited yet; ties go to
    the first such link on the page. ``None`` when the page has no links.

        KeywordPolicy(DEMO_TASK)(obs, agent)   # (Link("Catalog", ".../catalog.html"), {"Catalog": 1.0, ...})
    """

    def __init__(self, task: str):
        self.task = _words(task)

    def __call__(self, obs: Observation, agent: "BrowserAgent") -> tuple[Optional[Link], dict]:
        if not obs.links:
            return None, {}
        visited = set(agent.visited)
        scores = {}
        for ln in obs.links:
            scores.setdefault(ln.label, len(_words(ln.label) & self.task) - (0.5 if ln.href in visited else 0.0))
        best = max(obs.links, key=lambda ln: scores[ln.label])  # max keeps the first of equal scores
        return best, scores


class ScriptedPolicy:
    """Follow the links with these labels, one per step (``BrowserError`` if a page lacks the next one).

        ScriptedPolicy(["Catalog", "Red lamp", "Add to cart"])
    """

    def __init__(self, labels: Sequence[str]):
        self.labels = list(labels)

    def __call__(self, obs: Observation, agent: "BrowserAgent") -> tuple[Optional[Link], dict]:
        if obs.index >= len(self.labels):
            return None, {}
        want = self.labels[obs.index]
        for ln in obs.links:
            if ln.label == want:
                return ln, {}
        raise BrowserError(f"step {obs.index}: {obs.url} has no link {want!r} (links: {[x.label for x in obs.links]})")


class ModelPolicy:
    """The model picks the link: for each distinct label, the mean log-probability of its tokens after the step's
    query (which lists the links), read off the window with ``win.forward`` (one forward per label token); the
    highest wins, ties to the first. Works with any model the Window runs, e.g. SmolLM2.

        ModelPolicy()(obs, agent)   # (Link, {"Catalog": -1.9, "Help": -4.2, ...})
    """

    def __call__(self, obs: Observation, agent: "BrowserAgent") -> tuple[Optional[Link], dict]:
        if not obs.links:
            return None, {}
        query = list(agent.last_query)
        scores: dict[str, float] = {}
        for ln in obs.links:
            if ln.label in scores:
                continue
            toks = list(agent.tokenize(agent.prompts.label.format(label=ln.label)))
            if not toks:
                scores[ln.label] = float("-inf")
                continue
            total = 0.0
            for j, tok in enumerate(toks):
                logits = agent.last_logits if j == 0 else agent.win.forward(query + toks[:j])
                total += float(torch.log_softmax(logits.double(), -1)[tok])
            scores[ln.label] = total / len(toks)
        best = max(obs.links, key=lambda ln: scores[ln.label])
        return best, scores


# ====================================================================== the agent
@dataclass(frozen=True)
class Prompts:
    """How the agent writes text for the model: the task chunk, each page chunk, the query after the window, and a
    link label as the answer (``ModelPolicy`` scores it). Fields are ``str.format`` templates.

        Prompts(task="Task: {task}\n", page="\nPage: {title}\n{text}\n", query="\nLinks: {links}\nNext link:",
                label=" {label}")
    """

    task: str = "Task: {task}\n"
    page: str = "\nPage: {title}\n{text}\n"
    query: str = "\nLinks: {links}\nNext link:"
    label: str = " {label}"


#: ChatML turns (SmolLM2, Qwen): the task and the pages in the user turn, the answer is the assistant's first words
CHATML = Prompts(task="<|im_start|>user\nTask: {task}\n",
                 query="\nLinks: {links}\nWhich link brings me closer to the task? Answer with the link only."
                       "<|im_end|>\n<|im_start|>assistant\n",
                 label="{label}")


@dataclass
class BrowserStepLog:
    index: int
    url: str
    title: str
    held: list[str]  # chunk ids after the task, in window order
    admitted: list[str]
    evicted: list[str]
    delta: dict  # win.stats deltas over the step (STAT_FIELDS) + the backend's "vision_calls"
    chosen: Optional[Link]
    scores: dict
    window_tokens: int
    page_tokens: int
    query_tokens: int
    prefix_cache_tokens: int
    ms: float  # assign + the query forward + the policy
    screenshot: Any = None  # the PIL image (kept for pictures)
    links: list[Link] = field(default_factory=list)
    text: str = ""  # the page text observed (DOM text or accessibility-tree dump), before tokenizing
    logits: Optional[torch.Tensor] = None  # next-token logits [vocab] after the query (what the policy read)
    query: list[int] = field(default_factory=list)  # the query's ids
    kl: Optional[float] = None  # KL(exact || windowkit) of the query's next-token distribution (reference=True)


@dataclass
class BrowserReport:
    steps: list[BrowserStepLog] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    vision_calls: int = 0

    def totals(self) -> dict:
        return sum_deltas(self.steps, STAT_FIELDS + ("vision_calls",))


class BrowserAgent:
    """A web agent whose context is a windowkit ``Window`` over real browser observations (module docstring).

    model:       a Qwen2.5-VL / Qwen3-VL model (screenshot + page text per observation) or a text model (page text)
    window:      observations held per step after the task chunk
    viewport:    (w, h) of the browser; rounded to multiples of patch x merge for a VL model
    tokenize:    text -> ids; default: the checkpoint's tokenizer (``model_path``), else ``byte_ids`` (tiny models)
    prompts:     the text templates (``Prompts``; ``CHATML`` for an instruct model such as SmolLM2)
    text:        "dom" (innerText) | "ax" (accessibility tree); text_tokens: page text kept per observation
    reference:   also keep a mode="exact" window over the same chunks: per-step KL of the query logits
    record:      a JSONL trace path (rewritten by each ``run``)
    rank, mode, form: passed to ``Window``
    """

    def __init__(self, model: Any, *, window: int = 2, viewport: tuple[int, int] = (336, 224),
                 tokenize: Optional[Callable[[str], Sequence[int]]] = None, text: str = "dom", text_tokens: int = 64,
                 model_path: Optional[str] = None, reference: bool = False, record: Union[str, Path, None] = None,
                 rank: Optional[int] = 32, mode: str = "patch", form: Optional[str] = None,
                 prompts: Prompts = Prompts()):
        if int(window) < 1:
            raise WindowkitError(f"window must be >= 1 observation, got {window}")
        if text not in ("dom", "ax"):
            raise WindowkitError(f"text must be 'dom' or 'ax', got {text!r}")
        if int(text_tokens) < 1:
            raise WindowkitError(f"text_tokens must be >= 1, got {text_tokens}")
        self.window, self.text, self.text_tokens = int(window), text, int(text_tokens)
        self.prompts = prompts
        self.vision = getattr(model.config, "vision_config", None) is not None
        self.encoder = FrameEncoder(model, viewport, model_path) if self.vision else None
        self.viewport = self.encoder.size if self.encoder is not None else (int(viewport[0]), int(viewport[1]))
        self.tokenize = tokenize or self._default_tokenizer(model, model_path)
        self.backend = HFBackend(model)
        kw = {"form": form} if form is not None else {}
        self.win = Window(self.backend, rank=rank, mode=mode, **kw)
        self.ref = Window(HFBackend(model), mode="exact") if reference else None
        self.record = record
        self.recorder = None
        self.task: Optional[Chunk] = None
        self.observations: list[list[Chunk]] = []
        self.visited: list[str] = []
        self.last_query: list[int] = []
        self.last_logits: Optional[torch.Tensor] = None
        self._prev: list[Chunk] = []

    @staticmethod
    def _default_tokenizer(model: Any, model_path: Optional[str]) -> Callable[[str], Sequence[int]]:
        if model_path:
            try:
                tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
                return lambda s: tok(s, add_special_tokens=False)["input_ids"]
            except Exception:  # no tokenizer files: the byte stand-in
                pass
        vocab = int(model.get_output_embeddings().weight.shape[0])
        return lambda s: byte_ids(s, vocab)

    # ------------------------------------------------------------------ chunks
    def observation_chunks(self, obs: Observation) -> list[Chunk]:
        """``shot-<i>`` (VL models) and ``page-<i>``; raises before any window edit on a bad screenshot."""
        from PIL import Image

        out = []
        if self.encoder is not None:
            img = obs.screenshot
            if not isinstance(img, Image.Image) or img.size != tuple(self.viewport):
                raise ScreenshotError(f"observation {obs.index}: screenshot must be a {self.viewport} PIL image")
            c = self.encoder(Frame(obs.index, float(obs.index), np.asarray(img.convert("RGB"))))
            c.id = f"shot-{obs.index}"
            out.append(c)
        ids = list(self.tokenize(self.prompts.page.format(title=obs.title, text=obs.text)))[: self.text_tokens]
        out.append(Chunk.text(torch.tensor(ids, dtype=torch.long), id=f"page-{obs.index}"))
        return out

    def query_ids(self, obs: Observation) -> list[int]:
        """The query read after the window: the page's links and the cue for the next one."""
        labels = list(dict.fromkeys(ln.label for ln in obs.links))
        q = list(self.tokenize(self.prompts.query.format(links=", ".join(labels) or "(none)")))
        if not q:
            raise WindowkitError("the tokenizer gave no ids for the query")
        return q

    # ------------------------------------------------------------------ running
    def start(self, task: str) -> None:
        ids = list(self.tokenize(self.prompts.task.format(task=task)))
        if not ids:
            raise WindowkitError("the task tokenized to nothing")
        self.task = Chunk.text(torch.tensor(ids, dtype=torch.long), id="task")
        self.observations, self.visited, self._prev = [], [], []

    def step(self, obs: Observation, policy: Callable[[Observation, "BrowserAgent"], tuple]) -> BrowserStepLog:
        """Put one observation in the window (evicting the oldest beyond ``window``), read the window with the
        links query, and let ``policy`` choose the link to follow."""
        if self.task is None:
            raise WindowkitError("call start(task) before step()")
        new = self.observation_chunks(obs)  # may raise: nothing edited yet
        query = self.query_ids(obs)
        held_obs = (self.observations + [new])[-self.window:]
        held = [c for o in held_obs for c in o]
        wanted = [self.task] + held
        before = self.win.stats.as_dict()
        vc0 = self.backend.stats.vision_calls
        t0 = time.perf_counter()
        edits = self.win.assign(wanted)
        self.observations.append(new)
        self.visited.append(obs.url)
        if self.recorder is not None:
            self.recorder.record(self.win, query_tokens=len(query))
        self.last_query = query
        self.last_logits = self.win.forward(query)
        chosen, scores = policy(obs, self)
        ms = (time.perf_counter() - t0) * 1e3
        after = self.win.stats.as_dict()
        delta = {k: after[k] - before[k] for k in STAT_FIELDS}
        delta["vision_calls"] = self.backend.stats.vision_calls - vc0
        row = BrowserStepLog(obs.index, obs.url, obs.title, [c.id for c in held],
                             [cid for op, cid in edits if op in ("admit", "recall")],
                             [cid for op, cid in edits if op == "evict"], delta, chosen, dict(scores),
                             sum(len(c) for c in wanted), len(new[-1]), len(query),
                             common_prefix_tokens(self._prev, wanted), ms, obs.screenshot, list(obs.links), obs.text,
                             self.last_logits, list(query))
        self._prev = wanted
        if self.ref is not None:
            self.ref.assign(wanted)
            row.kl = kl_divergence(self.ref.forward(query), self.last_logits)
        return row

    def run(self, browser: Chromium, start_url: str, task: str, steps: int,
            policy: Callable[[Observation, "BrowserAgent"], tuple],
            on_step: Optional[Callable[[BrowserStepLog], None]] = None) -> BrowserReport:
        """Open ``start_url``, then ``steps`` times: observe, step, follow the chosen link (stops early when the
        policy chooses none). Returns the per-step logs."""
        if int(steps) < 1:
            raise WindowkitError(f"steps must be >= 1, got {steps}")
        if tuple(browser.viewport) != tuple(self.viewport):
            raise WindowkitError(f"the browser's viewport {browser.viewport} is not the agent's {self.viewport}")
        self.start(task)
        report = BrowserReport()
        url = start_url
        with recording(self, self.record):
            for i in range(int(steps)):
                obs = browser.observe(url, index=i, text=self.text)
                row = self.step(obs, policy)
                report.steps.append(row)
                if on_step is not None:
                    on_step(row)
                if row.chosen is None:
                    break
                url = row.chosen.href
        report.stats = self.win.stats.as_dict()
        report.vision_calls = self.backend.stats.vision_calls
        return report


# ====================================================================== output
def format_step_header() -> str:
    return (f"{'step':>4} {'page':<14} {'held':<28} {'admitted':<16} {'evicted':<16} {'enc':>4} {'vis':>4} "
            f"{'reloc':>5} {'prefill':>7} {'pc_tok':>6} {'window':>6} {'ms':>7} {'KL':>8} next")


def format_step_row(r: BrowserStepLog) -> str:
    d = r.delta

    def short(ids: Sequence[str]) -> str:
        return ",".join(s.replace("shot-", "s").replace("page-", "p") for s in ids) or "-"

    kl = f"{r.kl:>8.1e}" if r.kl is not None else f"{'-':>8}"
    nxt = r.chosen.label if r.chosen is not None else "(stop)"
    return (f"{r.index:>4} {r.title[:14]:<14} {short(r.held):<28} {short(r.admitted):<16} {short(r.evicted):<16} "
            f"{d['encodes']:>4} {d['vision_calls']:>4} {d['relocations']:>5} {d['prefill_tokens']:>7} "
            f"{r.prefix_cache_tokens:>6} {r.window_tokens:>6} {r.ms:>7.1f} {kl} {nxt}")


def plot_run(report: BrowserReport, trace: Any, path: Union[str, Path], title: str = "") -> Path:
    """The run's screenshots (one per step, with the page title and the link followed) above the window timeline
    of its recorded trace (``windowkit.trace.report.timeline_image``: chunks down, steps across, coloured by slot).

        plot_run(report, read_trace("web.jsonl"), "docs/img/web_browser_run.png")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm

    orders = [st.context for st in trace]
    n = len(report.steps)
    if n == 0 or not orders:
        raise WindowkitError("nothing to plot: the run has no steps")
    fig = plt.figure(figsize=(max(8.0, 2.3 * n), 5.6), dpi=110)
    gs = fig.add_gridspec(2, n, height_ratios=[1.0, 1.5], hspace=0.25, wspace=0.08)
    for i, r in enumerate(report.steps):
        ax = fig.add_subplot(gs[0, i])
        ax.imshow(np.asarray(r.screenshot))
        ax.set_xticks([])
        ax.set_yticks([])
        nxt = f"-> {r.chosen.label}" if r.chosen is not None else "(stop)"
        ax.set_title(f"step {i}: {r.title}\n{nxt}", fontsize=8)
    ax = fig.add_subplot(gs[1, :])
    img, n_ids = timeline_image(orders)
    ids, _ = timeline(orders)
    top = int(np.nanmax(img)) if np.isfinite(img).any() else 0
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    norm = BoundaryNorm([b - 0.5 for b in range(top + 2)], cmap.N)
    im = ax.imshow(np.ma.masked_invalid(img), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                   extent=(-0.5, len(orders) - 0.5, n_ids - 0.5, -0.5))
    ax.set_yticks(range(n_ids))
    ax.set_yticklabels(ids, fontsize=7)
    ax.set_xticks(range(len(orders)))
    ax.set_xlabel("step")
    ax.set_title("Window timeline (task + last observations; colour = slot in the window, 0 = head)", fontsize=9)
    fig.colorbar(im, ax=ax, label="slot", ticks=range(top + 1), fraction=0.03)
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


__all__ = ["BrowserError", "LocalSite", "page", "demo_site", "DEMO_TASK", "chromium_path", "Chromium", "Link",
           "Observation", "Prompts", "CHATML", "KeywordPolicy", "ScriptedPolicy", "ModelPolicy", "BrowserStepLog",
           "BrowserReport",
           "BrowserAgent", "format_step_header", "format_step_row", "plot_run", "CHROMIUM_INSTALL"]
