"""``python -m bench``: is flashnb worth it on this GPU, for these shapes?

Flow: parse the options; detect a CUDA device (ctypes, before numba is
imported: without one, numba is switched to its simulator); then

* with a GPU: validate flashnb at toy sizes, time every selected implementation
  on every case and pass with one harness (``bench.harness``), measure the host
  time of one call (``bench.host``), and report results, speed-ups, the IO model
  with measured times, host times and a verdict;
* without one: print the IO-model predictions and a simulator smoke run, and
  say that timings need a GPU.

What runs: without shape, implementation or pass options, the quick set
(``QUICK_*`` in ``bench.cases`` and ``bench.impls``: float16, seqlen 1024 and
4096, head dim 64 and 128, causal or not, fwd and fwd+bwd; flashnb-auto against
sdpa-flash, sdpa-cudnn and torch-materialised; 1-2 minutes on an H100) and the
host-time table; ``--full``: flash-attn's sweep (``DEFAULT_*``) with every
implementation and pass, and the host-time table; any shape, ``--impl`` or
``--pass`` option: the cases they select, the unset ones from the full sweep's
defaults, as before the quick set existed (no host-time table); ``--host``: only
the host-time table.
"""
from __future__ import annotations

import argparse
import signal
import sys

from bench import env
from bench.cases import (DEFAULT_HEADDIMS, DEFAULT_HIDDEN, DEFAULT_SEQLENS, DEFAULT_TOKENS, DTYPES, QUICK_HEADDIMS,
                         QUICK_PASSES, QUICK_SEQLENS, sweep)
from bench.flops import NO_WINDOW, PASSES
from bench.impls import QUICK_IMPLS

EXAMPLES = """\
examples:
  python -m bench                                   # quick set: is it worth it? (1-2 min on an H100)
  python -m bench --full                            # the flash-attn sweep, float16, every implementation (~17 min)
  python -m bench --dtype float32 --pass fwd,fwdbwd --headdims 64,128
  python -m bench --seqlens 1024,4096 --headdims 128 --causal true --impl flashnb,sdpa-flash
  python -m bench --nheads 32 --nheads-k 8 --seqlens 2048           # grouped-query attention
  python -m bench --format json --output run.json --plot run.png
  python -m bench --io                              # only the IO-model table (measured on a GPU)
  python -m bench --host                            # only the host time of one call (tiny shape, launch path)
  python -m bench --varlen                          # only the packed-batch table (varlen vs dense vs padded)
  python -m bench --flex                            # only flex_attention against PyTorch's compiled flex_attention
  python -m bench --decode                          # only the KV-cache decode table (vs SDPA, the HBM bound)
  python -m bench --list                            # which implementations this machine can run
"""


# ---- argument parsing -----------------------------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _choices(allowed):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in values if x not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated), got {text!r}")
        return tuple(dict.fromkeys(values))
    return parse


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (integers, -1 = unbounded), got {text!r}") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"window sizes must be >= -1, got {text!r}")
    return left, right


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def _dropout(text: str) -> float:
    p = float(text)
    if not 0.0 <= p < 1.0:
        raise argparse.ArgumentTypeError(f"dropout must be in [0, 1), got {text!r}")
    return p


