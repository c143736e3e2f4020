"""Write a simulation report: ``summary.json``, four PNG plots and a self-contained ``report.html``.

    from windowkit.trace import simulate, sliding_window
    from windowkit.trace.report import write_report
    trace = sliding_window(steps=100)
    res = simulate(trace, "cpu-tiny")
    paths = write_report(res, "out/", trace=trace)   # {"summary": ..., "cost_per_step": ..., ..., "html": ...}

Plots (matplotlib, Agg canvas, no pyplot state):
  cost_per_step     modeled ms of every step per strategy (log scale; bin means when over 2000 steps)
  cumulative_time   running total of the modeled time per strategy (the floor, when run, dashed)
  hit_miss          per strategy: tokens prefilled vs served without a prefill, and the operation counts
  window_timeline   which chunks are in the window at each step, coloured by their slot (needs the trace)

``report.html`` embeds the PNGs as base64 data URIs and inlines its CSS: it loads nothing from anywhere.
"""
from __future__ import annotations

import base64
import html
import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from windowkit.trace.orders import resolve_orders
from windowkit.trace.result import SimResult
from windowkit.trace.schema import ChunkRef, Step, Trace

MAX_POINTS = 2000  # per-step series longer than this are plotted as bin means
SMOOTH_FROM = 100  # cost-per-step plots of longer runs add a rolling mean
PER_STEP_LIMIT = 2000  # summary.json carries the per-step series only up to this many steps
PLOTS = ("cost_per_step", "cumulative_time", "hit_miss", "window_timeline")
# columns of the summary table: (totals key, header)
TABLE_COLS = [("prefill_tokens", "prefill tokens"), ("encodes", "encodes"), ("vision_encodes", "vision encodes"),
              ("patch_forms", "patch forms"), ("patch_applies", "patch applies"), ("relocations", "relocations"),
              ("binding_risk", "binding risk")]
COUNT_COLS = ["encodes", "vision_encodes", "patch_forms", "patch_applies", "relocations", "binding_risk"]
TraceLike = Union[Trace, Sequence[Step], Sequence[Sequence[ChunkRef]]]


