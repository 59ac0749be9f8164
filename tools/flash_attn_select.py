"""pytest plugin: a deterministic subset of flash-attn's upstream ``tests/test_flash_attn.py`` for the flashnb shim.

Loaded by ``python -m tools.flash_attn_upstream`` (``-p tools.flash_attn_select``); see that module and
tools/README.md. The upstream grid is about 509,000 cases (at compute capability 9.0), which pytest alone takes
~40 s and ~3 GB to collect. This plugin cuts it where it is made, in ``pytest_generate_tests``: for each
parametrised test function it builds the grid of its ``parametrize`` marks as value indices, drops the cases
listed in ``CASE_RULES`` (each with its reason), and keeps a greedy cover of the rest:

1. every value of every parameter at least once (a mark over several names, ``seqlen_q,seqlen_k``, is one
   parameter);
2. then as many pairs of values of two parameters as fit, at most ``--fa-per-function`` cases a function.

Each step takes the case covering the most values not yet covered (then the most pairs), ties broken by a
seeded random order (``--fa-seed``); grids above ``CANDIDATES`` cases are first sampled (seeded, every value
kept). The kept cases become one ``parametrize`` call whose ids are pytest's own for the same values, so a
node id reads as in a plain run. Functions in ``DESELECTED_FUNCTIONS`` are deselected whole; those in
``KNOWN_DIFFERENCES`` run, marked ``xfail`` (not strict, for their ``pytest.raises`` failing only) with the reason.

``--fa-summary FILE`` writes the selection (grid, cases dropped per reason, kept, pairs covered) and the
outcomes per function, every deselection with its reason and each failure's first line. Under pytest-xdist the
workers make the selection and hand it to the controller (``workeroutput``), which writes the file.

Without a CUDA device only ``--collect-only`` works: the upstream module reads
``torch.cuda.get_device_capability("cuda")`` when imported, so the plugin answers ``--fa-capability``
(default 9.0, the H100's) there.
"""
import hashlib
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

# ------------------------------------------------------------------------------------------------ the rules
_DMASK = ("reads S_dmask (return_attn_probs=True with dropout_p > 0) to rebuild the dropout mask and the "
          "probabilities: flashnb never materialises them (the shim raises NotImplementedError), and flashnb "
          "defines no dropout for packed (varlen) batches")
_DMASK_ASKED = ("asks for S_dmask (return_attn_probs=True with dropout_p > 0) and discards it: the shim raises "
                "NotImplementedError rather than hand back a stand-in")
_SELF_SKIP = "the upstream test skips these itself (pytest.skip at the top of its body)"

# function -> [(predicate on the case's parameters, reason)]
CASE_RULES = {
    "test_flash_attn_qkvpacked": [(lambda p: p["dropout_p"] > 0, _DMASK)],
    "test_flash_attn_varlen_qkvpacked": [(lambda p: p["dropout_p"] > 0, _DMASK)],
    "test_flash_attn_output": [(lambda p: p["dropout_p"] > 0, _DMASK)],
    "test_flash_attn_varlen_output": [(lambda p: p["dropout_p"] > 0, _DMASK)],
    "test_flash_attn_race_condition": [(lambda p: p["dropout_p"] > 0, _DMASK_ASKED)],
    "test_flash_attn_kvcache": [
        (lambda p: (p["seqlen_q"] > p["seqlen_k"] and p["new_kv"])
         or (not p["new_kv"] and p["rotary_fraction"] > 0.0)
         or (p["has_batch_idx"] and p["paged_kv_block_size"] is not None)
         or (p["has_leftpad"] and p["paged_kv_block_size"] is not None), _SELF_SKIP)],
}

DESELECTED_FUNCTIONS = {
    "test_flash_attn_varlen_paged_kv_num_splits":
        "calls flash-attn's private _flash_attn_varlen_forward (its C++ entry point) with seqused_k and "
        "num_splits, and expects its RuntimeError for num_splits > 1: flashnb's packed call has neither "
        "parameter and no such internal",
    "test_flash_attn_generator_arg_must_be_none":
        "calls flash-attn's C++ extension flash_attn_gpu.fwd/bwd/varlen_fwd/varlen_bwd directly (its "
        "positional 'generator' slot): nothing in flashnb answers to it",
}

