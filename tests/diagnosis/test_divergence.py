"""Ranks that issued different collectives are reported first, with the first differing collective per rank."""

from __future__ import annotations

import json
from pathlib import Path

from overlapcfg.diagnosis import diagnose


def test_a_rank_that_issued_another_size_is_named_with_its_first_differing_collective(gpu_traces: Path) -> None:
    path = gpu_traces / "rank1.json"
    data = json.loads(path.read_text())
    seen = 0
    for e in data["traceEvents"]:
        if e.get("name") == "record_param_comms":
            seen += 1
            if seen == 2:  # rank 1's second collective: another bucket's all-gather
                e["args"]["Out msg nelems"] = 2_097_152
    path.write_text(json.dumps(data))
    r = diagnose(gpu_traces)
    assert len(r.divergence) == 1
    d = r.divergence[0]
    assert (d.rank, d.reference, d.position, d.step, d.file) == (1, 0, 1, 5, "rank1.json")
    assert "1,048,576" in d.expected and "2,097,152" in d.found and "model.layers.0" in d.expected
    assert r.proposal is None and "different collectives" in r.verdict
    assert str(r).splitlines()[0].startswith("RANKS DISAGREE")


def test_ranks_that_agree_are_not_reported(gpu_traces: Path) -> None:
    assert diagnose(gpu_traces).divergence == ()
