"""Prometheus text exposition (format 0.0.4) for ``/metrics``: the one place that writes a sample.

Label values come from the disk and the catalog (run directory names, node names): a run directory
named ``x"} 1\\nckptd_shards{state="verified"} 424242`` must stay one label value, never forge a
line. So every sample goes through :func:`sample`, which escapes label values as the format
requires (backslash, double quote, line feed -- the only three characters it escapes). Metric and
label *names* are ckptd's own constants.
"""

from __future__ import annotations

_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n"})


def label_value(value: object) -> str:
    """``value`` as the inside of a quoted label value (None: the empty string)."""
    return ("" if value is None else str(value)).translate(_ESCAPES)


def sample(name: str, value: object, **labels: object) -> str:
    """One sample line: ``name{label="value",...} value`` (no braces without labels)."""
    if not labels:
        return f"{name} {value}"
    inner = ",".join(f'{key}="{label_value(v)}"' for key, v in labels.items())
    return f"{name}{{{inner}}} {value}"
