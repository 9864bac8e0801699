"""README.md's recipe and objective tables are what the code renders from RECIPES and
the objectives' registry (`parity recipes --markdown`), never a hand copy."""

from __future__ import annotations

from pathlib import Path

from parity.cli import main, readme_tables
from parity.config import RECIPES
from parity.objectives import OBJECTIVES

README = Path(__file__).resolve().parents[1] / "README.md"


def table_in(text: str, first_column: str) -> str | None:
    """The table whose header starts with `first_column`: its lines up to the first that is no
    table row."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |")),
                 None)
    if start is None:
        return None
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "".join(lines[start:end])


def test_readme_tables_are_the_rendered_ones():
    readme = README.read_text()
    for name, want in readme_tables().items():
        assert table_in(readme, name) == want, (
            f"README.md's {name} table is not what the code renders; regenerate it with "
            f"`parity recipes --markdown` and paste its {name} table over README.md's:\n{want}")


def test_the_tables_cover_every_recipe_and_objective():
    for name, names in (("recipe", list(RECIPES)), ("objective", list(OBJECTIVES))):
        rows = readme_tables()[name].splitlines()[2:]
        assert [row.split("`")[1] for row in rows] == names, name


def test_a_changed_table_is_found():
    readme = README.read_text()
    table = table_in(readme, "recipe")
    assert table_in(readme.replace(table, table.replace("| fp32 |", "| fp16 |", 1)),
                    "recipe") != readme_tables()["recipe"]


def test_parity_recipes_prints_them(capsys):
    assert main(["recipes", "--markdown"]) == 0
    assert capsys.readouterr().out == "\n".join(readme_tables().values())
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*RECIPES, *OBJECTIVES])
    # square brackets in a summary are text: icepop's bounds are printed, not taken for a style
    assert "[is_cap_low," in " ".join(out.replace("│", " ").split())
