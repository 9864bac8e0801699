"""Render the benches' JSON files into the docs: every region of a doc marked

    <!-- bench: NAME -->            (or NAME#TABLE for one table of several)
    ...
    <!-- /bench -->

is rewritten with the tables of docs/data/bench/NAME.json, as the bench printed them, under a
line saying which command, on what and when.

    python bench/tables.py            # rewrite the marked regions of docs/*.md
    python bench/tables.py --check    # exit 1, naming them, where a region differs

tests/test_bench.py runs the check: a table in the docs is what its JSON file says.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from report import DATA, ROOT, Table

DOCS = ROOT / "docs"
MARKED = re.compile(r"(?P<open><!-- bench: (?P<name>[\w.-]+)(?:#(?P<table>[\w.-]+))? -->\n)"
                    r"(?P<body>.*?)(?P<close><!-- /bench -->)", re.DOTALL)


def load(name: str) -> dict:
    path = DATA / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"{path.relative_to(ROOT)}: no such bench file (a marker names it)")
    return json.loads(path.read_text())


def provenance(data: dict, link: str) -> str:
    """One line: the command, where it ran, when, and the file the table comes from."""
    m = data.get("machine")
    if m:
        where = f"torch {m['torch']}, {m['device']}"
        where += f" ({m['gpu']})" if m.get("gpu") else ""
        where += f", {m['torch_threads']} threads"
        if m.get("load_1min_at_start") is not None:
            where += f", load {m['load_1min_at_start']:.1f} at the start"
    else:
        where = "machine not recorded"
    src = f"; {data['source']}" if data.get("source") else ""
    return (f"Generated from [{link}]({link}) (`python bench/tables.py`): `{data['command']}`, "
            f"{data['date'][:10]}, {where}{src}.")


def render(name: str, table: str | None, doc: Path) -> str:
    data = load(name)
    tables = [Table.from_json(t) for t in data["tables"]]
    if table is not None:
        tables = [t for t in tables if t.name == table]
        if not tables:
            raise SystemExit(f"{name}.json has no table {table!r}")
    link = os.path.relpath(DATA / f"{name}.json", doc.parent)
    return "\n\n".join([provenance(data, link), *(t.text() for t in tables)]) + "\n"


def rewrite(text: str, doc: Path) -> str:
    """`text` with every marked region replaced by its rendering."""
    return MARKED.sub(lambda m: m["open"] + render(m["name"], m["table"], doc) + m["close"],
                      text)


def regions(text: str) -> list[tuple[str, str | None]]:
    return [(m["name"], m["table"]) for m in MARKED.finditer(text)]


def docs() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 where a marked region differs from its JSON")
    a = ap.parse_args()
    stale = []
    for doc in docs():
        text = doc.read_text()
        new = rewrite(text, doc)
        if new != text:
            stale.append(doc.relative_to(ROOT))
            if not a.check:
                doc.write_text(new)
    verb = "differ from their JSON" if a.check else "rewritten"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "every marked table is current")
    sys.exit(1 if a.check and stale else 0)


if __name__ == "__main__":
    main()
