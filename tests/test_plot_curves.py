"""The benchmark's loss-over-time plot: one line per run, a colour per kind, the target dashed."""

import json
import xml.etree.ElementTree as ET

from benchmarks import plot_curves


def test_each_run_is_a_line_and_each_kind_a_legend_entry(tmp_path):
    runs = [{"kind": kind, "repeat": r, "setting": "static",
             "curve": [{"t": t, "version": t, "loss": 2.0 / (1 + t * (r + 1)), "accuracy": 0.5} for t in range(10)]}
            for kind in ("sync", "async") for r in range(2)]
    runs.append({"kind": "sync", "repeat": 0, "setting": "dynamic", "curve": [{"t": 1, "loss": 1.0}]})
    source = tmp_path / "curves.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in runs))
    out = tmp_path / "loss.svg"
    assert plot_curves.main([str(source), "-o", str(out), "--setting", "static"]) == 0
    root = ET.fromstring(out.read_text())
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == 4 and all(len(p.get("points").split()) == 10 for p in lines)
    assert len({p.get("stroke") for p in lines}) == 2
    assert [t.text for t in root.findall(f"{ns}text") if t.text in ("sync", "async")] == ["sync", "async"]
    assert any(line.get("stroke-dasharray") for line in root.findall(f"{ns}line"))  # the target loss
    assert plot_curves.main([str(source), "-o", str(out), "--setting", "none"]) == 2
