"""The status page (``/``, ``/runs/<run>``): its pure renderer over tables of plain dicts, and the
page of a live ``ckptd serve`` loaded in a real browser (Debian's ``chromium``, headless): the DOM
it builds and a screenshot it paints."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser

import pytest

from ckptd.api import page, page_svg

NOW = datetime(2025, 1, 2, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def sqlite_url(tmp_path):
    from tests.daemon_helpers import migrated_sqlite

    return migrated_sqlite(tmp_path / "catalog.db")


def step(n: int, state: str = "verified", **over) -> dict:
    """A ``GET /v1/runs/{run}/steps`` item (the keys the page reads)."""
    doc = {"step": n, "epoch": 1, "training_step": n, "incarnation": 0, "kind": "trained", "state": state,
           "reason": None, "health_reason": None, "marked_bad": False, "bad_reason": None, "pinned": False,
           "expected_ranks": 2, "updated_at": (NOW - timedelta(minutes=5)).isoformat()}
    return doc | over


# --- what each save is shown as --------------------------------------------------------------------

CASES = [
    # (step dict, the resume answer's skipped reason, shown state, reason shown)
    (step(1), None, "restorable", ""),
    (step(1, reason="layout unchecked: strategy.ckpt does not parse"), None, "restorable", "layout unchecked"),
    (step(1, "pending"), None, "verifying", "verification has not finished"),
    (step(1, "pending"), "pending: verification has not finished", "verifying", "pending: verification"),
    (step(1, "incomplete", reason="rank 1: net-1_1.ckpt missing"), None, "incomplete", "rank 1: net-1_1.ckpt missing"),
    (step(1, "incomplete"), None, "incomplete", "not every rank"),
    (step(1, "corrupt", reason="rank 0: CRC mismatch"), "corrupt: rank 0: CRC mismatch", "corrupt", "corrupt: rank 0: CRC"),
    (step(1, "corrupt", reason="rank 0: CRC mismatch"), None, "corrupt", "rank 0: CRC mismatch"),
    (step(1, marked_bad=True, bad_reason="data bug"), None, "marked bad", "marked bad by an operator: data bug"),
    (step(1, "corrupt", marked_bad=True), None, "marked bad", "marked bad by an operator"),
    (step(1), "unhealthy: loss is nan at step 1", "unhealthy", "loss is nan"),
    (step(1, health_reason="is_health 1 in health_ckpts.json"), None, "unhealthy", "is_health 1"),
    (step(1, "superseded", kind="superseded", reason="saved again under tp=4"), None, "superseded", "tp=4"),
    (step(1, kind="breakpoint"), None, "verified", "breakpoint"),
    (step(1, "deleted"), "deleted: a shard file is gone", "deleted", "a shard file is gone"),
    (step(1, "deleting"), None, "deleting", "retention"),
]


@pytest.mark.parametrize("doc, skipped, state, reason", CASES)
def test_each_save_is_shown_with_its_state_and_reason(doc, skipped, state, reason):
    (view,) = page.step_views([doc], [{"step": 1, "reason": skipped}] if skipped else [])
    assert view["view_state"] == state and reason in view["view_reason"], view
    assert state in page_svg.COLOURS
    html = page.steps_table([view])
    assert f'data-state="{state.replace(" ", "-")}"' in html and (reason == "" or reason in html)


def test_views_are_in_training_order_converted_copies_left_out_and_tiers_default_to_file():
    views = page.step_views([step(300, tiers=["file", "memory"]), step(200, kind="converted"), step(100)], [])
    assert [v["label"] for v in views] == [100, 300]
    assert [v["tiers"] for v in views] == [["file"], ["file", "memory"]]
    assert page.run_tiers(views) == ["file", "memory"] and page.run_tiers([]) == ["file"]


def test_the_recovery_point_counts_training_steps_and_saves_since_the_answer():
    views = page.step_views([step(100), step(200), step(300, "corrupt"), step(400, "incomplete")], [])
    point = page.rpo({"step": 200}, views, newest_reported=450, now=NOW)
    assert point == {"step": 200, "age_seconds": 300.0, "steps_since": 250, "saves_since": 2}
    assert page.rpo_text(point) == "step 200, 5.0 min old; 250 training steps and 2 saves since"
    assert page.rpo_text(page.rpo(None, views, None, NOW)) == "no restorable step"
    assert [page.age(s) for s in (None, 5, 120, 7200, 3 * 86400)] == ["unknown", "5 s", "2.0 min", "2.0 h", "3.0 d"]


class _Dom(HTMLParser):
    """Elements by tag and the page's text (what a browser shows), as the stdlib parses them."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