def _causal(text: str) -> tuple[bool, ...]:
    table = {"both": (False, True), "true": (True,), "yes": (True,), "false": (False,), "no": (False,)}
    if text.lower() not in table:
        raise argparse.ArgumentTypeError(f"choose both, true or false, got {text!r}")
    return table[text.lower()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Time flashnb against materialised attention (CuPy, PyTorch) and PyTorch SDPA's backends: "
                    "forward, backward and forward+backward; TFLOP/s, peak extra memory, speed-ups; plus the "
                    "IO model of the FlashAttention paper and the host time of one call. By default a quick set "
                    "that answers 'is it worth it?' (1-2 min on an H100); --full for flash-attn's sweep. Without "
                    "a GPU: the IO model and a simulator smoke run.")
    s = p.add_argument_group(
        "shapes (default: the quick set; with --full or any of these options, flash-attn's sweep, "
        "batch*seqlen = 16k tokens, nheads*headdim = 2048)")
    s.add_argument("--dtype", type=_choices(DTYPES), default=None,
                   help="float16, bfloat16, float32 (comma list; default float16)")
    s.add_argument("--seqlens", type=_int_list, default=None, metavar="N,...",
                   help=f"query sequence lengths (default {','.join(map(str, DEFAULT_SEQLENS))}; "
                        f"quick set {','.join(map(str, QUICK_SEQLENS))})")
    s.add_argument("--seqlen-k", type=_positive(int), default=None, metavar="N",
                   help="key sequence length for every case (default: = seqlen; causal is bottom-right aligned)")
    s.add_argument("--headdims", type=_int_list, default=None, metavar="D,...",
                   help=f"head dimensions (default {','.join(map(str, DEFAULT_HEADDIMS))})")
    s.add_argument("--batch", type=_positive(int), default=None, help="batch size (default: tokens // seqlen)")
    s.add_argument("--nheads", type=_positive(int), default=None, help="query heads (default: hidden // headdim)")
    s.add_argument("--nheads-k", type=_positive(int), default=None,
                   help="key/value heads, for grouped-query attention (default: = nheads)")
    s.add_argument("--tokens", type=_positive(int), default=None, help=f"batch * seqlen (default {DEFAULT_TOKENS})")
    s.add_argument("--hidden", type=_positive(int), default=None, help=f"nheads * headdim (default {DEFAULT_HIDDEN})")
    s.add_argument("--cases", default=None, metavar="CASE,...",
                   help="--flex: only these of its cases (causal, document, sliding 1024, alibi, softcap 30, none)")
    s.add_argument("--causal", type=_causal, default=None, metavar="{both,true,false}",
                   help="causal masking (default both)")
    s.add_argument("--window", type=_window, default=None, metavar="LEFT,RIGHT",
                   help="sliding window, -1 = unbounded (default -1,-1)")
    s.add_argument("--dropout", type=_dropout, default=None, metavar="P", help="dropout probability (default 0)")

    w = p.add_argument_group("what to run")
    w.add_argument("--impl", type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()), default=None,
                   metavar="NAME,...", help="implementations or prefixes: flashnb, flashnb-simt, sdpa, sdpa-flash, "
                   "sdpa-cudnn, sdpa-efficient, sdpa-math, torch-materialised, cupy-materialised (default: all; "
                   f"quick set {','.join(QUICK_IMPLS)})")
    w.add_argument("--pass", dest="passes", type=_choices(PASSES), default=None, metavar="fwd,bwd,fwdbwd",
                   help=f"passes to time (default all three; quick set {','.join(QUICK_PASSES)})")
    mode = w.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true",
                      help="flash-attn's sweep: 24 shapes, every implementation and pass (about 17 min on an H100)")
    mode.add_argument("--io", action="store_true", help="only the IO-model table (with measured times on a GPU)")
    mode.add_argument("--decode", action="store_true",
                      help="only the KV-cache decode table (bench/decode.py: batch 16, 32 query heads over 8 KV heads, "
                           "d 128, 4k-32k keys, dense and paged, against SDPA and the HBM bound; needs a GPU)")
    mode.add_argument("--varlen", action="store_true",
                      help="only the packed-batch (varlen) table (bench/varlen.py: random lengths, 16k tokens, d 64 "
                           "and 128, causal or not, fwd and fwd+bwd, against the dense kernels on the same tokens and "
                           "padding to the longest with flashnb and SDPA flash; needs a GPU)")
    mode.add_argument("--flex", action="store_true",
                      help="only the flex_attention table (bench/flex.py: causal, documents, a sliding window, ALiBi, "
                           "softcap at 16k tokens, bf16, d 64 and 128, fwd and fwd+bwd, against PyTorch's "
                           "flex_attention under torch.compile and flashnb's dense call; needs a GPU)")
    mode.add_argument("--model", choices=("llama",), default=None,
                      help="a randomly initialised transformers model's training step and generate() with "
                           "attn_implementation='numba_attention' against SDPA (bench/model.py; its own options "
                           "follow; needs a GPU, torch and transformers)")
    mode.add_argument("--host", action="store_true",
                      help="only the host time of one call (tiny float16 shape, back-to-back calls; needs a GPU)")
    w.add_argument("--list", action="store_true", help="list the implementations and whether they can run here")
    w.add_argument("--no-check", dest="check", action="store_false",
                   help="skip validating flashnb (toy sizes against the oracle; forward against SDPA per case)")

    t = p.add_argument_group("timing")
    t.add_argument("--reps", type=_positive(int), default=30, help="most timed calls per measurement (default %(default)s)")
    t.add_argument("--warmup", type=int, default=3, help="warm-up calls after the first (default %(default)s)")
    t.add_argument("--max-time", type=_positive(float), default=1.0, metavar="SECONDS",
                   help="about how long the timed calls of one measurement may take; fewer reps if slower "
                        "(never below 5) (default %(default)s)")
    t.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default %(default)s)")

    o = p.add_argument_group("output")
    o.add_argument("--format", choices=("table", "markdown", "csv", "json"), default="table",
                   help="report format (default: terminal table)")
    o.add_argument("--output", "-o", metavar="FILE", default=None,
                   help="write the report there (the terminal table still goes to stdout)")
    o.add_argument("--plot", metavar="FILE.png", default=None, help="TFLOP/s against seqlen (needs matplotlib)")
    o.add_argument("--sram-kib", type=_positive(int), default=192,
                   help="SRAM per SM assumed by the IO model (default %(default)s, the paper's A100)")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress indicator on stderr")
    return p


