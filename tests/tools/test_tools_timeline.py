"""tools/timeline.py's reading of a profiler trace: no GPU needed (the trace is written here)."""
import json

from tools import timeline


def _trace(tmp_path, events):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _op(ts, dur, name, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": args}


def test_gpu_ops_keep_kernels_memsets_and_copies_in_start_order(tmp_path):
    events = [_op(30.0, 2.0, "k2"), _op(10.0, 5.0, "Memset (Device)", cat="gpu_memset", bytes=4096),
              _op(20.0, 1.0, "k1"), {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 99.0, "name": "aten::add"},
              {"ph": "i", "cat": "kernel", "ts": 1.0, "name": "instant"}]
    ops = timeline._gpu_ops(_trace(tmp_path, events))
    assert ops == [(10.0, 5.0, "Memset (Device) 4096 B"), (20.0, 1.0, "k1"), (30.0, 2.0, "k2")]


def test_calls_start_at_each_flush_and_drop_what_comes_before_the_first():
    ops = [(0, 1, "k0"), (5, 10, "flush"), (15, 2, "a"), (18, 3, "b"), (30, 10, "flush"), (40, 2, "a")]
    assert timeline._calls(ops, "flush") == [[(5, 10, "flush"), (15, 2, "a"), (18, 3, "b")],
                                             [(30, 10, "flush"), (40, 2, "a")]]
    assert timeline._calls(ops, "absent") == []


def test_short_names_drop_arguments_and_truncate():
    assert timeline._short("void f<int, 2>(Params)") == "f<int, 2>"
    assert timeline._short("Memset (Device) 4096 B") == "Memset 4096 B"
    long = timeline._short("x" * 200)
    assert len(long) == 70 and long.endswith("...")
