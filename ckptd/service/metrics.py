"""ckptd's Prometheus metrics (``GET /metrics``): one ``CollectorRegistry`` per daemon.

The numbers come from three places, each read or observed where it lives:

* the catalog (shards per state and per node, node liveness, each run's recovery point, running
  conversions): computed at scrape time by :class:`CatalogCollector`, in one session, from the
  read functions the API and the CLI call (``ckptd.catalog.reads``, ``ckptd.catalog.nodes``,
  ``ckptd.service.catalog``, ``ckptd.service.jobs``). Nothing is cached: a scrape sees what the
  ``/v1`` routes would answer at that moment, on every daemon sharing the catalog alike.
* this process's tallies (shards verified, bytes, rescans, lost events, conversions): counted
  where the work happens (the verifier's counters also make ``ckptd verify``'s summary) and read
  at scrape time through :class:`Tallies` (``Daemon.tallies``), exported as counters.
* latencies, observed as they happen: histograms on the registry, owned by :class:`DaemonMetrics`
  (the daemon's); the verifier calls :meth:`DaemonMetrics.shards_verified`, the resume route
  :meth:`DaemonMetrics.resume_answered`.

No module-level state: each daemon has its own registry (tests run several in one process), and
prometheus_client is imported only when a daemon makes its metrics (``ckptd --help`` and the
catalog commands never load it).

Label cardinality is bounded by what the operator has, never by what the training writes: labels
name runs, nodes, shard states, running conversion jobs, and the resume route's path and status
code; never a step, a shard or a file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ckptd.catalog import jobrows, nodes, reads
from ckptd.catalog.models import as_utc
from ckptd.service import catalog, jobs

#: what ``generate_latest`` writes (prometheus_client's newest default names a later version)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# from a small shard verified at once to a burst queued behind minutes of reading
_RENAME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# a cached answer takes ~0.1 ms, a computed one milliseconds (bench/RESULTS.md, resume oracle)
_RESUME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class Tallies:
    """This process's counts since start (``Daemon.tallies``): read at every scrape."""

    shards_verified: int
    verification_failures: int
    verified_bytes: int
    verification_seconds: float
    rescans: int
    file_events_lost: int
    conversion_bytes: int
    conversion_seconds: float
    memory_snapshots: int = 0  # memory tier: snapshots catalogued
    memory_persisted: int = 0  # memory tier: snapshots written as files
    memory_bytes_hashed: int = 0  # memory tier: slot bytes read (each snapshot once, plus scrubs)


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds, 1) if seconds > 0 else 0.0


class TallyCollector:
    """This process's counters and the throughputs derived from them (``node``: this daemon's
    node name, on the throughput gauges as before)."""

    def __init__(self, tallies: Callable[[], Tallies], node: str, started: float) -> None:
        self._tallies, self._node, self._started = tallies, node, started

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        t = self._tallies()
        yield CounterMetricFamily("ckptd_shards_verified", "Shards verified since start.", t.shards_verified)
        yield CounterMetricFamily("ckptd_verification_failures", "Shards found corrupt since start.",
                                  t.verification_failures)
        yield CounterMetricFamily("ckptd_verified_bytes", "Bytes verified since start.", t.verified_bytes)
        yield CounterMetricFamily("ckptd_rescans", "Full rescans of the checkpoint root since start.", t.rescans)
        yield CounterMetricFamily("ckptd_file_events_lost", "Times file events may have been lost (queue overflow, "
                                  "watch limit); each triggers a rescan.", t.file_events_lost)
        yield CounterMetricFamily("ckptd_verification_seconds", "Time spent verifying shards.",
                                  round(t.verification_seconds, 6))
        rate = GaugeMetricFamily("ckptd_verification_bytes_per_second", "Verification throughput of this node since "
                                 "start: bytes verified per second spent verifying (per worker; 0 before the first "
                                 "shard).", labels=["node"])
        rate.add_metric([self._node], _rate(t.verified_bytes, t.verification_seconds))
        yield rate
        yield CounterMetricFamily("ckptd_conversion_bytes", "Bytes written (and verified) by conversions on this node "
                                  "since start.", t.conversion_bytes)
        yield CounterMetricFamily("ckptd_conversion_seconds", "Wall time of conversions on this node since start.",
                                  round(t.conversion_seconds, 6))
        rate = GaugeMetricFamily("ckptd_conversion_bytes_per_second", "Conversion throughput of this node since start "
                                 "(0 before the first).", labels=["node"])
        rate.add_metric([self._node], _rate(t.conversion_bytes, t.conversion_seconds))
        yield rate
        yield CounterMetricFamily("ckptd_memory_snapshots", "Memory tier: snapshots this node catalogued since start.",
                                  t.memory_snapshots)
        yield CounterMetricFamily("ckptd_memory_persisted", "Memory tier: snapshots this node wrote as checkpoint "
                                  "files since start.", t.memory_persisted)
        yield CounterMetricFamily("ckptd_memory_bytes_read", "Memory tier: slot bytes this node read (hashing, "
                                  "persisting, scrubbing) since start.", t.memory_bytes_hashed)
        yield GaugeMetricFamily("ckptd_up_seconds", "Seconds since this daemon started.",
                                round(time.monotonic() - self._started, 3))