# Options that select cases; unset ones get these defaults (the full sweep's), or the quick set's
# when none of them is given and the run is not --full, --io, --host or --list.
FULL_DEFAULTS = {"dtype": ("float16",), "seqlens": DEFAULT_SEQLENS, "seqlen_k": None, "headdims": DEFAULT_HEADDIMS,
                 "batch": None, "nheads": None, "nheads_k": None, "tokens": DEFAULT_TOKENS, "hidden": DEFAULT_HIDDEN,
                 "causal": (False, True), "window": NO_WINDOW, "dropout": 0.0, "impl": None, "passes": PASSES}
QUICK_DEFAULTS = {"seqlens": QUICK_SEQLENS, "headdims": QUICK_HEADDIMS, "passes": QUICK_PASSES}


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    explicit = [name for name in FULL_DEFAULTS if getattr(args, name) is not None]
    args.quick = not (explicit or args.full or args.io or args.host or args.list)
    for name, default in FULL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK_DEFAULTS.get(name, default) if args.quick else default)
    args.with_host = args.quick or args.full            # the host-time table: in the quick and the full run
    try:
        args.cases = make_cases(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def make_cases(args):
    return sweep(args.dtype, args.seqlens, args.headdims, args.causal, batch=args.batch, nheads=args.nheads,
                 nheads_k=args.nheads_k, seqlen_k=args.seqlen_k, tokens=args.tokens, hidden=args.hidden,
                 window=args.window, dropout_p=args.dropout)


def what_runs(args) -> str:
    """One line for the report header: which set of cases this is."""
    if args.host:
        return "host time only (--host)"
    if args.io:
        return "IO-model table only (--io)"
    n = len(args.cases)
    if args.quick:
        return (f"quick set: {n} cases (float16, N = {','.join(map(str, args.seqlens))}, d = "
                f"{','.join(map(str, args.headdims))}, causal or not), {', '.join(args.passes)}; "
                f"{', '.join(QUICK_IMPLS)}; `--full` for flash-attn's sweep")
    return f"{'full sweep (--full)' if args.full else 'selected cases'}: {n} cases, {', '.join(args.passes)}"


def _smoke(args):
    """Validation at toy size: the quick set checks what it times, flashnb-auto at float16 (fewer kernels to
    compile: about half the validation's time on a GPU); other runs every backend at float32 and float16."""
    from bench.smoke import smoke_run
    if args.quick:
        return smoke_run(("float16",), backends=("auto",))
    return smoke_run()


def _io_cases(args):
    from bench.io_table import io_cases
    return io_cases(args.dtype[0], args.seqlens, args.headdims, batch=args.batch, nheads=args.nheads,
                    nheads_k=args.nheads_k, seqlen_k=args.seqlen_k, tokens=args.tokens, hidden=args.hidden)


# ---- the two paths --------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--model" in argv or any(a.startswith("--model=") for a in argv):
        from bench.model import main as model_main      # (its options are its own: parsed there)
        return model_main(argv)
    args = parse_args(argv)
    if args.decode:
        from bench.decode import main as decode_main
        return decode_main(sys.argv[1:] if argv is None else list(argv))
    if args.varlen:
        from bench.varlen import main as varlen_main
        return varlen_main(sys.argv[1:] if argv is None else list(argv))
    if args.flex:
        from bench.flex import main as flex_main
        return flex_main(sys.argv[1:] if argv is None else list(argv))
    if args.plot:
        from bench.report import matplotlib_missing
        missing = matplotlib_missing()
        if missing:
            print(f"error: {missing}", file=sys.stderr)
            return 2
    simulator = env.use_simulator_if_no_gpu()      # before anything imports numba
    argv = sys.argv[1:] if argv is None else list(argv)
    if simulator:
        return run_without_gpu(args, argv)
    return run_with_gpu(args, argv)


def _smoke_section(records):
    from bench.report import Column, Section
    cols = [Column("impl", "impl"), Column("dtype", "dtype"), Column("shape", "shape"), Column("status", "status"),
            Column("max_error", "max |err|", lambda x: "" if x is None else f"{x:.1e}"),
            Column("tolerance", "tolerance"), Column("detail", "detail")]
    return Section("validation", "Validation: flashnb against the oracle (reference.attention, float64) at toy size",
                   cols, records)


def _emit(args, header, results, sections, messages) -> None:
    from bench.report import render
    if args.output:
        with open(args.output, "w") as f:
            f.write(render(args.format, header, results, sections, messages))
        sys.stdout.write(render("table", header, results, sections, messages))
        print(f"# report written to {args.output} ({args.format})")
    else:
        sys.stdout.write(render(args.format, header, results, sections, messages))


def _list(impls) -> None:
    from tabulate import tabulate
    rows = [[i.name, i.family, "yes" if not i.unavailable else f"no: {i.unavailable}"] for i in impls]
    print(tabulate(rows, ["implementation", "family", "can run here"], tablefmt="simple"))


def run_without_gpu(args, argv) -> int:
    """IO-model predictions and a simulator smoke run; timings need a GPU."""
    from bench.io_table import io_section
    from bench.impls import Impl, Libraries, all_impls
    header = env.header(argv, {"driver": env.driver_version(), "cuda_driver": env.driver_cuda_version()},
                        simulator=True)
    header["cases"] = what_runs(args)
    messages = ["No CUDA device found (or NUMBA_ENABLE_CUDASIM=1): timings need a GPU. Shown instead: the IO "
                "model's predictions and a smoke run of flashnb in Numba's CUDA simulator at toy sizes."]
    if args.host:
        messages = ["No CUDA device found (or NUMBA_ENABLE_CUDASIM=1): the host time of a call needs a GPU "
                    "(CUDA tensors, real launches); run `python -m bench --host` on a GPU machine."]
        _emit(args, header, [], [], messages)
        print("flashnb bench: no CUDA device, so no host times.", file=sys.stderr)
        return 0
    if args.list:
        libs = Libraries(why_not={"torch": "no CUDA device", "cupy": "no CUDA device"})
        try:
            import flashnb
            libs.flashnb = flashnb
        except ImportError as exc:
            libs.why_not["flashnb"] = str(exc)
        impls = [Impl(i.name, i.family, i.make, unavailable=i.unavailable or "no CUDA device (simulator only)")
                 for i in all_impls(libs)]
        _list(impls)
        return 0
    sections = [io_section(_io_cases(args), [], args.sram_kib * 1024, measured=False)]
    smoke = []
    if args.check:
        smoke = _smoke(args)
        sections.insert(0, _smoke_section(smoke))
    if args.plot:
        messages.append(f"--plot {args.plot}: nothing to plot without timings (needs a GPU)")
    _emit(args, header, [], sections, messages)
    print("flashnb bench: no CUDA device, so no timings; run `python -m bench` on a GPU machine for them.",
          file=sys.stderr)
    return 1 if any(r["status"] == "FAIL" for r in smoke) else 0


def _import_libraries():
    """torch, cupy, flashnb: each if importable and able to see the GPU; otherwise why not."""
    from bench.impls import Libraries
    libs = Libraries()
    try:
        import torch
        if torch.cuda.is_available():
            libs.torch = torch
        else:
            libs.why_not["torch"] = "installed, but torch.cuda.is_available() is False"
    except ImportError as exc:
        libs.why_not["torch"] = f"not installed ({exc})"
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        libs.cupy = cupy
    except ImportError as exc:
        libs.why_not["cupy"] = f"not installed ({exc})"
    except Exception as exc:                                # noqa: BLE001 - e.g. CUDA runtime mismatch
        libs.why_not["cupy"] = f"{type(exc).__name__}: {exc}"
    try:
        import flashnb
        libs.flashnb = flashnb
    except Exception as exc:                                # noqa: BLE001 - report, time the rest
        libs.why_not["flashnb"] = f"import failed: {type(exc).__name__}: {exc}"
    return libs


def _stop_cleanly_on_sigterm():
    """``timeout`` and job schedulers send SIGTERM: treat it as Ctrl-C, so the results so far are written."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        signal.signal(signal.SIGTERM, interrupt)
    except ValueError:                                      # not the main thread (embedded use): leave it
        pass


def _precompile(args, messages) -> None:
    """The quick set's kernels (and the validation's) compiled in parallel processes into flashnb's disk cache
    (``flashnb.precompile``), so the run does not wait on one compile after another; found there on later runs."""
    import time
    from numba import cuda
    from bench.smoke import SMOKE_CAUSAL, SMOKE_SHAPE
    from flashnb.kernels._jit import SIMULATOR
    from flashnb.precompile import precompile
    if SIMULATOR or not cuda.is_available():           # a fake device (the tests): nothing to compile
        return
    tasks = sorted({(c.dtype, c.headdim, c.causal) for c in make_cases(args) if c.dtype in ("float16", "float32")}
                   | {("float16", SMOKE_SHAPE[-1], SMOKE_CAUSAL)})
    start = time.perf_counter()
    rows = precompile(tasks)
    compiled = sum(r["how"].startswith("compiled") for r in rows)
    failed = [r for r in rows if r["how"] == "failed"]
    messages.append(f"kernels: {compiled} compiled, {len(rows) - compiled - len(failed)} found in the disk cache, "
                    f"in {len(tasks)} parallel processes, {time.perf_counter() - start:.1f} s"
                    + (f"; {len(failed)} tasks failed: {failed[0]['entry']}" if failed else ""))


def run_with_gpu(args, argv) -> int:
    from bench import report
    from bench.gpu import Gpu, install_numba_memory_counter
    from bench.harness import DeviceLost, Progress, Settings, run_sweep
    from bench.impls import CaseData, all_impls, quick_select, select
    from bench.io_table import FIGURE2_LABEL, STANDARD_IMPLS, io_section

    messages = []
    import numpy
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 5):
        messages.append(f"numpy {numpy.__version__}: numba-cuda 0.30 cannot compile kernels under numpy >= 2.5 "
                        "(numba-cuda issue 907); put numpy 2.4 first on the path, or flashnb rows will be n/a")
    why = install_numba_memory_counter()                    # before flashnb creates Numba's context
    if why:
        messages.append(why)
    libs = _import_libraries()
    try:
        impls = quick_select(all_impls(libs)) if args.quick else select(all_impls(libs), args.impl)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        _list(impls)
        return 0
    gpu = Gpu(libs.torch, libs.cupy) if (libs.torch or libs.cupy) else None
    device = {"driver": env.driver_version(), "cuda_driver": env.driver_cuda_version()}
    if gpu is not None:
        device.update(gpu.info())
    header = env.header(argv, device, simulator=False)
    header["cases"] = what_runs(args)
    if args.host:
        return _host_only(args, header, libs, messages)
    settings = Settings(warmup=args.warmup, reps=args.reps, max_time_s=args.max_time, seed=args.seed,
                        check=args.check)
    header["timing"] = (f"median of <= {args.reps} calls (~{args.max_time} s per measurement, >= 5 calls) after "
                        f"1 + {args.warmup} warm-up calls; L2 flushed before each call; CUDA events, default stream")
    header["flops"] = ("fwd = 4*B*H*Nq*Nk*d (halved when causal and Nq == Nk, else exact unmasked pairs); "
                       "bwd = 2.5 fwd; fwd+bwd = 3.5 fwd")
    header["memory"] = ("MiB: peak allocated during one call minus allocated before it (torch + cupy pool + numba); "
                        "bwd: beyond the forward's saved state")
    if libs.torch is not None:
        header["torch_tf32_matmul"] = str(libs.torch.backends.cuda.matmul.allow_tf32)
    runnable = [i for i in impls if not i.unavailable]
    for i in impls:
        if i.unavailable:
            messages.append(f"not measured: {i.name} ({i.unavailable})")

    sections, smoke = [], []
    if args.quick:
        _precompile(args, messages)
    if args.check:
        smoke = _smoke(args)
        sections.append(_smoke_section(smoke))
        if any(r["status"] == "FAIL" for r in smoke):
            messages.append("flashnb FAILED validation at toy size: its timings below measure wrong results")
    if gpu is None:
        messages.append("timings need PyTorch or CuPy to drive the GPU (events, inputs); neither is usable: "
                        + "; ".join(f"{k}: {v}" for k, v in libs.why_not.items()))
        sections.append(io_section(_io_cases(args), [], args.sram_kib * 1024, measured=False))
        _emit(args, header, [], sections, messages)
        return 1

    _stop_cleanly_on_sigterm()
    make_data = lambda case: CaseData(gpu, case, args.seed, libs.cupy)
    io_cases = _io_cases(args)
    io_impls = [i for i in runnable if i.family == "flashnb" or i.name in STANDARD_IMPLS]
    io_passes = tuple(p for p in ("fwd", "bwd") if p in args.passes) or ("fwd", "bwd")
    if args.io:
        plan = [([c for _, c in io_cases], io_impls, io_passes)]
    else:
        main_cases = set(args.cases)          # the sweep's rows of the IO table come from the main results
        extra = [c for label, c in io_cases if label == FIGURE2_LABEL and c not in main_cases]
        plan = [(args.cases, runnable, args.passes), (extra, io_impls, io_passes)]
    total = sum(len(c) * len(i) * len(p) for c, i, p in plan)
    progress = Progress(total, enabled=not args.quiet)
    runs, exit_code = [], 0
    try:
        for cases, chosen, passes in plan:
            runs.append([r.record() for r in run_sweep(cases, chosen, passes, gpu, settings, make_data, progress)])
    except (DeviceLost, KeyboardInterrupt) as exc:
        runs.append([r.record() for r in getattr(exc, "partial_results", [])])
        what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped: the device was lost ({exc})"
        messages.append(f"sweep {what}; the tables hold the results so far")
        exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 1

    host = []
    if args.with_host and exit_code == 0:
        try:
            host = _measure_host(libs, messages)
        except KeyboardInterrupt:
            messages.append("host-time measurement interrupted; the sweep's tables are complete")
            exit_code = 130

    results = runs[0] if runs else []
    io_results = [r for run in runs for r in run]
    if any("MISMATCH" in r["note"] for r in results):
        messages.append("some flashnb forward results differ from torch SDPA (see MISMATCH notes)")
    passes = args.passes if not args.io else io_passes
    speedups = report.speedups(results)
    summary = report.summary_records(speedups, passes)
    sections.append(report.results_section(results, passes))
    sections += [report.speedup_section(speedups, p, results) for p in passes]
    sections.append(io_section(io_cases, io_results, args.sram_kib * 1024, measured=True))
    if host:
        from bench.host import host_section
        sections.append(host_section(host))
    sections.append(report.summary_section(summary, passes))
    _emit(args, header, results, sections, messages)
    if args.plot:
        report.plot(results, args.plot, passes, title=f"{header['device']}  {header['date']}")
        print(f"# plot written to {args.plot}")
    if any(r["status"] == "FAIL" for r in smoke):
        exit_code = exit_code or 1
    return exit_code


def _measure_host(libs, messages) -> list[dict]:
    """The host-time records (``bench.host``), or [] with a message when PyTorch cannot drive the GPU."""
    if libs.torch is None:
        messages.append(f"host time not measured: it needs PyTorch with CUDA ({libs.why_not.get('torch')})")
        return []
    from bench.host import measure_host
    try:
        import flashnb.torch  # noqa: F401
    except Exception as exc:                                # noqa: BLE001 - the table says it per row too
        messages.append(f"flashnb.torch does not import ({type(exc).__name__}: {exc}): its host-time rows are n/a")
    return measure_host(libs.torch)


def _host_only(args, header, libs, messages) -> int:
    """``--host``: only the host-time table."""
    from bench.host import host_section
    _stop_cleanly_on_sigterm()
    try:
        host = _measure_host(libs, messages)
    except KeyboardInterrupt:
        messages.append("interrupted")
        _emit(args, header, [], [], messages)
        return 130
    _emit(args, header, [], [host_section(host)] if host else [], messages)
    return 0 if host else 1
