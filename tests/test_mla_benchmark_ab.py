"""benchmarks/mla_decode_ab.py: variants (sets of launch-plan choices) and cells are parsed as
documented, and malformed ones are refused with a message that names them (before any GPU work
starts)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import mla_decode_ab


def test_variants_and_cells_parse():
    v = mla_decode_ab.parse_variants("exact:lazy_max=0;lazy:;pv:pv_group=2+pv_in_flight=2;"
                                     "comb:combine=2,4+fp8_query=split")
    assert v == [("exact", {"lazy_max": "0"}), ("lazy", {}),
                 ("pv", {"pv_group": "2", "pv_in_flight": "2"}),
                 ("comb", {"combine": "2,4", "fp8_query": "split"})]
    parse = mla_decode_ab.parse_choice
    assert [parse(t) for t in ("lazy_max=0", "early_kv=1", "consumers=1", "combine=2,4",
                               "fp8_query=split")] == [
        ("lazy_max", False), ("early_kv", True), ("consumers", 1), ("combine", (2, 4)),
        ("fp8_query", "split")]
    assert mla_decode_ab.parse_cells("8:32768:32:fp8,64:8192:12:bf16") == [
        (8, 32768, 32, "fp8"), (64, 8192, 12, "bf16")]


@pytest.mark.parametrize("text", ["lazy", ":A=1", "x:A", "x:=1"])
def test_malformed_variant_is_refused_by_name(text):
    with pytest.raises(SystemExit, match="variant"):
        mla_decode_ab.parse_variants(text)


@pytest.mark.parametrize("text", ["x:core=mma", "x:lazy_max=maybe", "x:consumers=two",
                                  "x:combine=2", "x:fp8_query=half"])
def test_unknown_or_bad_choice_is_refused_by_name(text):
    with pytest.raises(SystemExit, match="choice"):
        mla_decode_ab.parse_variants(text)


@pytest.mark.parametrize("text", ["8:32768:fp8", "8:32768:32:fp16", "8:x:32:fp8", "8:1:2:fp8,"])
def test_malformed_cell_is_refused_by_name(text):
    with pytest.raises(SystemExit, match="cell"):
        mla_decode_ab.parse_cells(text)
