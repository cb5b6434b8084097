"""A report regenerated on another machine or day is the same where nothing changed: its
manifest records the command as typed (`fidelity kld ...`), never the interpreter's path to
the entry script (a machine path in a committed file), and its gzipped tables hold no time."""
import sys

from infra.command import command_line


def test_the_command_is_written_as_typed(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/tmp/wt3/fidelity/__main__.py", "kld", "--arm", "a=golden", "--note", "two words"])
    assert command_line() == "fidelity kld --arm a=golden --note 'two words'"


def test_a_gzipped_table_is_the_same_bytes_when_written_again(tmp_path):
    import time

    import pandas as pd

    from infra.report_writer import ReportWriter
    df = pd.DataFrame({"a": range(100), "b": [0.5] * 100})
    got = []
    for i in range(2):
        w = ReportWriter(tmp_path / str(i), "r")
        w.table("t", df, gzip=True)
        got.append((w.tmp / "t.csv.gz").read_bytes())
        time.sleep(1.1)                              # gzip's header holds seconds
    assert got[0] == got[1] and pd.read_csv(w.tmp / "t.csv.gz").equals(df)
