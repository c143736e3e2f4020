"""windowkit's SGLang plugin: hands each request's window plan to ``WindowkitLinker``.

SGLang calls ``load_plugins()`` in the engine and in every scheduler process; it runs each function
registered under the entry-point group ``sglang.srt.plugins`` (windowkit's pyproject.toml names
``register`` below) and then ``HookRegistry.apply_hooks()``. ``register`` adds one BEFORE hook on
``Scheduler.handle_generate_request``: when the request's ``sampling_params.custom_params`` carries a
plan (JSON string under ``"windowkit_plan"``), the hook

* parses it (a malformed plan is counted as a ``bad_plan`` fallback; the request runs normally),
* sets the request's ``cache_salt`` to the plan's when the caller left it empty (an approximate plan's
  pages must live in their own radix namespace), refusing the plan on a different explicit salt,
* registers it with ``linker.REGISTRY`` by rid and by page hashes, checking that the prompt starts with
  the plan's tokens.

The hook never raises into the scheduler: windowkit problems become counted fallbacks (exact prefill).

With ``WINDOWKIT_SGLANG_EXTEND_ROWS=1`` in the engine processes' environment (``cpu_engine.cpu_env`` sets it),
``register`` also wraps the ``torch_native`` backend's extend attention so that it computes only the rows being
prefilled (``extend_rows.py``: SGLang's CPU fallback otherwise attends over the whole padded sequence, so a
restored window would still pay a full prefill's attention).
Restrict SGLang to this plugin with ``SGLANG_PLUGINS=windowkit``.

    from windowkit.backends.sglang.plugin import register
    register()          # what load_plugins() does; needs sglang importable, no GPU
"""
from __future__ import annotations

import logging
from typing import Any

from windowkit.backends.sglang import extend_rows
from windowkit.backends.sglang.plan import PLAN_KEY, WindowPlan
from windowkit.errors import WindowkitError

logger = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_generate_request"


def on_generate_request(scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook: register the request's window plan (if any). Returns None (arguments unchanged)."""
    try:
        _register_request(recv_req)
    except Exception:  # never break serving: the request is prefilled as usual
        logger.exception("windowkit plugin: could not read the plan of request %s", getattr(recv_req, "rid", "?"))
    return None


def _register_request(recv_req: Any) -> None:
    from windowkit.backends.sglang.linker import REGISTRY  # the linker imports sglang (optional, heavy)

    sp = getattr(recv_req, "sampling_params", None)
    custom = getattr(sp, "custom_params", None) if not isinstance(sp, dict) else sp.get("custom_params")
    if not isinstance(custom, dict) or PLAN_KEY not in custom:
        return
    try:
        plan = WindowPlan.from_json(custom[PLAN_KEY])
    except WindowkitError as e:
        logger.warning("windowkit plugin: %s", e)
        REGISTRY.fallback(None, "bad_plan", "?")
        return
    salt = getattr(recv_req, "cache_salt", None) or None
    if salt is None and plan.cache_salt is not None:
        recv_req.cache_salt = salt = plan.cache_salt  # the scheduler builds the Req (and its RadixKey) from this
    extra_key = getattr(recv_req, "extra_key", None)
    lora_id = getattr(recv_req, "lora_id", None)
    if lora_id is not None:  # as Req.__init__ does: the namespace's extra_key carries the LoRA id
        extra_key = (extra_key or "") + lora_id
    ids = getattr(recv_req, "input_ids", None)
    REGISTRY.register(plan, rid=getattr(recv_req, "rid", None), extra_key=extra_key,
                      prompt_ids=list(ids) if ids is not None else None, cache_salt=salt)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: hook the scheduler's request handler (no GPU needed), and with
    ``WINDOWKIT_SGLANG_EXTEND_ROWS=1`` wrap the torch_native extend attention (``extend_rows.py``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional heavy dependency

    if any(h is on_generate_request for _, h, _ in HookRegistry._hooks.get(HOOK_TARGET, [])):
        return  # idempotent
    HookRegistry.register(HOOK_TARGET, on_generate_request, HookType.BEFORE)
    if extend_rows.enabled():
        HookRegistry.register(extend_rows.TARGET, extend_rows.extend_rows_attention, HookType.AROUND)


__all__ = ["register", "on_generate_request", "HOOK_TARGET"]
