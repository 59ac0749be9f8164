"""Report writers and readers: CSV / JSON / Markdown round trips, the pivot, speed-ups, the verdict."""
import json
import math

import pytest

from bench import report
from bench.cases import Case
from bench.harness import Result

CASE_A = Case("float16", 4, 32, 32, 4096, 4096, 64, False)
CASE_B = Case("float16", 1, 16, 4, 16384, 8192, 128, True, window=(256, 0), dropout_p=0.1)


def sample_results():
    """A small sweep: ok rows, a refusal whose reason has a '|' and a comma, an OOM."""
    return [
        Result(CASE_A, "flashnb-simt", "fwd", ms=2.0, ms_p10=1.9, ms_p90=2.2, reps=30, peak_bytes=3 * 2**20,
               max_rel_err=1.25e-3),
        Result(CASE_A, "sdpa-flash", "fwd", ms=1.0, ms_p10=0.99, ms_p90=1.01, reps=30, peak_bytes=2**20),
        Result(CASE_A, "torch-materialised", "fwd", ms=8.0, ms_p10=7.5, ms_p90=8.5, reps=25, peak_bytes=9 * 2**30),
        Result(CASE_A, "flashnb-simt", "bwd", ms=5.0, ms_p10=4.0, ms_p90=6.0, reps=12, peak_bytes=0),
        Result(CASE_A, "sdpa-flash", "bwd", status="n/a",
               note='RuntimeError: No available kernel. | Flash attention requires "fp16", bf16'),
        Result(CASE_A, "torch-materialised", "bwd", ms=10.0, ms_p10=9.0, ms_p90=11.0, reps=5, peak_bytes=2**31),
        Result(CASE_B, "flashnb-simt", "fwd", ms=0.0123456789, ms_p10=0.012, ms_p90=0.013, reps=30, peak_bytes=12345),
        Result(CASE_B, "torch-materialised", "fwd", status="OOM", note="OutOfMemoryError: CUDA out of memory."),
    ]


def records():
    return [r.record() for r in sample_results()]


def test_record_has_every_field_and_tflops():
    rec = records()[0]
    assert set(rec) == {name for name, _ in report.RESULT_FIELDS}
    assert rec["tflops"] == pytest.approx(4 * 4 * 32 * 4096 * 4096 * 64 / 2e-3 / 1e12)
    assert rec["peak_mib"] == 3.0
    assert records()[4]["tflops"] is None


def test_csv_round_trip_is_exact():
    header = {"device": "NVIDIA H100 80GB HBM3", "command": "python -m bench --dtype float16"}
    text = report.render_csv(header, records())
    got_header, got = report.read_csv(text)
    assert got_header == header
    assert got == records()
    assert text.splitlines()[0].startswith("# device: ")


def test_csv_carries_the_other_sections_after_the_results():
    recs = records()
    sp = report.speedups(recs)
    sections = [report.results_section(recs), report.speedup_section(sp, "fwd", recs),
                report.summary_section(report.summary_records(sp))]
    text = report.render_csv({"device": "x"}, recs, sections)
    assert report.read_csv(text) == ({"device": "x"}, recs)
    tables = report.read_csv_tables(text)
    assert set(tables) == {"speedup_fwd", "summary"}
    assert [float(r["speedup"]) for r in tables["speedup_fwd"]] == [s["speedup"] for s in sp if s["pass"] == "fwd"]
    assert tables["summary"][0]["baseline"] == "sdpa-flash"


def test_json_round_trip_keeps_numbers_and_sections():
    recs = records()
    sp = report.speedups(recs)
    sections = [report.results_section(recs), report.summary_section(report.summary_records(sp))]
    doc = report.read_json(report.render_json({"device": "x"}, recs, sections, ["a note"]))
    assert doc["results"] == recs
    assert doc["header"] == {"device": "x"} and doc["messages"] == ["a note"]
    assert "results_table" not in doc              # the pivot is a view, not data
    assert doc["summary"] == report.summary_records(sp)      # unformatted numbers, not the pivot
    assert doc["summary"][0]["geomean_speedup"] == 0.5 and doc["summary"][0]["baseline"] == "sdpa-flash"


def test_json_never_writes_nan():
    rec = records()[0]
    rec["max_rel_err"] = float("nan")
    text = report.render_json({}, [rec], [])
    json.loads(text)                               # strict JSON parsers reject NaN
    assert "NaN" not in text