KNOWN_DIFFERENCES = {
    "test_flash_attn_kvcache_paged_block_table_bounds":
        "expects RuntimeError('...block_table...') when cache_seqlens (a CUDA tensor) passes the block table's "
        "capacity; flashnb by design never copies device metadata to the host: its kernels check each entry and "
        "give that sequence NaN rows and no append (docs/reference.md, flash_attn_with_kvcache), and host values raise "
        "ValueError",
}

_CONFIG = None          # the session's config (pytest_runtest_logreport is not handed it)
CANDIDATES = 20000      # grids larger than this are sampled (seeded, every value kept) before the greedy cover


# ------------------------------------------------------------------------------------------------ the cover
def greedy_cover(grid, budget, seed=0, candidates=CANDIDATES):
    """Row indices of ``grid`` (an ``(n, m)`` integer array: n cases, each the value index of m parameters)
    chosen greedily: first every (parameter, value) present at least once, then as many (parameter pair, value
    pair) as fit, at most ``budget`` rows; ties broken by a random order drawn from ``seed``. Returns the
    indices in grid order and ``(pairs covered, pairs present)``."""
    grid = np.asarray(grid, dtype=np.int64)
    n, m = grid.shape if grid.ndim == 2 else (len(grid), 0)
    if n == 0 or budget <= 0:
        return [], (0, 0)
    rng = np.random.default_rng(seed)
    rows = np.arange(n)
    if n > candidates:              # a seeded sample, plus a row for each value it lacks
        rows = np.sort(rng.choice(n, size=candidates, replace=False))
        for j in range(m):
            missing = np.setdiff1d(np.unique(grid[:, j]), np.unique(grid[rows, j]))
            extra = [int(np.flatnonzero(grid[:, j] == value)[0]) for value in missing]
            rows = np.union1d(rows, np.array(extra, dtype=np.int64))
    sub = grid[rows]
    sizes = grid.max(axis=0) + 1 if m else np.zeros(0, np.int64)
    # feature ids: (parameter, value) singles, then (parameter pair, value pair)
    columns, offset = [], 0
    for j in range(m):
        columns.append(offset + sub[:, j])
        offset += int(sizes[j])
    n_single = offset
    for i, j in itertools.combinations(range(m), 2):
        columns.append(offset + sub[:, i] * sizes[j] + sub[:, j])
        offset += int(sizes[i] * sizes[j])
    features = np.stack(columns, axis=1) if columns else np.zeros((len(rows), 0), np.int64)
    present = np.bincount(features.ravel(), minlength=offset) > 0
    weight = np.zeros(offset, np.int64)
    weight[:n_single] = offset + 1                  # one new value outweighs every pair
    weight[n_single:] = 1
    weight[~present] = 0
    tiebreak = rng.random(len(rows))
    taken = np.zeros(len(rows), bool)
    chosen = []
    while len(chosen) < budget:
        score = weight[features].sum(axis=1)
        if not score.any():
            break
        score = np.where(taken, -1.0, score + tiebreak)
        best = int(np.argmax(score))
        if score[best] < 1:
            break
        chosen.append(best)
        taken[best] = True
        weight[features[best]] = 0
    pairs_present = int(present[n_single:].sum())
    pairs_left = int((weight[n_single:] > 0).sum())
    return sorted(int(rows[i]) for i in chosen), (pairs_present - pairs_left, pairs_present)


# ------------------------------------------------------------------------------------------------ pytest hooks
def pytest_addoption(parser):
    group = parser.getgroup("flash_attn_select", "flash-attn upstream tests on flashnb (tools/flash_attn_select.py)")
    group.addoption("--fa-per-function", type=int, default=40, help="at most this many cases a test function")
    group.addoption("--fa-seed", type=int, default=0, help="seed of the cover's tie-breaking order")
    group.addoption("--fa-summary", default=None, help="write the selection and the outcomes to this file")
    group.addoption("--fa-capability", default="9.0",
                    help="without a CUDA device (--collect-only only): the capability the module is told")
    group.addoption("--fa-commit", default=None, help="the upstream commit, for the summary")
    group.addoption("--fa-shard", default=None, metavar="I/N",
                    help="run only the I-th of N interleaved parts of the selection (0 <= I < N)")
    group.addoption("--fa-deadline", type=float, default=None, metavar="SECONDS",
                    help="skip the tests that would start this long after the session began (counted 'not "
                         "run'; xdist's workers count from the controller's start)")


