"""Automatic resume for MindSpore jobs: supervise a command (typically ``msrun ... script.py``), watch
its ranks through heartbeat files, and on a failure stop the whole job, ask ckptd where to resume and
start it again with the resume point injected.

* :mod:`ckptd.launcher.supervise` -- one attempt (:class:`~ckptd.launcher.supervise.Job`) and the
  restart loop, shared by ``ckptd launch`` and ``trainer.launch``;
* :mod:`ckptd.launcher.oracle` -- the resume oracle's client (HTTP, or a command printing its JSON);
* :mod:`ckptd.launcher.elastic` -- elastic restarts: a step saved in another layout, resumed from
  ckptd's re-sharded copy (``ckptd launch --layout`` and ``trainer.launch``);
* :mod:`ckptd.launcher.heartbeat` -- the files a rank writes (heartbeat, exit marker) and its
  best-effort health reports; written by ckptd's trainer and by the MindSpore callback
  (``ckptd.integrations.mindspore_callback``);
* :mod:`ckptd.launcher.template` -- how the resume point reaches the job (arguments, environment).

None of these imports MindSpore: the daemon's package must stay installable without it.
"""
