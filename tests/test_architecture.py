"""docs/ARCHITECTURE.md's layer table is true of the code: read from the document itself, every
module of ``ckptd/`` belongs to exactly one layer, imports (also inside functions) only its own
layer or layers above it in the table, and the job side never imports the catalog or the service
(it talks to ckptd over HTTP). A change that breaks a rule fails here, naming the import."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ARCHITECTURE.md"


def layers() -> list[tuple[str, list[str], str]]:
    """(layer name, its paths, its "must not" cell) per table row, inner to outer."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 4 or cells[0] in ("layer", "---"):
            continue
        paths = [p for p in re.findall(r"`([^`]+)`", cells[1]) if p.startswith("ckptd/")]
        if paths:
            rows.append((cells[0], paths, cells[3]))
    return rows


def layer_index(rows, rel: str) -> int | None:
    hits = [i for i, (_, paths, _) in enumerate(rows)
            for p in paths if rel == p or (p.endswith("/") and rel.startswith(p))]
    return hits[0] if len(set(hits)) == 1 else None


def modules() -> list[str]:
    out = []
    for dirpath, _, files in os.walk(REPO / "ckptd"):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), REPO)
            if f.endswith(".py") and "/migrations/versions/" not in rel:
                out.append(rel)
    return sorted(out)


def imported(rel: str) -> set[str]:
    """The ckptd modules ``rel`` imports, as repository paths (a package: its directory + '/')."""
    tree = ast.parse((REPO / rel).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ckptd":
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "ckptd")
    out = set()
    for name in names:
        base = name.replace(".", "/")
        if (REPO / f"{base}.py").is_file():
            out.add(f"{base}.py")
        elif (REPO / base).is_dir() and base != "ckptd":
            out.add(f"{base}/")
    return out


def test_every_module_is_in_exactly_one_layer():
    rows = layers()
    assert len(rows) >= 8, rows
    homeless = [m for m in modules() if layer_index(rows, m) is None]
    assert not homeless, f"modules in no layer (or in two) of docs/ARCHITECTURE.md's table: {homeless}"


def test_layers_import_only_layers_above_them():
    rows = layers()
    wrong = []
    for rel in modules():
        me = layer_index(rows, rel)
        for target in sorted(imported(rel)):
            other = layer_index(rows, target)
            if other is None and target.endswith("/"):  # a package whose __init__ re-exports: its own layer
                other = layer_index(rows, target + "__init__.py")
            if other is not None and me is not None and other > me:
                wrong.append(f"{rel} ({rows[me][0]}) imports {target} ({rows[other][0]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_job_side_never_imports_the_catalog_or_the_service():
    rows = layers()
    job = next(i for i, (name, _, _) in enumerate(rows) if name == "job side")
    assert "import the service or the catalog" in rows[job][2]
    banned = [i for i, (name, _, _) in enumerate(rows) if name in ("catalog", "service")]
    wrong = [f"{rel} imports {target}" for rel in modules() if layer_index(rows, rel) == job
             for target in imported(rel) if layer_index(rows, target) in banned]
    assert not wrong, wrong
