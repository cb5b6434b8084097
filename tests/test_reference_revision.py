"""Each golden names the revision of DeepSeek's reference code it follows (issue 61: the V4.1
reference was fixed after release): V4 the current V4-Flash code, V4.1 the code with the
index-key fix, whose unfixed reading is the toggle v41_stale_index_keys."""
from __future__ import annotations

from kernel_toggles import ToggleSet
from reference_model import tiny
from reference_model.v41.config import tiny_v41
from reference_model.version import parts_for
from fidelity.verdict.judge import golden_follows


def test_each_version_names_its_reference_revision():
    v4, v41 = parts_for(tiny()).reference, parts_for(tiny_v41()).reference
    assert "V4-Flash" in v4 and "60d8d707" in v4
    assert "V4.1-Flash" in v41 and "dba1be0a" in v41 and "PR #12" in v41
    # the unfixed reading the V4.1 sentence points to is a toggle that exists
    assert "v41_stale_index_keys" in v41 and ToggleSet.parse("v41_stale_index_keys").names


def test_the_sentence_is_said_when_the_manifest_records_it():
    assert golden_follows({"reference": "X @ 1"}) == " The golden follows X @ 1."
    assert golden_follows({}) == ""                  # a run from before manifests recorded it
