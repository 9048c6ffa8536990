"""benchmarks/common.py's text table and the benchmarks' columns on it (no device, no timing)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import Column, Table  # noqa: E402

import kda_decode  # noqa: E402


def test_row_by_row_lines_keep_the_columns_widths():
    t = Table([Column("case", width=6, left=True), Column("MB", lambda r: r["bytes"] / 1e6, ".1f", 4),
               Column("vs p=d", "slowdown", "+.0%"), "n"])
    assert t.header() == "case     MB vs p=d n"
    assert t.row({"case": "p1", "bytes": 2_500_000, "slowdown": 0.125, "n": 7}) == \
        "p1      2.5   +12% 7"
    # a value wider than its column pushes the rest right rather than being cut
    assert t.row({"case": "p1-d2-dcp2", "bytes": 0, "slowdown": -0.5, "n": 70}) == \
        "p1-d2-dcp2  0.0   -50% 70"


def test_a_table_of_dict_keys_sizes_columns_to_their_contents():
    rows = [{"context": 8192, "ms": 1.234567, "export": None}, {"context": 64, "ms": 12.5}]
    assert Table.of(rows).format(rows).splitlines() == [
        "context    ms export",
        "   8192 1.235      -",
        "     64  12.5      -"]
    assert Table.of([]).format([]) == ""


def test_kda_decode_tables_mark_what_was_not_measured():
    cell = {"H": 32, "B": 4, "floor_us": 3.456, "ours_us": 5.0, "ours_pdl_us": 4.3,
            "cluster_default": 2, "ours_us_by_cluster": {"1": 6.0, "2": 4.7},
            "frac_of_floor": 0.6912, "variants_us": {"c1": {"plain": 6.0, "pdl": 5.5},
                                                     "e8": {"error": "ValueError: x"}}}
    assert kda_decode.CELLS_TABLE.format([cell]).splitlines()[1].split() == [
        "32", "4", "5.0", "2", "2:4.7", "-", "-", "3.46", "69%", "-", "-", "4.3", "-", "-", "-"]
    assert kda_decode.variants_table(["c1", "e8", "w0"]).format([cell]).splitlines() == [
        " H B floor default      c1  e8  w0",
        "32 4  3.46 5.0/4.3 6.0/5.5 err -/-"]
