"""The committed end-to-end record is generated: re-rendering its data gives
the committed table byte for byte."""

from __future__ import annotations

import json

import pytest
from cases import HERE
from record import render

RESULTS = sorted((HERE / "results").glob("*/engine.jsonl"))


@pytest.mark.parametrize("data", RESULTS, ids=[p.parent.name for p in RESULTS])
def test_committed_table_is_rendered_from_its_data(data):
    rows = [json.loads(line) for line in data.read_text().splitlines() if line]
    assert rows, f"{data} is empty"
    assert render(rows) == data.with_suffix(".md").read_text()