# ====================================================================== data
def downsample(values: Sequence[float], max_points: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """(x, y): the series itself when short, else means of ``ceil(n / max_points)``-step bins, x at bin centres.

        downsample([1, 2, 3, 4, 5, 6], 3)   # ([0.5, 2.5, 4.5], [1.5, 3.5, 5.5])
    """
    n = len(values)
    if n <= max_points:
        return [float(i) for i in range(n)], [float(v) for v in values]
    w = math.ceil(n / max_points)
    xs, ys = [], []
    for i in range(0, n, w):
        part = values[i:i + w]
        xs.append(i + (len(part) - 1) / 2)
        ys.append(sum(part) / len(part))
    return xs, ys


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start).

        rolling_mean([2, 4, 6, 8], 2)   # [2.0, 3.0, 5.0, 7.0]
    """
    out, run = [], 0.0
    for i, v in enumerate(values):
        run += v
        if i >= window:
            run -= values[i - window]
        out.append(run / min(i + 1, window))
    return out


def _orders(trace: Optional[TraceLike], n: int, result: Optional[SimResult] = None
            ) -> tuple[Optional[list[list[ChunkRef]]], Optional[list[int]]]:
    """The orders the first ``n`` steps were replayed in, and their query tokens when the steps are known.
    Orders a run recorded (``result.orders``, e.g. under a placement policy) win over re-resolving ``trace``."""
    recorded = getattr(result, "orders", None)
    items = list(trace)[:n] if trace is not None else []
    steps = items if items and isinstance(items[0], Step) else None
    queries = [s.query_tokens for s in steps] if steps else None
    if not queries and getattr(result, "queries", None):
        queries = list(result.queries[:n])
    if recorded:
        return [list(o) for o in recorded[:n]], queries
    if trace is None:
        return None, None
    if steps:
        return resolve_orders(steps), queries
    return [list(o) for o in items], None  # already resolved orders: lists of ChunkRef


def timeline(orders: Sequence[Sequence[ChunkRef]]) -> tuple[list[str], list[tuple[int, int, int]]]:
    """Chunk ids by first appearance, and one ``(step, chunk row, slot)`` per chunk held at each step.

        timeline([[A, B], [B, C]])   # (["A", "B", "C"], [(0, 0, 0), (0, 1, 1), (1, 1, 0), (1, 2, 1)])
    """
    rows: dict[str, int] = {}
    cells = []
    for t, ctx in enumerate(orders):
        for slot, c in enumerate(ctx):
            r = rows.setdefault(c.id, len(rows))
            cells.append((t, r, slot))
    return list(rows), cells


def summary_dict(result: SimResult, trace: Optional[TraceLike] = None) -> dict:
    """``result.summary()`` plus ``per_step`` series ({strategy: {field: [...]}}) when the run has at most
    ``PER_STEP_LIMIT`` steps, and ``context_tokens_per_step`` / ``query_tokens_per_step`` when the trace is given."""
    s = result.summary()
    n = s["steps"]
    if n <= PER_STEP_LIMIT:
        s["per_step"] = {name: _columns(result.per_step(name)) for name in result.strategies}
        orders, queries = _orders(trace, n, result)
        if orders is not None:
            s["context_tokens_per_step"] = [sum(c.tokens for c in ctx) for ctx in orders]
        if queries is not None:
            s["query_tokens_per_step"] = queries
    else:
        s["per_step"] = None
        s["per_step_omitted"] = f"{n} steps > {PER_STEP_LIMIT}: per-step series left out to keep the file small"
    return s


def _columns(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in (rows[0] if rows else {})}


# ====================================================================== plots
def _figure(w: float = 10, h: float = 4.8):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colors(names: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _plain_log_ticks(axis) -> None:
    """Log-axis labels as plain numbers (300, 1,000, 3e+04) instead of 3x10^2."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if 1 <= v < 1e6 else f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _thousands():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.0f}")


FLOOR = "floor"  # the lower-bound strategy (windowkit/trace/floor.py): drawn dashed, in black


def _line_style(name: str, col: dict) -> dict:
    """Plot kwargs of a strategy's line: the floor is a black dashed reference line, the rest solid."""
    if name == FLOOR:
        return {"color": "black", "ls": "--"}
    return {"color": col[name]}


