"""The status page's HTML: pure functions from the API's own dicts to a page (no I/O).

``routes_page`` gathers the same dicts the read API answers (runs, steps, the resume answer,
health, conversions, jobs, nodes) and hands them here. Everything is server-rendered: no script,
no external resource (the page works with no internet), colours and hover texts in inline SVG,
and a ``<meta http-equiv="refresh">`` to follow the catalog. Every string from the catalog is
escaped with ``html.escape`` (run names are directory names, reasons quote file names: both are
chosen by whoever writes below the checkpoint root).
"""

from __future__ import annotations

import math
from datetime import datetime
from html import escape
from typing import Any, Sequence
from urllib.parse import quote

from ckptd.api import page_svg

_STATE_NAMES = {"pending": "verifying", "incomplete": "incomplete", "corrupt": "corrupt",
                "deleted": "deleted", "deleting": "deleting", "superseded": "superseded"}
_DEFAULT_REASONS = {"verifying": "verification has not finished", "incomplete": "not every rank's shard is present",
                    "corrupt": "a shard failed verification", "deleted": "a shard file is gone",
                    "deleting": "being deleted by retention", "superseded": "left by a save under an older layout",
                    "verified": "a breakpoint save: the resume answer offers trained saves only"}


def step_key(step: dict[str, Any]) -> int:
    """A step as the resume answer names it: its training (global) step, else the file name's."""
    return step["training_step"] if step.get("training_step") is not None else step["step"]