def test_markdown_tables_round_trip_with_pipes_in_cells():
    recs = records()
    sections = [report.results_section(recs)] + [report.speedup_section(report.speedups(recs), p, recs)
                                                 for p in ("fwd", "bwd")]
    text = report.render_markdown({"command": "python -m bench", "device": "a|b"}, sections, ["m"])
    tables = report.read_markdown_tables(text)
    assert [t[0] for t in tables] == [s.title for s in sections]
    for (title, headers, rows), s in zip(tables, sections):
        assert (headers, rows) == s.cells()
    assert any("|" in n for n in sections[0].notes)   # the footnote with a pipe survived escaping
    assert "a\\|b" in text


def test_results_pivot_one_row_per_case_and_impl_with_status_and_footnotes():
    sec = report.results_section(records())
    headers, rows = sec.cells()
    assert len(rows) == 5                           # (A: 3 impls) + (B: 2 impls)
    assert headers[:3] == ["dtype", "B", "H"]
    assert {"Hk", "Nq", "Nk", "window", "dropout"} <= set(headers)   # shown because they vary
    col = {h: i for i, h in enumerate(headers)}
    sdpa = next(r for r in rows if r[col["impl"]] == "sdpa-flash")
    assert sdpa[col["fwd ms"]] == "1.000" and sdpa[col["fwd TF/s"]] == "549.8"
    assert sdpa[col["bwd ms"]] == "n/a" and sdpa[col["note"]] == "[1]"
    oom = [r for r in rows if r[col["fwd ms"]] == "OOM"]
    assert len(oom) == 1 and oom[0][col["note"]] == "[2]"
    small = next(r for r in rows if r[col["Nq"]] == "16384" and r[col["impl"]] == "flashnb-simt")
    assert small[col["fwd ms"]] == "0.0123"
    assert sec.notes[0].startswith("[1] RuntimeError: No available kernel.")


def test_plain_sweep_hides_constant_columns():
    recs = [r for r in records() if r["seqlen_q"] == 4096]
    headers, _ = report.results_section(recs, passes=("fwd",)).cells()
    assert "Hk" not in headers and "Nk" not in headers and "window" not in headers and "N" in headers
    assert not any(h.startswith("bwd") for h in headers)


def test_speedups_are_baseline_over_flashnb_and_only_where_both_ran():
    sp = report.speedups(records())
    by = {(s["pass"], s["baseline"], s["seqlen_q"]): s["speedup"] for s in sp}
    assert by[("fwd", "sdpa-flash", 4096)] == 0.5            # flashnb twice as slow
    assert by[("fwd", "torch-materialised", 4096)] == 4.0
    assert by[("bwd", "torch-materialised", 4096)] == 2.0
    assert ("bwd", "sdpa-flash", 4096) not in by              # sdpa refused
    assert ("fwd", "torch-materialised", 16384) not in by     # OOM
    mem = {(s["pass"], s["baseline"]): s["memory_ratio"] for s in sp if s["seqlen_q"] == 4096}
    assert mem[("fwd", "sdpa-flash")] == 3.0
    assert mem[("bwd", "torch-materialised")] is None         # flashnb's 0 bytes: no ratio


def test_summary_geomean_and_wins():
    sp = [{"flashnb": "flashnb-simt", "baseline": "b", "pass": "fwd", "speedup": x, "memory_ratio": m}
          for x, m in ((0.5, 0.01), (2.0, None), (8.0, 0.04))]
    (s,) = report.summary_records(sp)
    assert s["geomean_speedup"] == pytest.approx(2.0) and s["geomean_memory_ratio"] == pytest.approx(0.02)
    assert (s["wins"], s["cases"], s["min_speedup"], s["max_speedup"]) == (2, 3, 0.5, 8.0)
    headers, rows = report.summary_section([s]).cells()
    assert rows[0][2] == "2.00x (2/3 faster; memory 0.02x)"
    s["geomean_memory_ratio"] = None
    assert report.summary_section([s]).cells()[1][0][2] == "2.00x (2/3 faster)"


def test_terminal_report_has_header_notes_and_tables():
    recs = records()
    text = report.render("table", {"device": "GPU", "date": "today"}, recs, [report.results_section(recs)], ["hello"])
    lines = text.splitlines()
    assert lines[:3] == ["# device: GPU", "# date: today", "# NOTE: hello"]
    assert "## Results" in text and "flashnb-simt" in text and "[1] RuntimeError" in text


def test_unknown_format_is_refused():
    with pytest.raises(ValueError):
        report.render("xml", {}, [], [])


def test_number_formats():
    assert report.fmt_ms(None) == "" and report.fmt_ms(12.34567) == "12.346" and report.fmt_ms(0.01234) == "0.0123"
    assert report.fmt_ratio(1.0) == "1.00x" and report.fmt_tflops(307.06) == "307.1"
    assert math.isclose(float(report.fmt_mib(1023.6)), 1024)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional extra (pip install matplotlib)")
    path = tmp_path / "tflops.png"
    report.plot(records(), str(path), title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