class CatalogCollector:
    """The catalog's state at scrape time, as the API reads it (one session per scrape)."""

    def __init__(self, sessions: sessionmaker[Session], node_timeout: float) -> None:
        self._sessions, self._node_timeout = sessions, node_timeout

    def collect(self) -> Iterator[Any]:
        with self._sessions() as s:  # every family built before the first is yielded: no session held by a consumer
            families = [self._shards(s), *self._nodes(s), *self._recovery_points(s), self._conversions(s)]
        yield from families

    @staticmethod
    def _shards(s: Session) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("ckptd_shards", "Shards in the catalog by state.", labels=["state"])
        for state, n in reads.shard_state_counts(s).items():
            family.add_metric([state], n)
        return family

    def _nodes(self, s: Session) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        shards = GaugeMetricFamily("ckptd_node_shards", "Shards in the catalog by owning node and state.",
                                   labels=["node", "state"])
        for node, states in sorted(nodes.shard_counts(s).items(), key=lambda kv: str(kv[0])):
            for state, n in sorted(states.items()):
                shards.add_metric(["" if node is None else node, state], n)  # "": rows from before nodes (0006)
        age = GaugeMetricFamily("ckptd_node_heartbeat_age_seconds",
                                "Seconds since each node's daemon last sent a heartbeat.", labels=["node"])
        alive = GaugeMetricFamily("ckptd_node_reachable", "Node liveness: 1 if the node's heartbeat is within "
                                  "node_timeout (alive), 0 if it is unreachable.", labels=["node"])
        for st in sorted(nodes.statuses(s, self._node_timeout).values(), key=lambda x: x.name):
            age.add_metric([st.name], round(st.seconds_since_heartbeat, 3))
            alive.add_metric([st.name], int(st.reachable))
        return [shards, age, alive]

    @staticmethod
    def _recovery_points(s: Session) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        seconds = GaugeMetricFamily("ckptd_recovery_point_seconds", "Seconds since each run's newest restorable step "
                                    "was saved (RPO: the training time a restart now would lose; a resume lease or a "
                                    "re-verification does not reset it).", labels=["run"])
        now = datetime.now(timezone.utc)
        steps = GaugeMetricFamily(
            "ckptd_recovery_point_steps",
            "RPO in training steps, per run: the newest step ckptd has seen saved (in any state: still being "
            "verified, incomplete, corrupt, marked bad) minus the newest restorable step (the resume oracle's "
            "latest_restorable_step of GET /v1/runs): the steps a restart now would train again. 0 when the newest "
            "save is restorable; absent for a run with no restorable step, or while the newest save's global step "
            "is not known (a later-epoch MindFormers save before any of its shards verified).",
            labels=["run"])
        # not catalog.list_runs: its shards per node scan every shard row of every run (seconds on a
        # million-row PostgreSQL catalog; bench/metrics_scrape.py)
        for run in reads.runs(s):
            latest = catalog.latest_restorable(s, run.id)
            if latest is None:
                continue
            seconds.add_metric([run.name], round((now - as_utc(latest[1])).total_seconds(), 3))
            newest = catalog.list_steps(s, run.name, limit=1)  # newest first, as GET /v1/runs/{run}/steps
            if newest and newest[0]["training_step"] is not None:
                steps.add_metric([run.name], max(0, newest[0]["training_step"] - latest[0]))
        return [seconds, steps]

    @staticmethod
    def _conversions(s: Session) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "ckptd_conversion_progress", "Fraction done (0 to 1) of each running conversion job, by run and job id "
            "(as GET /v1/jobs/{id} reports it); only running jobs have a series: it ends with its job.",
            labels=["run", "job"])
        for job, run_name in jobrows.jobs_in(s, "convert", ("running",)):
            family.add_metric(["" if run_name is None else run_name, str(job.id)], jobs.job_dict(job)["progress"])
        return family


