"""benchmarks/kda_decode.py --variants: the names map to the launcher's keywords, and a bad name
is refused before any GPU work (the benchmark runs on the H200; this runs anywhere)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import kda_decode as bench  # noqa: E402


@pytest.mark.parametrize("name,kw", [
    ("c1", {"cluster": 1}), ("c8", {"cluster": 8}), ("e0", {"early_rows": 0}),
    ("e8", {"early_rows": 8}), ("c2e4", {"cluster": 2, "early_rows": 4}),
    ("w0", {"first_wave": 0}), ("e2w132", {"early_rows": 2, "first_wave": 132}),
    ("c1e2w66", {"cluster": 1, "early_rows": 2, "first_wave": 66}),
])
def test_variant_names(name, kw):
    assert bench.parse_variant(name) == kw


@pytest.mark.parametrize("name", ["", "c3", "e9", "x1", "c1e", "e2c1", "c16", "w", "w1e2", "w-1"])
def test_bad_variant_names_are_refused(name):
    with pytest.raises(ValueError, match="variant"):
        bench.parse_variant(name)
