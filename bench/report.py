"""Tables and file formats: terminal (tabulate), Markdown, CSV, JSON, and the plot.

A report is a header (dict: device, versions, date, command line, ...), the long
results (one record per case x implementation x pass, fields ``RESULT_FIELDS``)
and derived sections (``Section``: raw records plus how to show them).

* terminal / Markdown: the header, then every section as a table; the results
  are pivoted to one row per (case, implementation) with a column group per
  pass, and long reasons become numbered footnotes;
* CSV: the header as ``# key: value`` comment lines, then the long results
  (``read_csv`` reads it back; pandas: ``read_csv(path, comment="#")``), then
  each other section's records as a further table after a blank line;
* JSON: ``{"header", "results", <section key>: [records]}``, numbers unrounded.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from typing import Callable

from tabulate import tabulate

from bench.flops import PASSES

RESULT_FIELDS = (
    ("dtype", str), ("batch", int), ("nheads", int), ("nheads_k", int), ("seqlen_q", int),
    ("seqlen_k", int), ("headdim", int), ("causal", bool), ("window_left", int), ("window_right", int),
    ("dropout_p", float), ("impl", str), ("pass", str), ("status", str), ("ms", float),
    ("ms_p10", float), ("ms_p90", float), ("reps", int), ("tflops", float), ("flops", int),
    ("peak_mib", float), ("max_rel_err", float), ("note", str),
)
CASE_KEYS = ("dtype", "batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "headdim", "causal",
             "window_left", "window_right", "dropout_p")
FORMATS = ("table", "markdown", "csv", "json")
PASS_LABEL = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "f+b"}


# ---- number formats -----------------------------------------------------------------------

def fmt_ms(x):
    return "" if x is None else (f"{x:.3f}" if x >= 0.1 else f"{x:.4f}")


def fmt_tflops(x):
    return "" if x is None else f"{x:.1f}"


def fmt_mib(x):
    return "" if x is None else f"{x:.0f}"


def fmt_ratio(x):
    return "" if x is None else f"{x:.2f}x"


def fmt_general(x):
    if x is None:
        return ""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


@dataclass
class Column:
    key: str
    header: str
    fmt: Callable = fmt_general


@dataclass
class Section:
    """A titled table: ``records`` and the ``columns`` that show them; JSON gets ``data``
    (the unformatted records behind a pivoted table) or else the records."""
    key: str
    title: str
    columns: list[Column]
    records: list[dict]
    notes: list[str] = field(default_factory=list)
    data: list[dict] | None = None

    def cells(self) -> tuple[list[str], list[list[str]]]:
        headers = [c.header for c in self.columns]
        rows = [[c.fmt(r.get(c.key)) for c in self.columns] for r in self.records]
        return headers, rows


# ---- derived tables -------------------------------------------------------------------------

def record_line(rec: dict, columns) -> str:
    """One record as ``title=value`` pairs, for the progress log of the sections with their own tables
    (``columns``: ``(key, title, format spec)``; absent values left out)."""
    return "  ".join(f"{title}={_spec(rec.get(key), spec)}" for key, title, spec in columns
                     if rec.get(key) is not None)


def record_table(records: list[dict], columns) -> str:
    """The records as a markdown table of ``columns`` (``(key, title, format spec)``; absent values empty)."""
    lines = ["| " + " | ".join(t for _, t, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        lines.append("| " + " | ".join(_spec(r.get(k), s) for k, _, s in columns) + " |")
    return "\n".join(lines)


def _spec(x, spec):
    return "" if x is None else format(x, spec)


def case_key(rec: dict) -> tuple:
    return tuple(rec[k] for k in CASE_KEYS)


def _case_columns(records: list[dict]) -> list[Column]:
    """Shape columns, leaving out those that do not vary from their plain value."""
    cols = [Column("dtype", "dtype"), Column("batch", "B"), Column("nheads", "H")]
    if any(r["nheads_k"] != r["nheads"] for r in records):
        cols.append(Column("nheads_k", "Hk"))
    if any(r["seqlen_k"] != r["seqlen_q"] for r in records):
        cols += [Column("seqlen_q", "Nq"), Column("seqlen_k", "Nk")]
    else:
        cols.append(Column("seqlen_q", "N"))
    cols += [Column("headdim", "d"), Column("causal", "causal")]
    if any((r["window_left"], r["window_right"]) != (-1, -1) for r in records):
        cols.append(Column("window", "window"))
    if any(r["dropout_p"] for r in records):
        cols.append(Column("dropout_p", "dropout"))
    return cols


def _with_window(rec: dict) -> dict:
    return {**rec, "window": f"({rec['window_left']}, {rec['window_right']})"}


class Footnotes:
    """Numbers each distinct long reason once: cells show ``[n]``, the section lists them."""

    def __init__(self):
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if not text:
            return ""
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def notes(self) -> list[str]:
        return [f"[{i}] {t}" for i, t in enumerate(self.texts, 1)]


def results_section(records: list[dict], passes=PASSES) -> Section:
    """One row per (case, impl), a (ms, TF/s, MiB) column group per pass; failures show their status."""
    rows: dict[tuple, dict] = {}
    foot = Footnotes()
    for r in records:
        row = rows.setdefault((case_key(r), r["impl"]), {**_with_window(r), "notes": []})
        p = r["pass"]
        if r["status"] == "ok":
            row[f"{p}_ms"], row[f"{p}_tflops"], row[f"{p}_mib"] = fmt_ms(r["ms"]), fmt_tflops(r["tflops"]), fmt_mib(r["peak_mib"])
        else:
            row[f"{p}_ms"] = r["status"]
        if r["note"]:
            row["notes"].append(foot.ref(r["note"]))
    for row in rows.values():
        row["note"] = " ".join(dict.fromkeys(row.pop("notes")))
    cols = _case_columns(records) + [Column("impl", "impl")]
    for p in passes:
        label = PASS_LABEL[p]
        cols += [Column(f"{p}_ms", f"{label} ms", str), Column(f"{p}_tflops", f"{label} TF/s", str),
                 Column(f"{p}_mib", f"{label} MiB", str)]
    cols.append(Column("note", "note", str))
    for row in rows.values():
        for c in cols:
            row.setdefault(c.key, "")
    return Section("results_table", "Results", cols, list(rows.values()), foot.notes())


def speedups(records: list[dict]) -> list[dict]:
    """For every flashnb result and every baseline result of the same case and pass, both ok:
    ``speedup = baseline ms / flashnb ms`` (> 1: flashnb is faster)."""
    ok = [r for r in records if r["status"] == "ok" and r["ms"]]
    by_case = {}
    for r in ok:
        by_case.setdefault((case_key(r), r["pass"]), []).append(r)
    out = []
    for (_, p), group in by_case.items():
        for f in (r for r in group if r["impl"].startswith("flashnb")):
            for b in (r for r in group if not r["impl"].startswith("flashnb")):
                out.append({**{k: f[k] for k in CASE_KEYS}, "pass": p, "flashnb": f["impl"],
                            "baseline": b["impl"], "speedup": b["ms"] / f["ms"],
                            "memory_ratio": (f["peak_mib"] / b["peak_mib"]) if f["peak_mib"] and b["peak_mib"] else None})
    return out


def speedup_section(speedup_records: list[dict], pass_: str, results: list[dict]) -> Section:
    """Pivot of ``speedups``: one row per (case, flashnb impl), one column per baseline."""
    baselines = list(dict.fromkeys(r["impl"] for r in results if not r["impl"].startswith("flashnb")))
    rows: dict[tuple, dict] = {}
    for s in (s for s in speedup_records if s["pass"] == pass_):
        row = rows.setdefault((case_key(s), s["flashnb"]), _with_window(s))
        row[s["baseline"]] = s["speedup"]
    case_records = [r for r in results if r["pass"] == pass_] or results
    cols = _case_columns(case_records) + [Column("flashnb", "flashnb")]
    cols += [Column(b, b, fmt_ratio) for b in baselines]
    return Section(f"speedup_{pass_}", f"Speed-up of flashnb, {PASS_LABEL[pass_]}: baseline time / flashnb time "
                   f"(> 1: flashnb faster; empty: one of the two did not run)", cols, list(rows.values()),
                   data=[s for s in speedup_records if s["pass"] == pass_])


def summary_records(speedup_records: list[dict], passes=PASSES) -> list[dict]:
    """Geometric-mean speed-up and wins per (flashnb impl, baseline, pass) over the cases both ran."""
    groups: dict[tuple, list[dict]] = {}
    for s in speedup_records:
        groups.setdefault((s["flashnb"], s["baseline"], s["pass"]), []).append(s)
    geomean = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None
    out = []
    for (f, b, p), group in groups.items():
        xs = [s["speedup"] for s in group]
        mem = [s["memory_ratio"] for s in group if s.get("memory_ratio")]
        out.append({"flashnb": f, "baseline": b, "pass": p, "cases": len(xs),
                    "wins": sum(x > 1 for x in xs), "geomean_speedup": geomean(xs),
                    "min_speedup": min(xs), "max_speedup": max(xs),
                    "geomean_memory_ratio": geomean(mem)})
    order = {p: i for i, p in enumerate(passes)}
    return sorted(out, key=lambda r: (r["flashnb"], r["baseline"], order.get(r["pass"], 99)))


def summary_section(summary: list[dict], passes=PASSES) -> Section:
    rows: dict[tuple, dict] = {}
    for s in summary:
        row = rows.setdefault((s["flashnb"], s["baseline"]), {"flashnb": s["flashnb"], "baseline": s["baseline"]})
        mem = s.get("geomean_memory_ratio")
        row[s["pass"]] = (f"{s['geomean_speedup']:.2f}x ({s['wins']}/{s['cases']} faster"
                          + (f"; memory {mem:.2g}x)" if mem else ")"))
    cols = [Column("flashnb", "flashnb"), Column("baseline", "vs baseline")]
    cols += [Column(p, f"{PASS_LABEL[p]}: geomean speed-up", fmt_general) for p in passes]
    return Section("summary", "Is flashnb worth it? Geometric-mean speed-up over the cases both ran "
                   "(> 1: flashnb faster)", cols, list(rows.values()), data=summary,
                   notes=["memory: geometric mean of flashnb's peak extra memory / the baseline's (< 1: flashnb "
                          "needs less)"])


# ---- renderers ------------------------------------------------------------------------------

def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def render(fmt: str, header: dict, results: list[dict], sections: list[Section], messages: list[str] = ()) -> str:
    """The whole report in ``fmt`` (one of ``FORMATS``)."""
    if fmt == "table":
        return render_terminal(header, sections, messages)
    if fmt == "markdown":
        return render_markdown(header, sections, messages)
    if fmt == "csv":
        return render_csv(header, results, sections)
    if fmt == "json":
        return render_json(header, results, sections, messages)
    raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")


def render_terminal(header: dict, sections: list[Section], messages=()) -> str:
    out = [f"# {k}: {v}" for k, v in header.items()]
    out += [f"# NOTE: {m}" for m in messages]
    for s in sections:
        headers, rows = s.cells()
        out += ["", f"## {s.title}", tabulate(rows, headers, tablefmt="simple", disable_numparse=True)
                if rows else "(nothing to show)"]
        out += s.notes
    return "\n".join(out) + "\n"


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def render_markdown(header: dict, sections: list[Section], messages=()) -> str:
    out = ["# flashnb benchmark", ""]
    out += [f"- **{k}**: `{v}`" if k == "command" else f"- **{k}**: {_md_escape(v)}" for k, v in header.items()]
    out += [""] + [f"> **Note:** {_md_escape(m)}" for m in messages]
    for s in sections:
        headers, rows = s.cells()
        out += ["", f"## {s.title}", ""]
        if rows:
            out.append(tabulate([[_md_escape(c) for c in row] for row in rows],
                                [_md_escape(h) for h in headers], tablefmt="pipe", disable_numparse=True))
        else:
            out.append("(nothing to show)")
        if s.notes:
            out += [""] + [f"- {_md_escape(n)}" for n in s.notes]
    return "\n".join(out) + "\n"


def render_csv(header: dict, results: list[dict], sections: list[Section] = ()) -> str:
    """Header comments, the long results; then, after a blank line and ``# table: <key>``, the
    unformatted records of each other section (IO model, speed-ups, verdict, validation)."""
    buf = io.StringIO()
    for k, v in header.items():
        buf.write(f"# {k}: {' '.join(str(v).split())}\n")
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([name for name, _ in RESULT_FIELDS])
    for r in results:
        w.writerow(["" if r.get(name) is None else r[name] for name, _ in RESULT_FIELDS])
    for s in sections:
        data = s.data if s.data is not None else s.records
        if s.key == "results_table" or not data:
            continue
        names = list(dict.fromkeys(k for rec in data for k in rec))
        buf.write(f"\n# table: {s.key}\n")
        w.writerow(names)
        for rec in data:
            w.writerow(["" if rec.get(n) is None else rec[n] for n in names])
    return buf.getvalue()


def render_json(header: dict, results: list[dict], sections: list[Section], messages=()) -> str:
    doc = {"header": header, "messages": list(messages), "results": results}
    for s in sections:
        if s.key != "results_table":           # the pivot is only a view of "results"
            doc[s.key] = s.data if s.data is not None else s.records
    return json.dumps(_json_safe(doc), indent=1) + "\n"


# ---- readers (for tests and for comparing runs) ---------------------------------------------

def _parse(value: str, kind):
    if kind is str:
        return value
    if value == "":
        return None
    if kind is bool:
        if value not in ("True", "False"):
            raise ValueError(f"not a boolean: {value!r}")
        return value == "True"
    return kind(value)


def read_csv(text: str) -> tuple[dict, list[dict]]:
    """(header, results) from ``render_csv`` output (the first table; ``read_csv_tables`` for the others)."""
    header, body = {}, []
    for line in text.splitlines(keepends=True):
        if not line.strip():
            break                                   # the end of the results table
        if line.startswith("# "):
            k, _, v = line[2:].rstrip("\n").partition(": ")
            header[k] = v
        else:
            body.append(line)
    rows = list(csv.reader(body))
    names = rows[0]
    kinds = dict(RESULT_FIELDS)
    return header, [{n: _parse(v, kinds[n]) for n, v in zip(names, row)} for row in rows[1:]]


def read_csv_tables(text: str) -> dict[str, list[dict]]:
    """The extra ``# table: <key>`` blocks of ``render_csv`` output, values as strings."""
    tables, key, block = {}, None, []
    for line in text.splitlines(keepends=True) + ["\n"]:
        if line.startswith("# table: "):
            key, block = line[len("# table: "):].strip(), []
        elif not line.strip():
            if key is not None and block:
                rows = list(csv.reader(block))
                tables[key] = [dict(zip(rows[0], r)) for r in rows[1:]]
            key, block = None, []
        elif key is not None:
            block.append(line)
    return tables