EVIL = '<script>alert(1)</script><img src=x onerror="alert(2)">&amp;'


def test_every_catalog_string_is_escaped():
    run = {"name": EVIL, "layout": "native", "world_size": 2, "path": f"/ckpt/{EVIL}", "steps": {EVIL: 1},
           "nodes": {EVIL: 2}}
    views = page.step_views([step(1, "corrupt", reason=f"rank 0: {EVIL}.ckpt is a FIFO", tiers=[EVIL]),
                             step(2, marked_bad=True, bad_reason=EVIL)], [])
    health = [{"step": 1, "loss": 1.0, "grad_norm": float("nan"), "overflow": False},
              {"step": 2, "loss": 0.5, "grad_norm": 1.0, "overflow": False}]
    conv = [{"id": 1, "state": "failed", "source_step": 1, "target_strategy_hash": EVIL, "out_dir": EVIL, "error": EVIL}]
    jobs = [{"id": 3, "kind": EVIL, "state": "running", "progress": 0.5, "done": 1, "total": 2, "error": EVIL,
             "conversion_id": 1}]
    nodes = [{"name": EVIL, "reachable": True, "seconds_since_heartbeat": 1.0, "shards": {EVIL: 1}}]
    point = page.rpo(None, views, None, NOW)
    pages = [page.run_page(run, views, point, health, conv, jobs, nodes, NOW, 10),
             page.overview_page([{"run": run, "views": views, "rpo": point, "linkable": False}], nodes, jobs, NOW, 10),
             page.missing_page(f"no run named {EVIL!r}")]
    for html in pages:
        dom = _Dom(html)
        assert "script" not in dom.tags and "img" not in dom.tags, dom.tags
        assert EVIL in "".join(dom.text) or EVIL[:20] in "".join(dom.text)
    run_dom = "".join(_Dom(pages[0]).text)
    assert f"rank 0: {EVIL}.ckpt is a FIFO" in run_dom and f"marked bad by an operator: {EVIL}" in run_dom
    assert '<meta http-equiv="refresh" content="10">' in pages[0]


def test_an_empty_run_and_an_empty_catalog_render():
    run = {"name": "run1", "layout": "native", "world_size": None, "path": "/ckpt/run1", "steps": {}, "nodes": {}}
    html = page.run_page(run, [], page.rpo(None, [], None, NOW), [], [], [], [], NOW, 0)
    text = "".join(_Dom(html).text)
    assert "no restorable step" in text and "no steps catalogued yet" in text and "no training health reported" in text
    assert "no conversions" in text and "no nodes registered" in text and "http-equiv" not in html
    text = "".join(_Dom(page.overview_page([], [], [], NOW, 5)).text)
    assert "no runs catalogued yet" in text and "refreshes every 5 s" in text


def test_the_health_curve_breaks_at_non_finite_values_and_keeps_spikes_when_thinned():
    svg = page_svg.curve("loss", [(1, 2.0), (2, 1.5), (3, float("nan")), (4, 1.0), (5, 0.9)],
                         [(4, "unhealthy", "unhealthy: loss is nan at step 3")], (1, 5))
    assert svg.count("<polyline") == 2 and "loss is nan at step 3" in svg and svg.count("<line") == 1
    points = [(i, 1.0) for i in range(10_000)]
    points[7777] = (7777, 50.0)
    thinned = page_svg.thin(points)
    assert len(thinned) <= page_svg.MAX_POINTS and (7777, 50.0) in thinned
    assert "no grad norm reported" in page_svg.curve("grad norm", [(1, None)], [], (0, 1))
    # 20,000 steps, every other one a loss-scale overflow: one marker per few pixels, not 10,000
    flaky = [(i, float("inf") if i % 2 else 1.0 + i * 1e-5) for i in range(20_000)]
    svg = page_svg.curve("loss", flaky, [], (0, 19_999))
    markers = svg.count('fill="#d93025"')
    assert 0 < markers <= 1200 // page_svg.BAD_MARK_PX + 1 and "not finite at" in svg and len(svg) < 400_000, \
        (markers, len(svg))