class _State:
    def __init__(self):
        self.functions = {}     # name -> selection record
        self.outcomes = {}      # name -> {outcome: count}
        self.failures = []      # (nodeid, first line)
        self.started = time.time()
        self.written = self.started


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config
    config._fa = _State()
    # one clock for the session: xdist's workers (started later) inherit the controller's start
    config._fa.started = float(os.environ.setdefault("FLASH_ATTN_SELECT_T0", repr(time.time())))
    import torch
    if not torch.cuda.is_available():
        if not config.option.collectonly:
            raise pytest.UsageError("flash-attn's upstream tests need a CUDA device (they allocate on "
                                    "device='cuda'); without one only --collect-only works")
        major, minor = (int(x) for x in config.getoption("fa_capability").split("."))
        config._fa_original_capability = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda device=None: (major, minor)


def pytest_unconfigure(config):
    original = getattr(config, "_fa_original_capability", None)
    if original is not None:
        import torch
        torch.cuda.get_device_capability = original


class _Set:
    """A parameter set where pytest's own cannot be had: its values, no marks."""
    def __init__(self, values):
        self.values, self.marks = values, ()


def _param_ids(metafunc, mark):
    """One parametrize mark's names, parameter sets and ids: pytest's own (its id maker, as in a plain run), or,
    where this pytest's internals differ from 9.x's, a plain reading of the mark with simple ids."""
    nodeid = metafunc.definition.nodeid
    try:
        from _pytest.mark.structures import ParameterSet
        argnames, psets = ParameterSet._for_parametrize(*mark.args[:2], metafunc.function, metafunc.config,
                                                        nodeid=nodeid)
        ids = metafunc._resolve_parameter_set_ids(argnames, mark.kwargs.get("ids"), psets, nodeid=nodeid)
    except Exception:  # noqa: BLE001 - another pytest's internals: readable ids all the same
        names, values = mark.args[:2]
        argnames = [a.strip() for a in names.split(",")] if isinstance(names, str) else list(names)
        psets = [_Set(tuple(v) if len(argnames) > 1 else (v,)) for v in values]
        ids = ["-".join(str(v) if v is None or isinstance(v, (str, int, float, bool)) else f"{a}{k}"
                        for a, v in zip(argnames, ps.values)) for k, ps in enumerate(psets)]
    return list(argnames), psets, [str(i) for i in ids]


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    name = metafunc.function.__name__
    config = metafunc.config
    state = config._fa
    own = metafunc.definition.own_markers
    marks = [m for m in own if m.name == "parametrize"]
    if not marks or name in DESELECTED_FUNCTIONS:
        return
    if len(marks) != len(list(metafunc.definition.iter_markers("parametrize"))) or any(
            set(m.kwargs) - {"ids"} for m in marks):
        state.functions[name] = dict(grid=None, note="left to pytest (parametrize marks it does not reduce)")
        return
    dims = [_param_ids(metafunc, mark) for mark in marks]
    sizes = [len(psets) for _, psets, _ in dims]
    grid = np.array(list(itertools.product(*(range(s) for s in sizes))), dtype=np.int64).reshape(-1, len(dims))
    params = lambda row: {a: v for (names, psets, _), k in zip(dims, row)  # noqa: E731
                          for a, v in zip(names, psets[k].values)}
    keep = np.ones(len(grid), bool)
    dropped = []
    for predicate, reason in CASE_RULES.get(name, []):
        hit = np.array([keep[r] and bool(predicate(params(grid[r]))) for r in range(len(grid))], bool)
        keep &= ~hit
        dropped.append((reason, int(hit.sum())))
    rows = np.flatnonzero(keep)
    chosen, (pairs_done, pairs_all) = greedy_cover(grid[rows], config.getoption("fa_per_function"),
                                                   config.getoption("fa_seed"))
    chosen = rows[chosen]
    uncovered = []
    for j, (names, psets, ids) in enumerate(dims):
        seen = set(grid[chosen, j].tolist())
        uncovered += [f"{','.join(names)}={ids[k]}" for k in sorted(set(grid[rows, j].tolist()) - seen)]
    state.functions[name] = dict(grid=len(grid), dropped=dropped, selected=len(chosen),
                                 pairs=[pairs_done, pairs_all], uncovered=uncovered)
    # the kept cases as one parametrize call (ids as pytest would make them), the marks taken off the definition
    metafunc.definition.own_markers = [m for m in own if m.name != "parametrize"]
    argnames = [a for names, _, _ in dims for a in names]
    values = []
    for row in grid[chosen]:
        vals, case_marks, ids = [], [], []
        for (names, psets, pids), k in zip(dims, row):
            vals += list(psets[k].values)
            case_marks += list(psets[k].marks)
            ids.append(pids[k])
        values.append(pytest.param(*vals, marks=case_marks, id="-".join(ids)))
    metafunc.parametrize(argnames, values)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    state = config._fa
    counted = {n for n, r in state.functions.items() if r.get("grid") is not None}   # counted when generated
    kept, gone = [], []
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name not in counted:         # not parametrised, deselected whole, or left to pytest: counted here
            rec = state.functions.setdefault(name, dict(grid=0, selected=0))
            rec["grid"], rec["selected"] = rec.get("grid") or 0, rec.get("selected", 0)
            rec["grid"] += 1
            if name in DESELECTED_FUNCTIONS:
                rec["deselected_whole"] = True
            else:
                rec["selected"] += 1
        if name in DESELECTED_FUNCTIONS:
            gone.append(item)
            continue
        if name in KNOWN_DIFFERENCES:
            # only its pytest.raises failing ("DID NOT RAISE") is expected; any other error still fails
            item.add_marker(pytest.mark.xfail(reason=KNOWN_DIFFERENCES[name], raises=pytest.fail.Exception,
                                              strict=False))
        kept.append(item)
    if hasattr(config, "workerinput") and config.getoption("fa_summary"):   # for the controller's summaries
        side = _selection_file(config)                                      # while the run goes on
        tmp = side.with_name(side.name + "." + config.workerinput["workerid"])
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(state.functions))
        os.replace(tmp, side)
    shard = config.getoption("fa_shard")
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        gone += [item for k, item in enumerate(kept) if k % count != index]
        kept = [item for k, item in enumerate(kept) if k % count == index]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = kept


