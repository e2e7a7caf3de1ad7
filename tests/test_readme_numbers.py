"""README.md's Results table against benchmarks/RESULTS.md, so that the two cannot drift apart.

For every row of the table under README's "## Results": the row's date and commit stand together on one line of
RESULTS.md, the row's hardware is one of RESULTS.md's machine names, and every number of the row's "number" cell
appears in the RESULTS.md section (a "## " heading and what follows it) that holds that line. Plain text parsing:
no package import."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# 20,090 and 56.8 and 5 (not the digits of a date or a commit: those are checked whole)
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


def numbers(text: str) -> set[float]:
    return {float(m.replace(",", "")) for m in NUMBER.findall(text)}


def table_rows(readme: str) -> list[dict[str, str]]:
    """The rows of the first table under "## Results", as {header: cell}."""
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln.strip() for ln in section.splitlines() if ln.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert re.fullmatch(r"[-:| ]+", lines[1]), "the second table line must be the header separator"
    return [dict(zip(header, [c.strip() for c in ln.strip("|").split("|")], strict=True)) for ln in lines[2:]]


def sections(results: str) -> list[str]:
    return re.split(r"(?m)^(?=## )", results)


def problems(readme: str, results: str) -> list[str]:
    found = []
    rows = table_rows(readme)
    if not rows:
        return ["README.md's Results table has no rows"]
    for row in rows:
        name, date, commit = row["what"], row["date"], row["commit"]
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date) or not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            found.append(f"{name!r}: date {date!r} / commit {commit!r} not a date and a commit")
            continue
        held = [s for s in sections(results) if any(date in ln and commit in ln for ln in s.splitlines())]
        if not held:
            found.append(f"{name!r}: no line of RESULTS.md has both {date} and {commit}")
            continue
        if f"**{row['hardware']}**" not in results:
            found.append(f"{name!r}: hardware {row['hardware']!r} is not a machine name of RESULTS.md")
        wanted = numbers(row["number"])
        if not wanted:
            found.append(f"{name!r}: no number in {row['number']!r}")
        missing = sorted(wanted - numbers("\n".join(held)))
        if missing:
            found.append(f"{name!r}: {missing} not in the RESULTS.md section of {date} / {commit}")
    return found


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def test_readme_results_are_in_results_md():
    assert problems(read("README.md"), read("benchmarks/RESULTS.md")) == []


def test_a_changed_number_date_or_commit_is_caught():
    readme, results = read("README.md"), read("benchmarks/RESULTS.md")
    row = table_rows(readme)[0]
    cell = row["number"]
    first = NUMBER.search(cell).group()
    changed = readme.replace(cell, cell.replace(first, "987654.321", 1), 1)
    assert any("987654.321" in p for p in problems(changed, results))
    line = f"| {row['date']} | {row['commit']} |"
    assert line in readme
    assert problems(readme.replace(line, f"| {row['date']} | 0000000 |", 1), results)
    assert problems(readme.replace(line, f"| 1999-01-01 | {row['commit']} |", 1), results)
