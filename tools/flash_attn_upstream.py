"""flash-attn's own tests (its upstream ``tests/test_flash_attn.py``, unmodified) run against flashnb.

    python -m tools.flash_attn_upstream --per-function 40 --out upstream.txt [pytest arguments ...]
    python -m tools.flash_attn_upstream --collect-only          # no GPU needed: the selection, per function

``tools/flash_attn_shim`` goes first on ``sys.path`` (and ``PYTHONPATH``, for pytest-xdist's workers), so the
test file's ``import flash_attn`` gets the shim: flash-attn's public functions on ``flashnb.torch`` and
``flashnb.flash_attn_with_kvcache``. pytest then runs the file with the plugin ``tools.flash_attn_select``,
which keeps a deterministic subset of the ~509,000-case grid (a greedy cover: every value of every parameter,
then value pairs, at most ``--per-function`` cases a function), deselects what flashnb does not offer (the
dropout-mask reads, flash-attn's internals) with the reason, and writes the summary to ``--out`` (rewritten
every 15 s while the run goes on). ``--shard I/N`` runs one of N interleaved parts of the selection and
``--deadline S`` skips the tests that would start after S seconds, so that a run fits calls of limited time.
Arguments it does not know go to pytest (``-n 8``, ``-k kvcache``, ``-x``, ``-v``, ...).

The upstream file is not in the repository: ``.gpu/upstream/test_flash_attn.py`` (git-ignored, travels to the
GPU machine), its commit in ``.gpu/upstream/COMMIT``; tools/README.md says how to fetch it. The file imports
``einops``: where it is not installed, a pure-Python wheel of it in ``.gpu/wheels/`` is put on ``sys.path``
as it is (a wheel is a zip archive Python imports from).
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tools" / "flash_attn_shim"
UPSTREAM = ROOT / ".gpu" / "upstream" / "test_flash_attn.py"
WHEELS = ROOT / ".gpu" / "wheels"


def _wheel_paths(folder, modules=("einops",)):
    """Pure-Python wheels in ``folder`` for the modules not importable here, to go on sys.path."""
    paths = []
    for module in modules:
        if importlib.util.find_spec(module) is None:
            found = sorted(Path(folder).glob(f"{module}-*-py3-none-any.whl"))
            if not found:
                sys.exit(f"{module} is not installed and no {module}-*-py3-none-any.whl is in {folder} "
                         f"(pip download --no-deps -d {folder} {module})")
            paths.append(str(found[-1]))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=Path, default=UPSTREAM, help="flash-attn's tests/test_flash_attn.py")
    parser.add_argument("--per-function", type=int, default=40, help="at most this many cases a test function")
    parser.add_argument("--seed", type=int, default=0, help="seed of the selection's tie-breaking order")
    parser.add_argument("--out", type=Path, default=None, help="write the summary here")
    parser.add_argument("--collect-only", action="store_true", help="list the selection, run nothing")
    parser.add_argument("--capability", default="9.0",
                        help="without a GPU (--collect-only): the compute capability the test module is told")
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help="run the I-th of N interleaved parts of the selection (runs split across calls)")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="skip the tests that would start this long after the start (then 'not run')")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="pure-Python wheels for missing imports")
    args, rest = parser.parse_known_args(argv)
    if not args.upstream.is_file():
        sys.exit(f"{args.upstream} is missing: fetch flash-attn's tests/test_flash_attn.py (tools/README.md)")

    paths = [str(SHIM), str(ROOT), *_wheel_paths(args.wheels)]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    import flash_attn
    if Path(flash_attn.__file__).resolve().parent != SHIM / "flash_attn":
        sys.exit(f"import flash_attn found {flash_attn.__file__}, not the shim in {SHIM}")

    commit_file = args.upstream.parent / "COMMIT"
    commit = commit_file.read_text().split()[0] if commit_file.is_file() else None
    pytest_args = [str(args.upstream), "-p", "tools.flash_attn_select", "-p", "no:cacheprovider",
                   "-c", os.devnull, "--rootdir", str(args.upstream.parent),
                   "--fa-per-function", str(args.per_function), "--fa-seed", str(args.seed),
                   "--fa-capability", args.capability]
    if commit:
        pytest_args += ["--fa-commit", commit]
    if args.shard:
        pytest_args += ["--fa-shard", args.shard]
    if args.deadline is not None:
        pytest_args += ["--fa-deadline", str(args.deadline)]
    if args.out is not None:
        pytest_args += ["--fa-summary", str(args.out.resolve())]
    if args.collect_only:
        pytest_args += ["--collect-only", "-q"]
    import pytest
    return pytest.main(pytest_args + rest)


if __name__ == "__main__":
    sys.exit(main())