_DEADLINE = "flash_attn_select: past --fa-deadline"


def pytest_runtest_setup(item):
    deadline = item.config.getoption("fa_deadline")
    if deadline is not None and time.time() - item.config._fa.started > deadline:
        pytest.skip(_DEADLINE)


def _function_of(nodeid):
    return nodeid.split("::")[-1].split("[")[0]


def pytest_runtest_logreport(report):
    config = _CONFIG
    if config is None or hasattr(config, "workerinput"):    # an xdist worker: the controller tallies
        return
    state = config._fa
    xfail = hasattr(report, "wasxfail")
    outcome = None
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif report.when == "call":
        outcome = ("xpassed" if xfail else "passed") if report.passed else ("xfailed" if xfail else "skipped")
    elif report.when == "setup" and report.skipped:
        outcome = "xfailed" if xfail else "skipped"
    if outcome == "skipped" and isinstance(report.longrepr, tuple) and _DEADLINE in str(report.longrepr[-1]):
        outcome = None                  # past the deadline: counted in "not run"
    if outcome is None:
        return
    tally = state.outcomes.setdefault(_function_of(report.nodeid), {})
    tally[outcome] = tally.get(outcome, 0) + 1
    if outcome in ("failed", "error"):
        crash = getattr(report.longrepr, "reprcrash", None)
        text = (crash.message if crash is not None else str(report.longrepr)).strip()
        state.failures.append((report.nodeid, f"{outcome} ({report.when}): "
                               + (text.splitlines()[0][:300] if text else "")))
    if config.getoption("fa_summary") and time.time() - state.written > 15:    # a killed run keeps a summary
        _write_summary(config)


def _selection_file(config):
    return Path(config.getoption("fa_summary") + ".selection.json")


