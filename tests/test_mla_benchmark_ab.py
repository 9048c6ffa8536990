"""benchmarks/mla_decode_ab.py: variants and cells are parsed as documented, and malformed ones
are refused with a message that names them (before any GPU work starts)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import mla_decode_ab


def test_variants_and_cells_parse():
    v = mla_decode_ab.parse_variants("exact:PDSERVE_MLA_SWAPAB_LAZY=0;lazy:;pv:A=1+B=2,3")
    assert v == [("exact", {"PDSERVE_MLA_SWAPAB_LAZY": "0"}), ("lazy", {}),
                 ("pv", {"A": "1", "B": "2,3"})]
    assert mla_decode_ab.parse_cells("8:32768:32:fp8,64:8192:12:bf16") == [
        (8, 32768, 32, "fp8"), (64, 8192, 12, "bf16")]


@pytest.mark.parametrize("text", ["lazy", ":A=1", "x:A", "x:=1"])
def test_malformed_variant_is_refused_by_name(text):
    with pytest.raises(SystemExit, match="variant"):
        mla_decode_ab.parse_variants(text)


@pytest.mark.parametrize("text", ["8:32768:fp8", "8:32768:32:fp16", "8:x:32:fp8", "8:1:2:fp8,"])
def test_malformed_cell_is_refused_by_name(text):
    with pytest.raises(SystemExit, match="cell"):
        mla_decode_ab.parse_cells(text)
