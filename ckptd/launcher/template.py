"""How the resume point reaches a job that ckptd did not write: a template of extra arguments
(``--resume-args``), environment variables (``--resume-env NAME=TEMPLATE``), and always the whole
answer as a JSON file named by ``CKPTD_RESUME_FILE`` (the MindSpore callback reads it).

Under msrun one command line serves every rank, so a template can only carry what is the same for
all of them (a directory, a step, MindFormers' ``resume_training`` file name, in which MindFormers
substitutes each rank's ``_rank_<r>`` itself). A rank's own file is in the JSON file's ``shards``; the
``{ckpt_file}`` placeholder exists only for a single-rank job, and a template using it for more
ranks is refused before anything starts -- as is any placeholder this module does not know.
"""

from __future__ import annotations

import os
import shlex
import string

#: placeholder -> what it stands for (``ckptd launch --help`` prints this)
PLACEHOLDERS = {
    "checkpoint_dir": "the directory holding the rank_<r>/ directories of the step (MindFormers: load_checkpoint)",
    "resume_file": "the step's file name (MindFormers: resume_training; rank 0's name in the native layout)",
    "step": "the training step to resume from",
    "epoch": "the epoch in the step's file name",
    "global_step": "the global step the files hold (the step when ckptd has not read it)",
    "resume_json": "the path of the JSON file with ckptd's whole answer (also in $CKPTD_RESUME_FILE)",
    "ckpt_file": "the one rank's checkpoint file (single-rank jobs only: under msrun use the JSON file)",
}
#: ``--resume-preset`` names: templates for well-known entry points
PRESETS = {
    # MindFormers' run_mindformer.py: load_checkpoint is the directory of rank_<r>/, resume_training a
    # file name (MindFormers replaces its rank tag with each rank's) -- ckptd's answer's mindformers block
    "mindformers": "--load_checkpoint {checkpoint_dir} --resume_training {resume_file}",
}


class TemplateError(ValueError):
    """A template that cannot be used (refused before the job starts)."""


def _fields(text: str) -> list[str]:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as err:
        raise TemplateError(f"bad template {text!r}: {err} (write {{{{ and }}}} for literal braces)") from None
    names = []
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if name == "" or spec or conv:
            raise TemplateError(f"bad placeholder in {text!r}: use plain {{name}}, one of {', '.join(PLACEHOLDERS)}")
        names.append(name)
    return names


def check(template: str | None, env: list[str], world: int) -> tuple[list[str], dict[str, str]]:
    """Validate ``--resume-args`` and ``--resume-env`` before the job starts: (argument templates,
    variable -> template). Raises :class:`TemplateError` with what is wrong."""
    try:
        args = shlex.split(template) if template else []
    except ValueError as err:
        raise TemplateError(f"--resume-args {template!r} is not a valid shell word list: {err}") from None
    envs: dict[str, str] = {}
    for item in env:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise TemplateError(f"--resume-env {item!r}: expected NAME=TEMPLATE")
        envs[name] = value
    for text in [*args, *envs.values()]:
        for name in _fields(text):
            if name not in PLACEHOLDERS:
                raise TemplateError(f"unknown placeholder {{{name}}} in {text!r}; known: "
                                    f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
            if name == "ckpt_file" and world != 1:
                raise TemplateError(f"{{ckpt_file}} in {text!r} names one rank's file, but the job has {world} "
                                    f"ranks sharing one command line: read this rank's file from "
                                    f"$CKPTD_RESUME_FILE (shards[].path; the ckptd callback does) instead")
    return args, envs


def values(answer: dict, resume_json: str) -> dict[str, str]:
    """The placeholders' values for one resume answer (ckptd's ``GET /v1/runs/{run}/resume`` body)."""
    shards = sorted(answer.get("shards") or [], key=lambda s: int(s["rank"]))
    if not shards:
        raise TemplateError("the resume answer names no shard")
    first = str(shards[0]["path"])
    mf = answer.get("mindformers") if isinstance(answer.get("mindformers"), dict) else {}
    parents = sorted({os.path.dirname(os.path.dirname(str(s["path"]))) for s in shards})
    ckpt_dir = mf.get("load_checkpoint") or (parents[0] if len(parents) == 1 else os.path.commonpath(parents))
    step = answer.get("step")
    gstep = answer.get("global_step")
    return {
        "checkpoint_dir": str(ckpt_dir),
        "resume_file": str(mf.get("resume_training") or os.path.basename(first)),
        "step": str(step),
        "epoch": str(answer.get("epoch")),
        "global_step": str(gstep if gstep is not None else step),
        "resume_json": resume_json,
        "ckpt_file": first,
    }


def render(args: list[str], envs: dict[str, str], vals: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(extra arguments, extra environment) for a resumed attempt."""
    return [a.format(**vals) for a in args], {k: v.format(**vals) for k, v in envs.items()}
