"""Liveness and health reports of the trainer: ckptd's job-side helpers (:mod:`ckptd.launcher.heartbeat`),
shared with the MindSpore callback so that the launcher watches any job the same way."""

from ckptd.launcher.heartbeat import (  # noqa: F401 -- re-exported for trainer.* and the tests
    HealthReporter,
    Heartbeat,
)
