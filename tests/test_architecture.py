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


def test_the_job_side_never_imports_the_catalog_the_service_the_converter_or_the_formats():
    """The launcher asks ckptd over HTTP; it derives no conversion target and reads no checkpoint
    (issue 21: a thin launcher). The MindSpore callback restores through MindSpore itself."""
    rows = layers()
    job = next(i for i, (name, _, _) in enumerate(rows) if name == "job side")
    assert "import the service, the catalog, the converter or the formats" in rows[job][2]
    banned = [i for i, (name, _, _) in enumerate(rows) if name in ("catalog", "service", "conversion", "formats")]
    wrong = [f"{rel} imports {target}" for rel in modules() if layer_index(rows, rel) == job
             for target in imported(rel) if layer_index(rows, target) in banned]
    assert not wrong, wrong


#: SQLAlchemy's statement and expression builders: SQL text of any kind is written in catalog/
SQL_BUILDERS = {"select", "update", "delete", "insert", "text", "func", "and_", "or_", "not_", "exists", "union",
                "union_all", "case", "cast", "literal", "literal_column", "bindparam", "column", "table", "values",
                "tuple_", "distinct", "null", "true", "false", "Select", "TextClause"}
SQL_HOMES = ("ckptd/catalog/", "ckptd/migrations/")
#: modules that still build SQL (issue 21: "SQL only in catalog/"). They were being rewritten by
#: others when the rest moved to ckptd/catalog/; each entry goes once its module is clean (the
#: test below then says so). Never add one: write a function in ckptd/catalog/ instead.
SQL_NOT_MOVED_YET = {
    "ckptd/service/resume.py",  # the resume oracle's own reads (its hot path: plain column rows)
}


def sql_built(path: Path) -> list[str]:
    """Where ``rel`` builds SQL itself: imports of SQLAlchemy's statement builders (from
    ``sqlalchemy``, ``sqlalchemy.sql`` or a dialect), a bare ``import sqlalchemy`` (``sa.select``),
    a Core statement on a model's ``__table__``, raw SQL through ``exec_driver_sql``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sqlalchemy":
            if node.module in ("sqlalchemy", "sqlalchemy.sql", "sqlalchemy.sql.expression") or ".dialects" in node.module:
                found += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if a.name in SQL_BUILDERS]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "sqlalchemy" and a.name not in ("sqlalchemy.orm", "sqlalchemy.exc")]
        elif isinstance(node, ast.Attribute) and node.attr in ("__table__", "exec_driver_sql"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return sorted(found, key=lambda hit: int(hit.split()[1].rstrip(":")))


def test_sql_is_written_only_in_the_catalog():
    """docs/ARCHITECTURE.md: queries are functions of ckptd/catalog/ that the service, the API and
    the CLI call; nothing outside it builds a statement (a Session and the ORM objects it returns
    are fine). The allow-list only shrinks."""
    outside = [m for m in modules() if not m.startswith(SQL_HOMES)]
    wrong = [f"{m}: {hit}" for m in outside if m not in SQL_NOT_MOVED_YET for hit in sql_built(REPO / m)]
    assert not wrong, "SQL built outside ckptd/catalog/ (write a catalog function instead):\n" + "\n".join(wrong)
    clean = sorted(m for m in SQL_NOT_MOVED_YET if (REPO / m).is_file() and not sql_built(REPO / m))
    assert not clean, f"these modules build no SQL any more: remove them from SQL_NOT_MOVED_YET: {clean}"
    assert "every SQL statement of ckptd" in DOC.read_text()  # the rule is stated where the layers are


def test_the_sql_check_sees_what_it_forbids(tmp_path):
    """The check itself finds each way of building SQL it names (a check that finds nothing passes
    for every module)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sqlalchemy as sa\nfrom sqlalchemy import func, select\nfrom sqlalchemy.orm import Session\n"
                     "from sqlalchemy.dialects.postgresql import insert\n"
                     "def f(s, Job):\n    s.execute(Job.__table__.delete())\n    s.connection().exec_driver_sql('x')\n")
    hits = sql_built(probe)
    assert [h.split(": ", 1)[1] for h in hits] == [
        "import sqlalchemy", "from sqlalchemy import func", "from sqlalchemy import select",
        "from sqlalchemy.dialects.postgresql import insert", ".__table__", ".exec_driver_sql"], hits
    assert sql_built(REPO / "ckptd" / "service" / "resume.py")  # an allow-listed module is really seen
