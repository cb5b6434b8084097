"""One number, one place: every number a committed example page's headline quotes is in a
table on the same page, at the same value as printed there (a reader checking a headline
against the table under it once found 11.8x above and 23.5x below). Numbers with a decimal
point, an exponent or a percent sign are checked; counts and layer numbers are words."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p for p in (ROOT / "reports").rglob("summary.md")
               if not {"demo", "latest"} & set(p.relative_to(ROOT / "reports").parts))
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d+)?%|\d+(?:\.\d+)?e[-+]?\d+|\d+\.\d+)(?![\w.])")
CELL = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d+)?%|\d+(?:\.\d+)?e[-+]?\d+|\d+(?:\.\d+)?)(?![\w.])")


def _values(text: str, pattern=NUMBER) -> list[float]:
    # a confidence level and a prompt's name ("needle at 69%") are words, not measured numbers
    text = re.sub(r"needle at \d+%", "needle", text.replace("95% CI", "CI").replace("95% interval", "interval"))
    return [float(m.rstrip("%")) / (100 if m.endswith("%") else 1) for m in pattern.findall(text)]


def headline(page: str) -> str:
    m = re.search(r"^\*\*Verdict\.\*\* (.*)$", page, re.M)
    return m.group(1) if m else ""


def table_values(page: str) -> set[float]:
    return {v for line in page.splitlines() if line.startswith("|") for v in _values(line, CELL)}


def test_the_number_pattern_reads_what_a_reader_reads():
    assert _values("recall 0.907 vs floor 0.985; 2.1% more; 1.5e-11, layer 3, L511, 4x") == \
        pytest.approx([0.907, 0.985, 0.021, 1.5e-11])


def missing_numbers(page: str) -> list[float]:
    """The headline's numbers found in no table of the page (AssertionError: no headline)."""
    said = headline(page)
    assert said, "no headline"
    table = table_values(page)
    return [v for v in _values(said) if not any(v == pytest.approx(t, rel=1e-9, abs=0) for t in table)]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT / "reports")))
def test_every_headline_number_is_in_a_table_of_its_page(path):
    page = path.read_text()
    assert not missing_numbers(page), (f"{path.relative_to(ROOT)}: headline numbers in no table: "
                                       f"{missing_numbers(page)}\nheadline: {headline(page)}")


INFINITE_MULTIPLE = re.compile(r"∞|\binf(?:inity)?\s*(?:×|x\b)|\binf(?:inity|initely)?\s+(?:many\s+)?times\b", re.I)


def test_the_infinite_multiple_pattern_reads_what_a_reader_reads():
    assert all(INFINITE_MULTIPLE.search(s) for s in ("∞×", "inf× its floor", "infx", "Infinity x the floor",
                                                  "infinitely many times the floor"))
    assert not any(INFINITE_MULTIPLE.search(s) for s in ("information", "4.2x its floor", "influx"))


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "reports").rglob("*")
                                        if p.suffix in (".md", ".html", ".csv")
                                        and not {"demo", "latest"} & set(p.relative_to(ROOT / "reports").parts)),
                         ids=lambda p: str(p.relative_to(ROOT / "reports")))
def test_no_committed_page_divides_by_a_zero_floor(path):
    """A floor of exactly 0 divides nothing: no committed page says an arm is infinitely many
    times its floor (it says 'bit-identical on repeat' and judges against a noise floor)."""
    hit = INFINITE_MULTIPLE.search(path.read_text(errors="replace"))
    assert hit is None, f"{path.relative_to(ROOT)}: {hit.group(0)!r} near ...{path.read_text()[max(0, hit.start() - 80):hit.end() + 40]}..."