def _save(fig, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _title(result: SimResult, what: str) -> str:
    return f"{what}: {result.trace_name}, profile {result.profile}"


def plot_cost_per_step(result: SimResult, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    col = _colors(result.strategies)
    n = len(result.steps[result.strategies[0]]) if result.strategies else 0
    binned = n > MAX_POINTS
    smooth = max(5, n // 60) if n > SMOOTH_FROM else 0
    for name in result.strategies:
        ms = [c.total_ms for c in result.steps[name]]
        x, y = downsample(ms)
        sty = _line_style(name, col)
        if smooth:  # long traces: the raw series is noise at this size; a faint line under a rolling mean
            ax.plot(x, y, lw=0.5, alpha=0.25, **sty)
            x, y = downsample(rolling_mean(ms, smooth))
            ax.plot(x, y, label=name, lw=1.8, **sty)
        else:
            ax.plot(x, y, label=name, lw=1.6, marker=None if n > 60 else "o", ms=3, **sty)
    pos = [c.total_ms for v in result.steps.values() for c in v if c.total_ms > 0]
    log = bool(pos) and max(pos) / min(pos) > 20  # log only where strategies differ by orders of magnitude
    if log:
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
    else:
        ax.set_ylim(bottom=0)
    how = [f"means of {math.ceil(n / MAX_POINTS)}-step bins"] if binned else []
    how += [f"bold: rolling mean over {smooth} steps"] if smooth else []
    ax.set_xlabel("step" + (f" ({'; '.join(how)})" if how else ""))
    ax.set_ylabel("modeled time per step (ms" + (", log)" if log else ")"))
    ax.set_title(_title(result, "Cost per step"))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _save(fig, path)


def plot_cumulative(result: SimResult, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    col = _colors(result.strategies)
    for name in result.strategies:
        run, cum = 0.0, []
        for c in result.steps[name]:
            run += c.total_ms
            cum.append(run / 1e3)
        x, y = downsample(cum)
        ax.plot(x, y, label=f"{name} ({run / 1e3:,.2f} s)", lw=1.6, **_line_style(name, col))
    ax.set_xlabel("step")
    ax.set_ylabel("cumulative modeled time (s)")
    ax.set_title(_title(result, "Cumulative time"))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", frameon=False)
    return _save(fig, path)


def plot_hit_miss(result: SimResult, path: Path, served_tokens: Optional[int] = None) -> Path:
    """Left: tokens prefilled vs context tokens served without a prefill (when ``served_tokens`` is known).
    Right: operation counts per strategy (log scale; zero counts draw no bar)."""
    fig = _figure(12, 4.8)
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[1, 1.6])
    names = result.strategies
    tot = {n: result.totals(n) for n in names}
    x = np.arange(len(names))
    pre = np.array([tot[n]["prefill_tokens"] for n in names], dtype=float)
    ax1.bar(x, pre, color="#d62728", label="prefilled (incl. query and encodes)")
    if served_tokens is not None:
        reused = np.maximum(served_tokens - pre, 0)
        ax1.bar(x, reused, bottom=pre, color="#2ca02c", label="served without prefill (reused)")
        ax1.axhline(served_tokens, color="black", ls="--", lw=1, label=f"tokens served ({served_tokens:,})")
    if FLOOR in tot:  # the lower bound: never-seen tokens + queries
        ax1.axhline(tot[FLOOR]["prefill_tokens"], color="black", ls=":", lw=1.2,
                    label=f"floor: never-seen tokens + queries ({tot[FLOOR]['prefill_tokens']:,})")
    top = max([served_tokens or 0, *pre, 1])
    ax1.set_ylim(0, top * 1.35)  # room for the legend above the bars
    ax1.set_xticks(x, names, rotation=20, ha="right")
    ax1.set_ylabel("tokens")
    ax1.set_title("Tokens: prefilled vs reused")
    ax1.legend(loc="upper left", frameon=False, fontsize=8)
    ax1.yaxis.set_major_formatter(_thousands())

    col = _colors(COUNT_COLS)
    w = 0.8 / len(COUNT_COLS)
    for i, k in enumerate(COUNT_COLS):
        ax2.bar(x - 0.4 + (i + 0.5) * w, [tot[n][k] for n in names], w, label=k.replace("_", " "), color=col[k])
    if any(tot[n][k] > 0 for n in names for k in COUNT_COLS):
        ax2.set_yscale("log")
        top = max(tot[n][k] for n in names for k in COUNT_COLS)
        ax2.set_ylim(0.7, top * 1.6)  # a count of 1 still shows as a bar; the tallest is not clipped
        _plain_log_ticks(ax2.yaxis)
    ax2.set_xticks(x, names, rotation=20, ha="right")
    ax2.set_ylabel("count (log)")
    ax2.set_title("Operations per strategy")
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    fig.suptitle(_title(result, "Hit / miss breakdown"))
    return _save(fig, path)


def timeline_image(orders: Sequence[Sequence[ChunkRef]], width: int = 800, height: int = 420):
    """(image, distinct chunks): a ``min(rows, height) x min(steps, width)`` float array whose pixel holds the
    largest slot of any (chunk, step) cell binned into it, NaN where no chunk is held. Binning keeps a
    30k-chunk x 1k-step trace a small image whose every held chunk still shows.

        timeline_image([[A, B], [B, C]])[0]   # [[0, nan], [1, 0], [nan, 1]]
    """
    ids, cells = timeline(orders)
    n_t, n_r = max(len(orders), 1), max(len(ids), 1)
    w, h = min(n_t, width), min(n_r, height)
    img = np.full((h, w), np.nan)
    if cells:
        c = np.asarray(cells, dtype=np.int64)
        np.fmax.at(img, (c[:, 1] * h // n_r, c[:, 0] * w // n_t), c[:, 2].astype(float))
    return img, len(ids)


def plot_timeline(result: SimResult, orders: Sequence[Sequence[ChunkRef]], path: Path) -> Path:
    """Steps across, chunks down (by first appearance), each held chunk coloured by its slot in the window."""
    import matplotlib
    from matplotlib.colors import BoundaryNorm
    from matplotlib.ticker import MaxNLocator

    img, n_ids = timeline_image(orders)
    fig = _figure(10, 5.5)
    ax = fig.add_subplot()
    top = int(np.nanmax(img)) if np.isfinite(img).any() else 0
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    norm = BoundaryNorm([b - 0.5 for b in range(top + 2)], cmap.N) if top < 24 else None  # one colour per slot
    im = ax.imshow(np.ma.masked_invalid(img), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                   extent=(-0.5, len(orders) - 0.5, n_ids - 0.5, -0.5))  # first chunks at the top
    cb = fig.colorbar(im, ax=ax, label="slot in the window (0 = head)")
    cb.locator = MaxNLocator(integer=True)
    cb.update_ticks()
    ax.set_xlabel("step")
    ax.set_ylabel(f"chunk (by first appearance; {n_ids:,} distinct)")
    ax.set_title(_title(result, "Window timeline"))
    ax.grid(True, alpha=0.2)
    return _save(fig, path)


# ====================================================================== HTML
def _fmt_int(v: float) -> str:
    return f"{int(v):,}"


def summary_table_html(summary: dict) -> str:
    """An HTML table of the totals: time, time relative to recompute, radix and the floor, whether each strategy
    meets the target in force (when the floor and radix ran), counts, peak KV bytes."""
    tot = summary["strategies"]
    bases = [b for b in ("recompute", "radix", FLOOR) if b in tot and tot[b]["total_ms"] > 0]
    meets = summary.get("meets_target")
    tgt = [f"meets {summary['target']}"] if meets else []
    head = (["strategy", "total ms"] + [f"vs {b}" for b in bases] + tgt + [h for _, h in TABLE_COLS]
            + ["peak KV (MiB)"])
    rows = []
    for name, t in tot.items():
        cells = [f"<th>{html.escape(name)}</th>", f"<td>{t['total_ms']:,.1f}</td>"]
        cells += [f"<td>{t['total_ms'] / tot[b]['total_ms']:.3f}</td>" for b in bases]
        if meets:
            ok = meets.get(name)
            cells.append(f'<td class="{"yes" if ok else "no"}">{"yes" if ok else "no"}</td>')
        cells += [f"<td>{_fmt_int(t[k])}</td>" for k, _ in TABLE_COLS]
        cells.append(f"<td>{t['bytes_peak'] / 2**20:,.1f}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return ('<table id="summary"><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; max-width: 1250px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
p.meta { color: #555; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.9em; margin: 8px 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
thead th { background: #f0f0f0; } tbody th { text-align: left; background: #fafafa; }
figure { margin: 12px 0; } figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; border: 1px solid #eee; }
td.yes { color: #1a7f37; font-weight: 600; } td.no { color: #b3261e; }
"""

_CAPTIONS = {  # plot key: (heading, caption)
    "cost_per_step": ("Cost per step", "Modeled time of each step per strategy (log scale when they differ by over "
                                       "20x; long runs add a rolling mean)."),
    "cumulative_time": ("Cumulative time", "Running total of the modeled time; the legend gives each strategy's total. "
                                           "Dashed: the floor (each chunk prefilled once, at its first appearance, "
                                           "plus the queries), the lower bound of every reuse strategy."),
    "hit_miss": ("Hit / miss breakdown", "Tokens prefilled (including the query and canonical encodes) vs context "
                                         "tokens served from reused KV, and operation counts (log scale)."),
    "window_timeline": ("Window timeline", "Which chunks are in the window at each step (rows by first appearance), "
                                           "coloured by their slot."),
}


def render_html(summary: dict, images: dict[str, bytes]) -> str:
    """The report page: header, summary table, ratios, plots embedded as ``data:image/png;base64``."""
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>windowkit simulate: {e(summary['trace'])}</title><style>{_CSS}</style></head><body>",
             f"<h1>windowkit simulate: {e(summary['trace'])}</h1>",
             f'<p class="meta">{summary["steps"]:,} steps, cost profile <b>{e(summary["profile"])}</b>, '
             f"strategies: {e(', '.join(summary['strategies']))}</p>",
             "<h2>Totals</h2>", summary_table_html(summary)]
    if summary.get("target"):
        tot = summary["strategies"]
        fr = tot[FLOOR]["total_ms"] / tot["radix"]["total_ms"] if tot["radix"]["total_ms"] > 0 else float("nan")
        parts.append(f'<p id="target">Target in force: <b>{e(summary["target"])}</b> '
                     f'({summary["target_ms"]:,.1f} ms). The floor is {fr:.3f}x the prefix cache (radix); the target '
                     "is 0.6x radix unless the floor itself is above 0.6x radix, where it becomes within 1.15x of the "
                     "floor.</p>")
    if summary.get("ratios"):
        parts.append('<h2>Ratios (total modeled time)</h2><table id="ratios"><tbody>')
        parts += [f"<tr><th>{e(k)}</th><td>{v:.3f}</td></tr>" for k, v in summary["ratios"].items()]
        parts.append("</tbody></table>")
    for key in PLOTS:
        if key in images:
            b64 = base64.b64encode(images[key]).decode("ascii")
            head, cap = _CAPTIONS[key]
            parts.append(f'<h2>{e(head)}</h2><figure>'
                         f'<img alt="{e(key)}" src="data:image/png;base64,{b64}">'
                         f"<figcaption>{e(cap)}</figcaption></figure>")
    if summary.get("meta"):
        parts.append(f"<h2>Notes</h2><pre>{e(json.dumps(summary['meta'], indent=2))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ====================================================================== entry point
def write_report(result: SimResult, out_dir: Union[str, os.PathLike], trace: Optional[TraceLike] = None) -> dict[str, Path]:
    """Write ``summary.json``, the PNG plots and ``report.html`` into ``out_dir`` (created if needed).

    trace: the replayed Trace / list of Steps (or their resolved orders: lists of ChunkRef); only the first
    ``summary["steps"]`` are used. Without it (and without ``result.orders``, which a run may record) there
    is no window timeline, and without Steps no reused-token bar.

        paths = write_report(simulate(trace, "cpu-tiny"), "out", trace=trace)
        paths["html"]   # Path("out/report.html")
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_dict(result, trace)
    orders, queries = _orders(trace, summary["steps"], result)
    paths: dict[str, Path] = {"summary": out / "summary.json"}
    paths["summary"].write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if result.strategies:
        paths["cost_per_step"] = plot_cost_per_step(result, out / "cost_per_step.png")
        paths["cumulative_time"] = plot_cumulative(result, out / "cumulative_time.png")
        served = None
        if orders is not None and queries is not None:
            served = sum(c.tokens for ctx in orders for c in ctx) + sum(queries)
        paths["hit_miss"] = plot_hit_miss(result, out / "hit_miss.png", served)
    if orders is not None:
        paths["window_timeline"] = plot_timeline(result, orders, out / "window_timeline.png")
    images = {k: p.read_bytes() for k, p in paths.items() if k in PLOTS}
    paths["html"] = out / "report.html"
    paths["html"].write_text(render_html(summary, images), encoding="utf-8")
    return paths


__all__ = ["write_report", "summary_dict", "render_html", "summary_table_html", "downsample", "rolling_mean", "timeline", "timeline_image",
           "plot_cost_per_step", "plot_cumulative", "plot_hit_miss", "plot_timeline", "PLOTS"]