def _write_summary(config, final=False):
    side = _selection_file(config)
    if not config._fa.functions and side.is_file():        # xdist: the workers' selection, before they finish
        config._fa.functions = json.loads(side.read_text())
    if final and side.is_file():
        side.unlink()
    out = Path(config.getoption("fa_summary"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(summary_lines(config)) + "\n")
    config._fa.written = time.time()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    config = session.config
    if hasattr(config, "workerinput"):              # an xdist worker: its selection goes to the controller
        config.workeroutput["fa_functions"] = json.dumps(config._fa.functions)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    state = node.config._fa
    data = getattr(node, "workeroutput", {}).get("fa_functions")
    if data and not state.functions:
        state.functions = json.loads(data)


def summary_lines(config):
    """The summary: the selection and the outcomes per function, the deselections with their reasons, the known
    differences and the failures."""
    state = config._fa
    args = config.invocation_params.args
    upstream = [Path(a) for a in args if str(a).endswith(".py") and Path(a).is_file()]
    lines = ["flash-attn's upstream tests/test_flash_attn.py on flashnb (tools/flash_attn_shim)", ""]
    for path in upstream:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        lines.append(f"upstream file: {path} (sha256 {digest}...)")
    commit = config.getoption("fa_commit")
    if commit:
        lines.append(f"upstream commit: {commit}")
    import torch
    device = (f"{torch.cuda.get_device_name()} (capability {'.'.join(map(str, torch.cuda.get_device_capability()))})"
              if torch.cuda.is_available() else
              f"none: collection only, capability taken as {config.getoption('fa_capability')}")
    lines += [f"device: {device}", f"torch {torch.__version__}, pytest {pytest.__version__}",
              f"selection: greedy cover (every value of every parameter, then value pairs), at most "
              f"{config.getoption('fa_per_function')} cases a function, seed {config.getoption('fa_seed')}",
              f"pytest arguments: {' '.join(map(str, args))}",
              f"wall time: {time.time() - state.started:.0f} s"
              + ("" if config.getoption("fa_shard") is None else f"; shard {config.getoption('fa_shard')} only"),
              ""]
    kinds = ["passed", "failed", "error", "skipped", "xfailed", "xpassed"]
    header = ["function", "grid", "rules drop", "selected", "pairs", *kinds, "not run"]
    table = []
    totals = dict.fromkeys(header[1:], 0)
    for name in sorted(set(state.functions) | set(state.outcomes)):
        rec = state.functions.get(name, {})
        tally = state.outcomes.get(name, {})
        dropped = sum(c for _, c in rec.get("dropped", []))
        selected = rec.get("selected", 0)
        ran = sum(tally.get(k, 0) for k in kinds)         # (an error in setup: not run; in teardown: rare)
        pairs = rec.get("pairs")
        row = [name, rec.get("grid", "?"), dropped, selected,
               f"{pairs[0]}/{pairs[1]}" if pairs else "-", *(tally.get(k, 0) for k in kinds),
               max(0, selected - ran)]
        if rec.get("deselected_whole"):
            row[3] = "deselected"
        table.append(row)
        for key, value in zip(header[1:], row[1:]):
            if isinstance(value, int):
                totals[key] += value
    table.append(["total", *(totals[k] if k != "pairs" else "" for k in header[1:])])
    widths = [max(len(str(r[i])) for r in [header] + table) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)  # noqa: E731
                              for i, (v, w) in enumerate(zip(r, widths)))
    lines += [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, table), ""]
    lines.append("grid: the function's parametrised cases; rules drop: cases removed by the rules below; "
                 "pairs: value pairs of two parameters covered / present after the rules; not run: selected but "
                 "without an outcome (another shard, -k, past --fa-deadline, stopped early)")
    lines += ["", "Cases deselected, with the reason:"]
    for name in sorted(state.functions):
        for reason, count in state.functions[name].get("dropped", []):
            lines.append(f"  {name}: {count} cases: {reason}")
    lines += ["", "Functions deselected whole:"]
    lines += [f"  {name}: {reason}" for name, reason in DESELECTED_FUNCTIONS.items()]
    lines += ["", "Known differences (run, marked xfail, not strict):"]
    lines += [f"  {name}: {reason}" for name, reason in KNOWN_DIFFERENCES.items()]
    uncovered = [(n, r["uncovered"]) for n, r in sorted(state.functions.items()) if r.get("uncovered")]
    if uncovered:
        lines += ["", "Parameter values not covered (raise --fa-per-function):"]
        lines += [f"  {n}: {', '.join(u)}" for n, u in uncovered]
    if state.failures:
        lines += ["", f"Failures and errors ({len(state.failures)}):"]
        lines += [f"  {nodeid}\n      {message}" for nodeid, message in state.failures]
    return lines


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not hasattr(config, "_fa"):
        return
    lines = summary_lines(config)
    terminalreporter.section("flash-attn upstream on flashnb")
    for line in lines:
        terminalreporter.write_line(line)
    if config.getoption("fa_summary"):
        _write_summary(config, final=True)
        terminalreporter.write_line(f"summary written to {os.fspath(config.getoption('fa_summary'))}")