class DaemonMetrics:
    """A daemon's registry: its histograms, and the collectors that read the catalog and the
    process's tallies at scrape time. ``render()`` is the ``/metrics`` body."""

    def __init__(self, sessions: sessionmaker[Session], *, node: str, node_timeout: float,
                 tallies: Callable[[], Tallies]) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.started = time.monotonic()
        # a file older than this daemon was first seen by its start's rescan, not at its mtime: the
        # latency is ckptd's, not the time the daemon was down
        self._started_wall = time.time()
        self.registry = CollectorRegistry()
        self._rename_to_verified = Histogram(
            "ckptd_rename_to_verified_seconds",
            "Seconds from a shard file appearing at its final name (its mtime; for a file older than this daemon's "
            "start, the start) to its first verdict verified on this node. Re-verifications (scrub, jobs) are not "
            "counted.", buckets=_RENAME_BUCKETS, registry=self.registry)
        self._resume = Histogram(
            "ckptd_resume_answer_seconds",
            "Seconds the resume oracle (GET /v1/runs/{run}/resume) took to answer, by path (cache: a current cached "
            "answer served before the API stack; route: the documented route, which computes answers and errors) "
            "and HTTP status code.", ["path", "code"], buckets=_RESUME_BUCKETS, registry=self.registry)
        self._to_manifest = Histogram(
            "ckptd_restorable_to_manifest_seconds",
            "Seconds from a step's files verified on the file tier (restorable) to its object-tier manifest written "
            "by this node (object tier only).", buckets=_RENAME_BUCKETS, registry=self.registry)
        self.registry.register(TallyCollector(tallies, node, self.started))
        self.registry.register(CatalogCollector(sessions, node_timeout))

    def shards_verified(self, mtimes_ns: Iterable[int]) -> None:
        """First verdicts ``verified`` were just stored for files with these mtimes."""
        now = time.time()
        for mtime_ns in mtimes_ns:
            appeared = max(mtime_ns / 1e9, self._started_wall)
            self._rename_to_verified.observe(max(0.0, now - appeared))  # a clock ahead of ours is no negative latency

    def resume_answered(self, seconds: float, path: str, code: int) -> None:
        """The resume oracle answered in ``seconds`` (``path``: ``cache`` or ``route``)."""
        self._resume.labels(path=path, code=str(code)).observe(seconds)

    def manifest_written(self, seconds: float) -> None:
        """A step's object-tier manifest was written ``seconds`` after its files were verified."""
        self._to_manifest.observe(seconds)

    def render(self) -> bytes:
        """The text exposition of every metric (catalog reads happen here)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