def step_views(steps: Sequence[dict[str, Any]], skipped: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's saves in training order, each with ``view_state`` (a key of ``page_svg.COLOURS``),
    ``view_reason`` and ``tiers``. ``steps``: ``GET /v1/runs/{run}/steps`` items (converted copies
    are left out: the conversions table shows them); ``skipped``: the resume answer's, whose
    reasons are the policy's own words for every step newer than the answer."""
    why = {s["step"]: s["reason"] for s in skipped}
    out = []
    for st in steps:
        if st.get("kind") == "converted":
            continue
        state, reason = _classify(st, why.get(step_key(st)))
        out.append(dict(st, label=step_key(st), view_state=state, view_reason=reason, tiers=st.get("tiers") or ["file"]))
    out.sort(key=lambda v: (v["epoch"], v["step"], v.get("incarnation") or 0, v.get("kind") != "superseded"))
    return out


def _classify(st: dict[str, Any], skipped_reason: str | None) -> tuple[str, str]:
    if st.get("kind") == "superseded" or st["state"] == "superseded":
        return "superseded", st.get("reason") or _DEFAULT_REASONS["superseded"]
    if st.get("marked_bad"):
        return "marked bad", skipped_reason or ("marked bad by an operator" + (f": {st['bad_reason']}" if st.get("bad_reason") else ""))
    if st["state"] == "verified":
        if st.get("kind") not in (None, "trained"):
            return "verified", _DEFAULT_REASONS["verified"]
        if skipped_reason:  # the answer passed over a verified step not marked bad: only health does
            return "unhealthy", skipped_reason
        if st.get("health_reason"):
            return "unhealthy", f"unhealthy: {st['health_reason']}"
        return "restorable", st.get("reason") or ""  # e.g. "layout unchecked: …"
    state = _STATE_NAMES.get(st["state"], st["state"])
    return state, skipped_reason or st.get("reason") or _DEFAULT_REASONS.get(state, "")


def rpo(answer: dict[str, Any] | None, views: Sequence[dict[str, Any]], newest_reported: int | None,
        now: datetime) -> dict[str, Any]:
    """The recovery point: the newest restorable step (the resume answer's), its age (since the
    catalog last recorded the step: its ``updated_at``), and how far training has gone since, in
    training steps (the newest save or health report) and in saves."""
    if answer is None:
        return {"step": None, "age_seconds": None, "steps_since": None, "saves_since": None}
    step = answer["step"]
    newest = max([v["label"] for v in views if v.get("kind") != "superseded"] + [newest_reported or 0, step])
    chosen = [v for v in views if v["label"] == step and v.get("kind") in (None, "trained")]
    at = _when(chosen[-1].get("updated_at")) if chosen else None
    return {"step": step, "age_seconds": max((now - at).total_seconds(), 0.0) if at else None,
            "steps_since": newest - step,
            "saves_since": len({v["label"] for v in views if v["label"] > step and v.get("kind") in (None, "trained")})}


def _when(iso: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(iso) if iso else None
    except ValueError:
        return None


def age(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size * (1 if unit == "min" else 1.5):
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def rpo_text(r: dict[str, Any]) -> str:
    if r["step"] is None:
        return "no restorable step"
    return (f"step {r['step']}, {age(r['age_seconds'])} old; {r['steps_since']} training steps "
            f"and {r['saves_since']} saves since")


def run_tiers(views: Sequence[dict[str, Any]]) -> list[str]:
    tiers = sorted({t for v in views for t in v["tiers"]})
    return tiers or ["file"]


# --- whole pages ---------------------------------------------------------------------------------


def overview_page(runs: Sequence[dict[str, Any]], nodes: Sequence[dict[str, Any]], jobs: Sequence[dict[str, Any]],
                  now: datetime, refresh: int) -> str:
    """``/``: one row per run (``runs``: dicts with ``run`` (a ``RunOut``), ``views``, ``rpo``),
    the nodes, and the jobs not finished."""
    rows = []
    for r in runs:
        run, views, point = r["run"], r["views"], r["rpo"]
        name = escape(run["name"])
        link = f'<a href="/runs/{quote(run["name"], safe="")}">{name}</a>' if r.get("linkable", True) else name
        counts = ", ".join(f"{escape(str(k))} {int(v)}" for k, v in sorted((run.get("steps") or {}).items()))
        rows.append(f'<tr class="run" data-run="{name}"><td>{link}</td>'
                    f'<td class="rpo{" none" if point["step"] is None else ""}">{escape(rpo_text(point))}</td>'
                    f'<td>{escape(str(run.get("layout")))}</td><td>{_opt(run.get("world_size"))}</td>'
                    f'<td>{escape(", ".join(run_tiers(views)))}</td><td>{counts}</td></tr>')
    table = (_table(["run", "recovery point (RPO)", "layout", "world size", "tiers", "steps by state"], rows)
             if rows else '<p class="empty">no runs catalogued yet</p>')
    active = [j for j in jobs if j.get("state") not in ("done", "failed")]
    body = (f"<h1>ckptd status</h1><p class=\"meta\">{escape(now.isoformat(timespec='seconds'))} · "
            f"refreshes every {refresh} s</p>" if refresh else "<h1>ckptd status</h1>")
    body += f"<h2>Runs</h2>{table}<h2>Nodes</h2>{nodes_table(nodes)}<h2>Jobs in progress</h2>{jobs_table(active)}"
    return _document("ckptd status", body, refresh)


def run_page(run: dict[str, Any], views: Sequence[dict[str, Any]], point: dict[str, Any],
             health: Sequence[dict[str, Any]], conversions: Sequence[dict[str, Any]], jobs: Sequence[dict[str, Any]],
             nodes: Sequence[dict[str, Any]], now: datetime, refresh: int) -> str:
    """``/runs/<run>``: the RPO, the run's facts, the timeline, the health curves, every step with
    its state and reason, the conversions with progress, the nodes."""
    name = escape(run["name"])
    facts = _table(["layout", "world size", "tiers", "path", "shards per node"], [
        f'<tr><td>{escape(str(run.get("layout")))}</td><td>{_opt(run.get("world_size"))}</td>'
        f'<td>{escape(", ".join(run_tiers(views)))}</td><td>{escape(str(run.get("path") or ""))}</td>'
        f'<td>{escape(", ".join(f"{n}: {c}" for n, c in (run.get("nodes") or {}).items()))}</td></tr>'])
    span = _step_range(views, health)
    marks = [(v["label"], v["view_state"], v["view_reason"]) for v in views if v["view_state"] in ("unhealthy", "marked bad")]
    curves = (page_svg.curve("loss", [(h["step"], h["loss"]) for h in health], marks, span)
              + page_svg.curve("grad norm", [(h["step"], h["grad_norm"]) for h in health], marks, span)
              if health else '<p class="empty">no training health reported</p>')
    body = (f'<p><a href="/">all runs</a></p><h1>run {name}</h1>'
            + (f"<p class=\"meta\">{escape(now.isoformat(timespec='seconds'))} · refreshes every {refresh} s</p>"
               if refresh else "")
            + f'<p class="rpo{" none" if point["step"] is None else ""}" id="rpo">Recovery point: '
              f'{escape(rpo_text(point))}</p>{facts}'
            + f"<h2>Timeline</h2>{page_svg.timeline(views)}<p class=\"legend\">{page_svg.legend()}</p>"
            + f"<h2>Training health</h2>{curves}"
            + f"<h2>Steps</h2>{steps_table(views)}"
            + f"<h2>Conversions</h2>{conversions_table(conversions, jobs)}"
            + f"<h2>Nodes</h2>{nodes_table(nodes)}")
    return _document(f"ckptd · {run['name']}", body, refresh)


def missing_page(message: str) -> str:
    return _document("ckptd: not found", f'<p><a href="/">all runs</a></p><h1>not found</h1><p>{escape(message)}</p>', 0)


# --- tables --------------------------------------------------------------------------------------


def steps_table(views: Sequence[dict[str, Any]]) -> str:
    if not views:
        return '<p class="empty">no steps catalogued yet</p>'
    rows = []
    for v in reversed(views):  # newest first, as the API lists them
        state = v["view_state"]
        rows.append(
            f'<tr class="step" data-step="{escape(str(v["label"]))}" data-state="{escape(state.replace(" ", "-"))}">'
            f'<td>{escape(str(v["label"]))}</td><td>{escape(str(v.get("kind") or ""))}</td>'
            f'<td>{_opt(v.get("incarnation"))}</td>'
            f'<td><span class="dot" style="background:{page_svg.COLOURS.get(state, "#000")}"></span>{escape(state)}</td>'
            f'<td class="reason">{escape(v["view_reason"] or "")}</td><td>{escape(", ".join(v["tiers"]))}</td>'
            f'<td>{_opt(v.get("expected_ranks"))}</td><td>{"pinned" if v.get("pinned") else ""}</td>'
            f'<td class="when">{escape(_short_time(v.get("updated_at")))}</td></tr>')
    return _table(["step", "kind", "incarnation", "state", "reason", "tiers", "ranks", "", "last change"], rows)


def conversions_table(conversions: Sequence[dict[str, Any]], jobs: Sequence[dict[str, Any]]) -> str:
    if not conversions:
        return '<p class="empty">no conversions</p>'
    job_of = {j["conversion_id"]: j for j in jobs if j.get("conversion_id") is not None}
    rows = []
    for c in conversions:
        job = job_of.get(c["id"])
        fraction = 1.0 if c["state"] == "done" else (job or {}).get("progress") or 0.0
        rows.append(f'<tr class="conversion"><td>{int(c["id"])}</td><td>{escape(str(c["state"]))}</td>'
                    f'<td>{_opt(c.get("source_step"))}</td><td>{escape(_short(c.get("target_strategy_hash")))}</td>'
                    f'<td>{_bar(fraction)}</td><td>{escape(str(c.get("out_dir") or ""))}</td>'
                    f'<td class="reason">{escape(str(c.get("error") or ""))}</td></tr>')
    return _table(["id", "state", "source step", "target layout", "progress", "output", "error"], rows)


def jobs_table(jobs: Sequence[dict[str, Any]]) -> str:
    if not jobs:
        return '<p class="empty">none</p>'
    rows = [f'<tr class="job"><td>{int(j["id"])}</td><td>{escape(str(j["kind"]))}</td><td>{escape(str(j["state"]))}</td>'
            f'<td>{_bar(j.get("progress") or 0.0)}</td><td>{int(j.get("done") or 0)} / {_opt(j.get("total"))}</td>'
            f'<td class="reason">{escape(str(j.get("error") or ""))}</td></tr>' for j in jobs]
    return _table(["job", "kind", "state", "progress", "done", "error"], rows)


def nodes_table(nodes: Sequence[dict[str, Any]]) -> str:
    if not nodes:
        return '<p class="empty">no nodes registered</p>'
    rows = []
    for n in nodes:
        live = "live" if n.get("reachable") else "silent"
        shards = ", ".join(f"{escape(str(k))} {int(v)}" for k, v in sorted((n.get("shards") or {}).items()))
        rows.append(f'<tr class="node" data-live="{live}"><td>{escape(str(n["name"]))}</td>'
                    f'<td class="{live}">{live}</td><td>{age(n.get("seconds_since_heartbeat"))} ago</td>'
                    f'<td>{shards}</td></tr>')
    return _table(["node", "liveness", "last heartbeat", "shards by state"], rows)


def _table(head: Sequence[str], rows: Sequence[str]) -> str:
    cells = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _bar(fraction: float) -> str:
    pct = min(max(float(fraction), 0.0), 1.0) * 100 if math.isfinite(float(fraction)) else 0.0
    return (f'<span class="bar"><span style="width:{pct:.0f}%"></span></span> {pct:.0f}%')


def _short(h: str | None) -> str:
    return "" if not h else (h[:19] + "…" if len(h) > 20 else h)


def _short_time(iso: str | None) -> str:
    at = _when(iso)
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else (iso or "")


def _opt(v: Any) -> str:
    return "" if v is None else escape(str(v))


def _step_range(views: Sequence[dict[str, Any]], health: Sequence[dict[str, Any]]) -> tuple[int, int]:
    xs = [v["label"] for v in views] + [h["step"] for h in health]
    return (min(xs), max(xs)) if xs else (0, 1)


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#202124;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:22px 0 8px;border-bottom:1px solid #dadce0}
table{border-collapse:collapse;margin:4px 0}th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;
vertical-align:top}th{background:#f1f3f4}td.reason{max-width:560px;word-break:break-word;color:#3c4043}
.rpo{font-size:16px;font-weight:600;color:#1e8e3e}.rpo.none{color:#d93025}td.rpo{font-size:14px}
.meta{color:#5f6368;margin:0 0 12px}.empty{color:#5f6368;font-style:italic}
.dot{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
.key{margin-right:14px;white-space:nowrap}td.when,tr.step td:nth-child(4){white-space:nowrap}.live{color:#1e8e3e}.silent{color:#d93025;font-weight:600}
.bar{display:inline-block;width:120px;height:10px;background:#e8eaed;vertical-align:middle}
.bar span{display:block;height:10px;background:#1a73e8}svg.curve{display:block;margin:6px 0}
"""


def _document(title: str, body: str, refresh: int) -> str:
    meta = f'<meta http-equiv="refresh" content="{int(refresh)}">' if refresh else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}'
            f'<meta name="viewport" content="width=device-width"><title>{escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body>{body}</body></html>")