# --- the page of a live server, in a real browser ----------------------------------------------------


def _chromium() -> str:
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but chromium is not installed: .ci/run installs it (apt-get install chromium)")
        pytest.skip("SKIPPED LOUDLY: Debian's chromium is not installed (apt-get install chromium); "
                    "the status page was not checked in a real browser")
    return exe


def _browser(exe: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def png_colours(path) -> set[tuple[int, ...]]:
    """The distinct pixel values of an 8-bit RGB/RGBA PNG (decoded with zlib: filters undone)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = header
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, header
    bpp = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    prev, colours, i = bytearray(stride), set(), 0
    for _ in range(height):
        kind, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            if kind == 1:
                line[x] = (line[x] + a) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + b) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        colours.update(bytes(line[x:x + bpp]) for x in range(0, stride, bpp * 4))  # every 4th pixel
        prev = line
    return colours


class _Rows(HTMLParser):
    """``<tr class="step">`` rows of a dumped DOM: (data-step, data-state, the row's text)."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[tuple[str, str, str]] = []
        self._row: list | None = None
        self.rpo = ""
        self._in_rpo = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "step":
            self._row = [a["data-step"], a["data-state"], ""]
        if a.get("id") == "rpo":
            self._in_rpo = True

    def handle_endtag(self, tag):
        if tag == "tr" and self._row is not None:
            self.rows.append(tuple(self._row))
            self._row = None
        if tag == "p":
            self._in_rpo = False

    def handle_data(self, data):
        if self._row is not None:
            self._row[2] += data + " "
        if self._in_rpo:
            self.rpo += data


def test_the_page_of_a_live_server_in_chromium(ms, root, tmp_path, sqlite_url):
    from tests.api_helpers import serve_process, stop_process
    from tests.daemon_helpers import save_shard, wait_for, write_tp_strategy

    exe = _chromium()
    write_tp_strategy(root / "run1")
    for s in (100, 200, 300, 400, 500):
        for rank in range(2):
            save_shard(ms, root, "run1", rank, s)
    save_shard(ms, root, "run1", 0, 600)  # rank 1 never saved step 600: incomplete
    victim = root / "run1" / "rank_1" / "net-1_500.ckpt"  # one bit of step 500 rots before ckptd reads it
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    log = tmp_path / "serve.log"
    # no tokens: a browser sends no bearer header (serve allows that on loopback only); retention off
    proc, client = serve_process(root, sqlite_url, log, CKPTD_GC_KEEP_LAST="0")
    try:
        def states():
            try:
                r = client.get("/v1/runs/run1/steps")
            except Exception:  # noqa: BLE001 - not up yet
                return None
            got = {s["step"]: s["state"] for s in r.json()} if r.status_code == 200 else {}
            return got if got == {100: "verified", 200: "verified", 300: "verified", 400: "verified",
                                  500: "corrupt", 600: "incomplete"} else None

        wait_for(states, 120, what=f"the run judged; log: {log}")
        evil = "data bug in <b>shard</b> & friends"
        assert client.post("/v1/runs/run1/steps/300/mark-bad", json={"reason": evil}).status_code == 200
        for s in range(10, 390, 10):  # a loss that falls, with a bump, then a NaN at step 390
            loss, gn = 3.0 * 0.996 ** s + (0.4 if 240 <= s <= 260 else 0.0), 8.0 * 0.995 ** s + (s % 30) / 30
            assert client.post("/v1/runs/run1/health", json={"step": s, "loss": loss, "grad_norm": gn}).status_code == 204
        r = client.post("/v1/runs/run1/health", content=b'{"step": 390, "loss": NaN, "grad_norm": 80.0}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 204  # step 400 and later: unhealthy
        assert client.get("/v1/runs/run1/resume", params={"lease": "false"}).json()["step"] == 200
        url = client.base_url
        assert client.get("/runs/run1").headers["content-type"].startswith("text/html")

        dom = _browser(exe, tmp_path, "--timeout=20000", "--dump-dom", f"{url}/runs/run1")
        assert dom.returncode == 0 and "<table" in dom.stdout, dom.stderr[-2000:]
        parsed = _Rows(dom.stdout)
        by_step = {int(n): (state, text) for n, state, text in parsed.rows}
        assert {n: st for n, (st, _) in by_step.items()} == {100: "restorable", 200: "restorable", 300: "marked-bad",
                                                           400: "unhealthy", 500: "corrupt", 600: "incomplete"}
        assert f"marked bad by an operator: {evil}" in by_step[300][1]  # escaped: text, not markup
        assert "<b>shard</b>" not in dom.stdout and "&lt;b&gt;shard&lt;/b&gt;" in dom.stdout
        assert "loss is nan at step 390" in by_step[400][1]
        assert "corrupt:" in by_step[500][1] and "rank 1" in by_step[500][1], by_step[500]
        assert "incomplete:" in by_step[600][1] or "rank" in by_step[600][1], by_step[600]
        assert parsed.rpo.startswith("Recovery point: step 200, ") and "400 training steps and 4 saves since" in parsed.rpo
        assert '<meta http-equiv="refresh" content="10">' in dom.stdout and "<polyline" in dom.stdout

        overview = _browser(exe, tmp_path, "--timeout=20000", "--dump-dom", f"{url}/")
        assert 'href="/runs/run1"' in overview.stdout and "step 200, " in overview.stdout, overview.stderr[-2000:]
        assert "live" in overview.stdout  # this node, alive

        shot = tmp_path / "status-page.png"
        out = _browser(exe, tmp_path, "--timeout=20000", "--hide-scrollbars", f"--screenshot={shot}",
                       "--window-size=1280,2000", f"{url}/runs/run1")
        assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
        colours = png_colours(shot)
        assert len(colours) > 20, f"the screenshot looks blank: {len(colours)} colours"
        painted = {bytes.fromhex(c[1:]) for c in (page_svg.COLOURS[s] for s in ("restorable", "corrupt", "marked bad"))}
        assert painted <= {c[:3] for c in colours}, "the timeline's state colours are not on the screenshot"
        if os.environ.get("CKPTD_SAVE_SCREENSHOT"):  # how docs/status-page.png is made
            shutil.copy(shot, os.environ["CKPTD_SAVE_SCREENSHOT"])
    finally:
        stop_process(proc)
        client.close()


def test_the_page_has_the_read_apis_access_rule(root, catalog_url):
    from ckptd.settings import Settings
    from tests.api_helpers import Server

    settings = Settings(root=root, db=catalog_url, tokens={"r-token": "read"})
    with Server(settings) as srv:
        assert srv.client().get("/").status_code == 401
        assert srv.client("wrong").get("/runs/run1").status_code == 401
        r = srv.client("r-token").get("/")
        assert r.status_code == 200 and "no runs catalogued yet" in r.text
        assert "script-src" not in r.headers["content-security-policy"] and "default-src 'none'" in r.headers["content-security-policy"]
        r = srv.client("r-token").get("/runs/nope")
        assert r.status_code == 404 and "no run named &#x27;nope&#x27;" in r.text
        assert srv.client("r-token").get("/runs/..bad").status_code == 400
        assert srv.client("r-token").get("/", params={"refersh": 5}).status_code == 422
        assert '<meta http-equiv="refresh" content="30">' in srv.client("r-token").get("/", params={"refresh": 30}).text
        paths = srv.client().get("/openapi.json").json()["paths"]
        assert "/" not in paths and "/runs/{run}" not in paths


def test_conversions_show_their_jobs_progress_and_the_overview_only_unfinished_jobs():
    conv = [{"id": 7, "state": "running", "source_step": 200, "target_strategy_hash": "sha256:" + "ab" * 32,
             "out_dir": "/ckpt/run1/converted/x", "error": None},
            {"id": 8, "state": "done", "source_step": 100, "target_strategy_hash": None, "out_dir": None, "error": None}]
    jobs = [{"id": 3, "kind": "convert", "state": "running", "progress": 0.25, "done": 1, "total": 4, "conversion_id": 7},
            {"id": 2, "kind": "verify", "state": "done", "progress": 1.0, "done": 2, "total": 2}]
    text = "".join(_Dom(page.conversions_table(conv, jobs)).text)
    assert "running" in text and "25%" in text and "100%" in text and "sha256:abababababab…" in text
    overview = page.overview_page([], [{"name": "n2", "reachable": False, "seconds_since_heartbeat": 400.0, "shards": {}}],
                                  jobs, NOW, 10)
    rows = "".join(_Dom(overview).text)
    assert "convert" in rows and "verify" not in rows and "silent" in rows and "6.7 min ago" in rows
