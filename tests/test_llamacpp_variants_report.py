"""The llama.cpp variants page (fidelity.llamacpp.variants_report) from the committed
bench results: one row per variant with the measured numbers, a variant that did not serve
named, the unexplained (vs twin) judgement leading the headline, and the doc's table the
same rows as the page's."""
import json
from pathlib import Path

import pandas as pd

from fidelity.llamacpp import variants_report as VR

ROOT = Path(__file__).resolve().parents[1]
RESULTS = json.loads((ROOT / "bench" / "results" / "llama_cpp.json").read_text())


def test_the_page_holds_every_variant_with_its_measured_numbers(tmp_path):
    path = VR.write(RESULTS, tmp_path, "256,511,1023", "512,1024,16384")
    t = pd.read_csv(path / "variants.csv").set_index("GGUF")
    assert list(t.index) == list(RESULTS["variants"])
    for name, r in RESULTS["variants"].items():
        if "failed" in r:
            assert t.loc[name].iloc[0].startswith("llama-server did not start")
            continue
        k = r["kld"]
        assert t.loc[name, "mean KLD vs golden [CI] vs floor"].startswith(f"{k['kld_mean']:.3g} [{k['kld_lo']:.3g}")
        assert t.loc[name, "same top-1"] == float(f"{k['same_top1']:.4f}")
    html = (path / "index.html").read_text()
    assert "llama.cpp variants" in html and "data:image/png" in html          # the figure embedded
    assert VR.headline(RESULTS).split(";")[0] in html
    assert (path / "variants.png").stat().st_size > 10_000


def test_the_unexplained_judgement_leads():
    res = json.loads(json.dumps(RESULTS))
    served = [n for n, r in res["variants"].items() if "failed" not in r]
    for n in served:
        res["variants"][n]["kld"].update(twin_unexplained=False, twin_verdict="matches")
    assert VR.headline(res).startswith(f"All {len(served)} variants match the in-process twin")
    del res["variants"][served[0]]["kld"]["twin_unexplained"]                 # one not judged yet
    assert f"({served[0]} not judged against its twin yet)" in VR.headline(res)
    res["variants"][served[0]]["kld"]["twin_unexplained"] = False
    bad = served[-1]
    res["variants"][bad]["kld"].update(twin_unexplained=True,
                                       twin_verdict="Unexplained (vs its twin `exact`): x breaks coherence; more")
    head = VR.headline(res)
    assert head.startswith(f"Unexplained by its twin: {bad} (1 of {len(served)} variants")
    assert "Did not serve: Q8_0" in head
    row = VR.variants_frame(res, "16384").set_index("GGUF").loc[bad]
    assert row["verdict vs its twin (unexplained)"] == "**unexplained**: x breaks coherence"


def test_the_doc_table_is_the_page_table():
    doc = (ROOT / "docs" / "real-engines.md").read_text()
    body = doc.split("<!-- variants:start -->")[1].split("<!-- variants:end -->")[0]
    rows = [ln for ln in body.splitlines() if ln.startswith("| ") and not ln.startswith("| GGUF")]
    t = VR.variants_frame(RESULTS, "16384")
    assert len(rows) == len(t)
    for ln, (_, r) in zip(rows, t.iterrows()):
        assert ln == "| " + " | ".join(str(c) for c in r) + " |"
    assert VR.headline(RESULTS) in body


def test_the_twin_floor_is_tabled_and_drawn_beside_its_variant():
    res = json.loads(json.dumps(RESULTS))
    served = [n for n, r in res["variants"].items() if "failed" not in r]
    res["variants"][served[0]]["kld"].update(twin_floor_kld_hi=1.25e-4, twin_floor_arm="twin~floor:fp32-accum")
    for n in served[1:]:
        res["variants"][n]["kld"].pop("twin_floor_kld_hi", None)
    t = VR.variants_frame(res, "16384").set_index("GGUF")
    assert " vs floor 0.000125 " in t.loc[served[0], "mean KLD vs its twin"]
    assert all(" vs floor " not in t.loc[n, "mean KLD vs its twin"] for n in served[1:])
    fig = VR.plot_variants(res)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "its twin's highest floor" in labels
    bars = next(c for c in ax.collections if c.get_label() == "its twin's highest floor")
    xy = bars.get_offsets()
    drawn = [(float(x), int(round(float(y)))) for x, y in xy if x == x]     # NaN rows are not drawn
    assert drawn == [(1.25e-4, 0)]
    import matplotlib.pyplot as plt
    plt.close(fig)