def read_json(text: str) -> dict:
    return json.loads(text)


def read_markdown_tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every pipe table in ``text`` as (title of the ``##`` heading above it, headers, rows)."""
    tables, title, block = [], "", []

    def split(line: str) -> list[str]:
        cells, cur, i, s = [], "", 0, line.strip()[1:-1]
        while i < len(s):
            if s[i] == "\\" and i + 1 < len(s) and s[i + 1] == "|":
                cur += "|"
                i += 2
                continue
            if s[i] == "|":
                cells.append(cur.strip())
                cur = ""
            else:
                cur += s[i]
            i += 1
        cells.append(cur.strip())
        return cells

    def flush():
        if len(block) >= 2:
            tables.append((title, split(block[0]), [split(b) for b in block[2:]]))
        block.clear()

    for line in text.splitlines():
        if line.startswith("## "):
            flush()
            title = line[3:].strip()
        elif line.startswith("|"):
            block.append(line)
        else:
            flush()
    flush()
    return tables


# ---- plot -----------------------------------------------------------------------------------

def matplotlib_missing() -> str | None:
    """None when matplotlib can be imported, else the message to show."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, which is not installed (pip install matplotlib)"
    return None


def plot(results: list[dict], path: str, passes=PASSES, title: str = "") -> None:
    """TFLOP/s against seqlen, one line per implementation; a panel per (pass, dtype, d, causal, ...)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    groups = list(dict.fromkeys((r["dtype"], r["headdim"], r["causal"], r["nheads_k"] != r["nheads"],
                                 r["window_left"], r["window_right"], r["dropout_p"]) for r in results))
    passes = [p for p in passes if any(r["pass"] == p for r in results)] or list(passes)
    fig, axes = plt.subplots(len(passes), max(1, len(groups)), squeeze=False,
                             figsize=(4.2 * max(1, len(groups)), 3.4 * len(passes)))
    impls = list(dict.fromkeys(r["impl"] for r in results))
    for i, p in enumerate(passes):
        for j, g in enumerate(groups):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted((r["seqlen_q"], r["tflops"]) for r in ok
                             if r["impl"] == impl and r["pass"] == p and (
                                 r["dtype"], r["headdim"], r["causal"], r["nheads_k"] != r["nheads"],
                                 r["window_left"], r["window_right"], r["dropout_p"]) == g)
                if pts:
                    style = "-o" if impl.startswith("flashnb") else "--."
                    ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=impl)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["seqlen_q"] for r in results})
            ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{PASS_LABEL[p]}  {g[0]}  d={g[1]}{'  causal' if g[2] else ''}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    handles, labels = {}, {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=min(5, len(handles)),
                   fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)
