"""The planner (flashnb/plan.py) on a table of calls: which backend, which tiles, which grid, which refusal.

The device is the H100 as the planner sees it (compute capability 9.0, 227 KB of shared memory per block),
patched in, so the GPU's tile tables are what is chosen here, in the simulator as on a GPU; one row takes a
99 KB device (8.6 / 8.9) and one a 7.5.  No kernel runs: the plans are checked, not launched.
"""
import pytest

from flashnb import _options, plan
from flashnb.kernels.backward import cast_grid
from flashnb.kernels.backward_tc import make_dkdv_tc

NO_OPTIONS = _options.Flags(*([False] * 7))
CAUSAL = _options.Flags(True, *([False] * 6))
SOFTCAP = _options.Flags(True, False, False, True, False, False, False)
H100 = dict(cc=(9, 0), limit=227 * 1024)


@pytest.fixture
def device(monkeypatch):
    """``device(cc=, limit=)``: the planner sees a GPU of that compute capability and shared memory per block."""
    def set_device(cc, limit):
        monkeypatch.setattr(plan, "SIMULATOR", False)
        monkeypatch.setattr(plan, "compute_capability", lambda: cc)
        monkeypatch.setattr(plan, "shared_limit", lambda: limit)
    return set_device


def call(dtype="float16", headdim=64, *, batch=2, seqlen_q=1000, seqlen_k=1500, nheads=8, nheads_k=2,
         flags=NO_OPTIONS, block_q=None, block_k=None, backend="auto", deterministic=False, layout=(None, True)):
    return plan.Call(dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, flags, True, block_q, block_k,
                     backend, deterministic, layout)


PACKED = dict(batch=4, seqlen_q=4096, seqlen_k=4096, nheads=32)   # (with total_q: a packed batch)

# (call keywords, forward: (backend, block_q, block_k), backward: (backend, block_q, block_k)) on the H100
TABLE = [
    # above head dim 48 (dense; above 64 packed) the forward is the Hopper one (wgmma: two warpgroups), its tiles
    # _WGMMA_TILES; the backward's dK/dV kernel too, its query tiles _WGMMA_BWD_BLOCK_Q
    (dict(headdim=64), ("tensorcore", 128, 128), ("tensorcore", 64, 128)),
    (dict(headdim=64, flags=CAUSAL), ("tensorcore", 128, 128), ("tensorcore", 64, 128)),
    (dict(headdim=64, flags=SOFTCAP), ("tensorcore", 128, 128), ("tensorcore", 64, 128)),
    (dict(headdim=40), ("tensorcore", 128, 64), ("tensorcore", 32, 128)),
    (dict(headdim=128), ("tensorcore", 128, 128), ("tensorcore", 64, 128)),
    (dict(headdim=256), ("tensorcore", 128, 64), ("tensorcore", 32, 64)),
    (dict(dtype="bfloat16", headdim=128), ("tensorcore", 128, 128), ("tensorcore", 64, 128)),
    (dict(headdim=128, block_q=64), ("tensorcore", 64, 128), ("tensorcore", 64, 128)),
    (dict(headdim=128, block_q=32), ("tensorcore", 32, 64), ("tensorcore", 32, 128)),  # mma.sync: 32 rows
    (dict(headdim=64, block_q=32, block_k=32), ("tensorcore", 32, 32), ("tensorcore", 32, 32)),
    # float32: the forward on the Hopper tf32 kernel above head dim 48 up to 128 (WGMMA_AUTO_FLOAT32: 3xTF32, its
    # "highest" tiles; Q's small parts in registers above 64), else SIMT; the backward on SIMT
    (dict(dtype="float32", headdim=64), ("tensorcore", 128, 64), ("simt", 64, 64)),
    (dict(dtype="float32", headdim=128), ("tensorcore", 128, 32), ("simt", 64, 32)),
    (dict(dtype="float32", headdim=32), ("simt", 64, 64), ("simt", 64, 64)),
    (dict(dtype="float32", headdim=160), ("simt", 32, 32), ("simt", 32, 32)),
    (dict(dtype="float32", headdim=66), ("simt", 64, 32), ("simt", 64, 32)),        # not a multiple of 4
    (dict(dtype="float64", headdim=64), ("simt", 64, 32), ("simt", 64, 32)),
    (dict(headdim=63), ("simt", 64, 64), ("simt", 64, 64)),                         # odd head dim
    (dict(headdim=64, block_k=8), ("simt", 64, 8), ("simt", 64, 8)),                 # a tile below 16
    (dict(headdim=64, layout=("k", False)), ("simt", 64, 64), ("simt", 64, 64)),     # k's head dim strided
    (dict(headdim=64, backend="simt", layout=None), ("simt", 64, 64), ("simt", 64, 64)),
    (dict(headdim=64, deterministic=True), ("tensorcore", 128, 128), ("simt", 64, 64)),
    (dict(headdim=160, block_k=128), ("tensorcore", 128, 128), ("simt", 32, 128)),   # 512 threads refused
]


@pytest.mark.parametrize("kw, hopper", [
    (dict(headdim=64), True), (dict(headdim=64, flags=CAUSAL), True), (dict(headdim=40), False),
    (dict(headdim=48), False), (dict(headdim=56), True),
    (dict(headdim=128), True), (dict(headdim=128, **PACKED), True), (dict(dtype="bfloat16", headdim=256), True),
    (dict(headdim=128, block_q=32), False), (dict(headdim=120), True), (dict(headdim=122), False),
    (dict(headdim=128, layout=(None, False)), False), (dict(headdim=128, backend="tensorcore"), False),
    (dict(headdim=64, backend="wgmma"), True), (dict(dtype="float32", headdim=128, backend="tensorcore"), False),
    (dict(dtype="float32", headdim=64), True), (dict(dtype="float32", headdim=128), True),    # WGMMA_AUTO_FLOAT32
    (dict(dtype="float32", headdim=48), False), (dict(dtype="float32", headdim=132), False)])
def test_auto_runs_the_hopper_forward_on_the_h100_above_head_dim_64(device, monkeypatch, kw, hopper):
    """backend="auto" on compute capability 9.0: the wgmma forward above head dim 48 where it can serve the call
    (a multiple of 8, block_q a multiple of 64, 16-byte rows), else the mma.sync one; asked for, always.  Its
    tiles come by the copy engine (tensor maps), a packed batch's (total_q) too."""
    device(**H100)
    built = []
    real = plan.make_forward_tc
    monkeypatch.setattr(plan, "make_forward_tc", lambda *a, **kw: (built.append(kw), real(*a, **kw))[1])
    c = call(**kw)._replace(total_q=4 * 4096) if "batch" in kw else call(**kw)
    plan.forward(c)
    last = built[-1] if built else {}           # (float32 on SIMT builds no tensor-core kernel)
    assert last.get("WGMMA", False) == hopper, last
    tma = hopper
    assert last.get("TMA", False) == tma and plan.forward(c).tma == tma
    device(cc=(8, 0), limit=163 * 1024)
    if hopper and kw.get("backend") != "wgmma":
        n = len(built)
        f = plan.forward(c)
        if c.dtype == "float32":
            assert f.backend == "simt" and len(built) == n, "float32 'auto' off Hopper: the SIMT kernels"
        else:
            assert not built[-1].get("WGMMA", False), "the Hopper forward on compute capability 8.0"


@pytest.mark.parametrize("kw, fwd, bwd", TABLE)
def test_backend_and_tiles_on_the_h100(device, kw, fwd, bwd):
    device(**H100)
    c = call(**kw)
    f, b = plan.forward(c), plan.backward(c)
    assert (f.backend, f.block_q, f.block_k) == fwd
    assert (b.backend, b.block_q, b.block_k) == bwd
    assert f.acc == ("float64" if c.dtype == "float64" else "float32") == b.acc


@pytest.mark.parametrize("kw, why", [
    (dict(dtype="float64"), "float16, bfloat16 and float32 inputs only, got float64"),
    (dict(headdim=63), "even head dim"),
    (dict(block_q=8), "block_q must be a multiple of 16"),
    (dict(block_k=8), "block_k must be a multiple of 16"),
    (dict(layout=("v", False)), "v's head dimension must be contiguous"),
])
def test_tensorcore_refuses_with_the_reason(device, kw, why):
    device(**H100)
    c = call(backend="tensorcore", **kw)
    for make in (plan.forward, plan.backward):
        with pytest.raises(ValueError, match=f"backend='tensorcore' cannot serve this call: .*{why}"):
            make(c)


def test_tensorcore_backward_refusals(device):
    device(**H100)
    with pytest.raises(ValueError, match="deterministic=True needs backend='simt'"):
        plan.backward(call(backend="tensorcore", deterministic=True))
    with pytest.raises(ValueError, match="block_k=128 at head dim 160 needs 512 threads"):
        plan.backward(call(headdim=160, block_k=128, backend="tensorcore"))
    assert plan.forward(call(backend="tensorcore", deterministic=True)).backend == "tensorcore"
    assert plan.forward(call(dtype="float32", backend="tensorcore")).backend == "tensorcore"
    for d, tiles in ((64, (128, 64)), (128, (64, 32))):
        f = plan.forward(call(dtype="float32", headdim=d, backend="tensorcore"))
        assert (f.block_q, f.block_k) == tiles
    with pytest.raises(ValueError, match="deterministic=True needs backend='simt'"):
        plan.backward(call(dtype="float32", backend="tensorcore", deterministic=True))


@pytest.mark.parametrize("precision", plan.PRECISIONS)
def test_float32_backward_on_the_tensor_cores_when_asked_for(device, precision):
    """float32's backward on tf32 tensor cores with backend="tensorcore" (3xTF32 for "highest", one product for
    "high": the dK/dV kernel's TF32X3), float32's own tiles (one m-tile of keys per warp, 8 warps, the largest
    tiles whose kernel fits 227 KB: 3xTF32's small parts of K_j, Q_i, dO_i take more), the float32 words'
    preprocess and dQ copy; under "auto" SIMT, as the forward."""
    device(**H100)
    for d, tiles, share in ((64, (32, 128), False), (128, (32, 64), True)):
        c = call(dtype="float32", headdim=d, backend="tensorcore")._replace(precision=precision)
        b = plan.backward(c)
        assert (b.backend, b.block_q, b.block_k) == ("tensorcore", *tiles) and b.atomic
        assert b.dkdv.threads == 256 and b.dkdv.shared <= 227 * 1024
        assert plan._tc_bwd_layout(*tiles, d, "float32") == (2 if share else 1, 1, share)
        assert b.dkdv.kernel is make_dkdv_tc(*tiles, d, "float32", True, *([False] * 7), 2 if share else 1, True,
                                             MTK=1, SHARE=share, TF32X3=precision == "highest")[0]
        assert "make_preprocess('float32', 'float32'" in b.preprocess.kernel.flashnb_id
        assert b.finish.grid == cast_grid(2 * 1000 * 8 * d)                  # one float32 word per element
        assert plan.backward(c._replace(backend="auto")).backend == "simt"


def test_older_devices(device):
    device(cc=(7, 5), limit=64 * 1024)
    with pytest.raises(ValueError, match="compute capability 8.0"):
        plan.forward(call(backend="tensorcore"))
    assert plan.forward(call()).backend == "simt"
    device(cc=(8, 6), limit=99 * 1024)                   # the fallback tiles of a 99 KB device
    f, b = plan.forward(call(headdim=128)), plan.backward(call(headdim=128))
    assert (f.backend, f.block_q, f.block_k) == ("tensorcore", 64, 64)
    assert (b.backend, b.block_q, b.block_k) == ("tensorcore", 32, 64)
    assert plan.backward(call(headdim=256)).block_q == 16


def test_a_kernel_too_large_for_the_device_is_refused_before_launch(device):
    device(cc=(9, 0), limit=1024)
    with pytest.raises(ValueError, match="backend='tensorcore'.*shared memory per block"):
        plan.forward(call(backend="tensorcore"))
    with pytest.raises(ValueError, match="the forward with block_q=128, block_k=128.*shared memory"):
        plan.forward(call(backend="simt", block_q=128, block_k=128, layout=None))


def test_grids_and_launches(device):
    device(**H100)
    c = call(headdim=64, batch=2, seqlen_q=1000, seqlen_k=1500, nheads=8, nheads_k=2)
    f = plan.forward(c)
    assert f.forward.grid == 8 * 8 * 2 and f.forward.threads == 256          # ceil(1000 / 128) x heads x batch
    b = plan.backward(c)
    assert b.dkdv.grid == 12 * 2 * 2                                           # ceil(1500 / 128) x kv heads x batch
    assert b.atomic and b.preprocess is not None and b.finish.grid > 0        # the dQ accumulator's cast
    s = plan.backward(call(dtype="float32", deterministic=True))
    assert not s.atomic and s.finish.grid == 16 * 8 * 2                       # the dQ pass: ceil(1000 / 64) ...
    assert plan.backward(call(dtype="float32")).atomic


def test_empty_calls_launch_nothing(device):
    device(**H100)
    assert plan.forward(call(batch=0)).forward is None
    assert plan.forward(call(seqlen_q=0)).forward is None
    b = plan.backward(call(seqlen_q=0))
    assert b.preprocess is None and b.finish is None and b.dkdv is not None   # dK = dV = 0 still written
    b = plan.backward(call(seqlen_k=0))
    assert b.dkdv is None and b.finish is not None                            # dQ = 0 still written
    b = plan.backward(call(nheads=0, nheads_k=0))
    assert (b.preprocess, b.dkdv, b.finish) == (None, None, None)


def test_a_call_is_a_hashable_key_and_equal_calls_get_equal_plans(device):
    device(**H100)
    a, b = call(headdim=128, flags=CAUSAL), call(headdim=128, flags=CAUSAL)
    assert a == b and hash(a) == hash(b) and len({a, b, call(headdim=64)}) == 2
    assert plan.forward(a) == plan.forward(b)        # the same kernels (the factories' caches), grids, tiles
    assert plan.backward(a) == plan.backward(b)


def test_wants_words_only_where_the_tensor_cores_may_serve(device):
    device(**H100)
    assert plan.wants_words(call(layout=None))
    assert plan.wants_words(call(layout=None), backward=True)
    assert not plan.wants_words(call(layout=None, backend="simt"))
    assert not plan.wants_words(call(dtype="float64", layout=None))
    assert plan.wants_words(call(dtype="float32", layout=None))                   # the Hopper tf32 forward
    assert not plan.wants_words(call(dtype="float32", layout=None), backward=True)
    assert not plan.wants_words(call(dtype="float32", headdim=32, layout=None))
    assert plan.wants_words(call(dtype="float32", layout=None, backend="tensorcore"))
    assert plan.wants_words(call(dtype="float32", layout=None, backend="tensorcore"), backward=True)
    assert plan.wants_words(call(layout=None, deterministic=True))
    assert not plan.wants_words(call(layout=None, deterministic=True), backward=True)


def test_packed_batches_take_the_copy_engine(device):
    """A packed batch's Hopper forward copies by the copy engine too (boxes of the packed rows): above head dim
    48 "auto" takes it, and its tensor maps map the packed views (batch stride 0) as one batch."""
    device(**H100)
    for d in (64, 128):
        f = plan.forward(call(headdim=d, **PACKED)._replace(total_q=4 * 4096))
        assert f.tma and f.forward.threads == 256, (d, f)


@pytest.mark.parametrize("kw, hopper", [
    (dict(headdim=64), True), (dict(headdim=128), True), (dict(headdim=256), True), (dict(headdim=72), True),
    (dict(headdim=56), True), (dict(headdim=48), False), (dict(headdim=64, block_k=32), False),
    (dict(dtype="float32", headdim=64, backend="tensorcore"), False), (dict(headdim=64, backend="tensorcore"), False),
    (dict(headdim=64, backend="wgmma"), True), (dict(headdim=48, backend="wgmma"), True),
    (dict(headdim=128, layout=(None, False)), False)])
def test_the_hopper_backward_on_the_h100_where_enabled(device, monkeypatch, kw, hopper):
    """The backward runs the Hopper dK/dV kernel (WGMMA_BACKWARD) for "wgmma", and for "auto" on compute
    capability 9.0 above head dim 48: 16-bit batches, dense and packed, up to head dim 256 (two warpgroups on
    the same keys above 128), key tiles of whole warpgroups, query tiles of _WGMMA_BWD_BLOCK_Q; else the
    tensor-core one, as on other GPUs, without WGMMA_BACKWARD, and packed without WGMMA_BACKWARD_PACKED."""
    device(**H100)
    built = []
    real = plan.make_dkdv_tc
    monkeypatch.setattr(plan, "make_dkdv_tc", lambda *a, **k: (built.append(k), real(*a, **k))[1])
    c = call(**kw)
    b = plan.backward(c)
    assert bool(built[-1].get("WGMMA")) == hopper, built[-1]
    if hopper:
        split = 2 if c.headdim > 128 else 1
        assert b.block_q == (64 if c.headdim <= 128 else 32) and b.dkdv.threads == 32 * split * b.block_k // 16
        assert built[-1].get("DQ_WGMMA", False) == (split == 1 and b.block_q == 64), "dQ by the warpgroups"
        assert b.tma and built[-1].get("TMA"), "dense batches: Q_i, dO_i by the copy engine (WGMMA_BWD_TMA)"
        monkeypatch.setattr(plan, "WGMMA_BWD_TMA", False)
        b = plan.backward(c)
        assert not built[-1].get("TMA", False) and not b.tma, "the copy engine's backward without WGMMA_BWD_TMA"
        monkeypatch.setattr(plan, "WGMMA_BWD_TMA", True)
        assert not plan.backward(c._replace(total_q=4 * c.seqlen_q)).tma, "packed: cp.async"
        monkeypatch.setattr(plan, "WGMMA_BWD_TMA", False)
        assert plan.backward(c._replace(total_q=4 * c.seqlen_q)).dkdv is not None
        assert built[-1].get("WGMMA") and built[-1].get("VARLEN"), "packed: the Hopper dK/dV kernel"
        monkeypatch.setattr(plan, "WGMMA_BACKWARD_PACKED", False)
        plan.backward(c._replace(total_q=4 * c.seqlen_q))
        assert not built[-1].get("WGMMA"), "the Hopper dK/dV kernel for a packed batch without its flag"
    monkeypatch.setattr(plan, "WGMMA_BACKWARD", False)
    plan.backward(c)
    assert not built[-1].get("WGMMA"), "the Hopper dK/dV kernel without WGMMA_BACKWARD"
    if c.backend == "auto":
        monkeypatch.setattr(plan, "WGMMA_BACKWARD", True)
        device(cc=(8, 0), limit=163 * 1024)
        plan.backward(c)
        assert not built[-1].get("WGMMA"), "the Hopper dK/dV kernel on compute capability 8.0"


@pytest.mark.parametrize("kw, rows", [
    (dict(), 192), (dict(flags=CAUSAL), 128), (dict(dtype="bfloat16", headdim=56), 192), (dict(headdim=72), 128),
    (dict(flags=SOFTCAP), 128), (dict(flags=_options.Flags(False, False, False, False, False, False, True)), 128),
    (dict(block_k=128), 128), (dict(block_q=128), 128)])
def test_three_warpgroups_where_their_registers_fit(device, monkeypatch, kw, rows):
    """With WGMMA_THREE_WARPGROUPS (off: two warpgroups at two blocks an SM measured faster) the Hopper forward
    takes 192 query rows (three warpgroups, 384 threads, at most 170 registers each) up to head dim 64 with no
    option (causal measured slower), on its own tiles, dense; else two warpgroups; off without the flag."""
    device(**H100)
    monkeypatch.setattr(plan, "WGMMA_THREE_WARPGROUPS", True)
    f = plan.forward(call(**kw))
    assert f.block_q == rows and f.forward.threads == 2 * rows, f
    assert plan.forward(call(**kw)._replace(total_q=4 * 1000)).block_q == 128          # packed: two
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "WGMMA_THREE_WARPGROUPS", False)
        assert plan.forward(call(**kw)).block_q == 128


@pytest.mark.parametrize("kw, two_blocks, section", [
    (dict(flags=CAUSAL), True, True), (dict(dtype="bfloat16", flags=CAUSAL), True, True),
    (dict(), True, False),                                   # no window: no section
    (dict(flags=SOFTCAP), False, True),                      # a score option keeps its registers
    (dict(headdim=128, flags=CAUSAL), False, True), (dict(flags=CAUSAL, total_q=4000), False, False)])
def test_launch_bounds_and_block_order_where_measured(device, monkeypatch, kw, two_blocks, section):
    """The Hopper forward is launch-bounded to two blocks an SM at head dim 64 with no option but a window
    (``WGMMA_FWD_TWO_BLOCKS``); windows over dense batches deal their blocks longest first (``LPT_SECTION_FWD``,
    ``_BWD``); above head dim 128 the Hopper dK/dV kernel's warpgroups exchange S^T and dP^T."""
    device(**H100)
    kw = dict(kw)
    packed = kw.pop("total_q", None)
    built = {}
    for name in ("make_forward_tc", "make_dkdv_tc"):
        real = getattr(plan, name)
        monkeypatch.setattr(plan, name, lambda *a, _real=real, _name=name, **k: (built.__setitem__(_name, k),
                                                                               _real(*a, **k))[1])
    c = call(**kw)._replace(total_q=packed)
    plan.forward(c)
    plan.backward(c)
    assert built["make_forward_tc"].get("MIN_BLOCKS") == (2 if two_blocks else None), built
    assert built["make_forward_tc"].get("SECTION") == (plan.LPT_SECTION_FWD if section else None), built
    assert built["make_dkdv_tc"].get("SECTION") == (plan.LPT_SECTION_BWD if section else None), built
    plan.backward(call(**{**kw, "headdim": 256}))
    assert built["make_dkdv_tc"].get("EXCHANGE") is True, built


GPU_DECODE = plan.DecodeSettings(keys_per_lane=2, nwarps=8, stages=4, stage_bytes=192 * 1024, lean=True, e_budget=64,
                                 blocks_per_sm=1)          # kvcache's settings on a GPU


@pytest.mark.parametrize("n_max, splits", [(4096, 0), (32768, 0), (300, 1), (5000, 7)])
def test_decode_launches(monkeypatch, n_max, splits):
    """The split-KV decode call's launches (``plan.decode_launches``): one block per (sequence, KV head, row
    tile, split), the combine exactly when the keys are split (an output value a thread, at most 8192 blocks),
    the K/V stages lowered until they fit a block's share of shared memory, and the variant from the options."""
    built = {}
    real = plan._decode.make_decode

    def noting(*args):
        built["args"] = args
        return real(*args)
    monkeypatch.setattr(plan._decode, "make_decode", noting)
    plan.decode_launches.cache_clear()
    for dtype, d in (("float16", 128), ("float32", 256)):
        launches = plan.decode_launches(dtype, 16, 32, 8, 1, d, n_max, True, splits, 132, GPU_DECODE, False, False,
                                        True, False, False, False)
        p = launches.split
        assert p == plan.plan_decode(dtype, 16, 8, 4, 1, d, n_max, True, splits, slots=132, e_budget=64)
        assert launches.decode.grid == 16 * 8 * p.n_row_tiles * p.n_splits
        assert (launches.combine is not None) == (p.n_splits > 1)
        if launches.combine is not None:
            total = 16 * 1 * 32 * (d if dtype == "float32" else d // 2)
            assert launches.combine.grid == min(-(-total // plan.COMBINE_THREADS), 8192)
        args = built["args"]
        assert args[9:12] == (p.n_splits > 1, True, False)              # SPLIT, HAS_WINDOW, HAS_SOFTCAP
        stages = args[13]
        stage = plan._decode.stage_size(dtype, d, p.lanes_per_key, 2, 8)
        assert stages == 0 or (2 <= stages <= 4 and stages * stage <= 192 * 1024)
    plan.decode_launches.cache_clear()


def test_append_launch():
    """The KV-cache append: a sequence's new words over blocks of 256 threads, at most 8192 blocks in all."""
    step, per_seq = plan.append_launch(4, 1, 8, 64, False, True)
    assert (step.grid, step.threads, per_seq) == (4 * 2, 256, 2)
    step, per_seq = plan.append_launch(64, 4096, 8, 64, True, False)
    assert per_seq == 8192 // 64 and step.grid == 8192


def test_split_kv_decode_split_count_choice():
    """The split-KV decode plan (``plan.plan_decode``), flash-attn's heuristic: no split when the blocks fill the
    GPU, else enough splits for >= 85% wave efficiency; the splits cover every key in multiples of 16."""
    assert plan.num_splits_heuristic(220, 264, 256) == 1                # >= 0.8 x the slots
    assert plan.num_splits_heuristic(128, 264, 256) == 2              # the shape on an H100: 256 blocks
    assert plan.num_splits_heuristic(16, 264, 256) >= 13
    assert plan.num_splits_heuristic(1, 264, 3) == 3                 # bounded by the key blocks
    for n_max in (1, 15, 16, 17, 100, 4096, 32768):
        for splits in (0, 1, 3, 7, 200):
            p = plan.plan_decode("float16", 2, 8, 4, 1, 128, n_max, True, splits, slots=264, e_budget=64)
            assert p.split_len % 16 == 0 and p.n_splits * p.split_len >= n_max
            assert (p.n_splits - 1) * p.split_len < max(n_max, 1)       # no split starts past the keys
            assert p.rows == 4 and p.n_row_tiles == 1


def test_fp8_forward_plan():
    """The FP8 forward's launches: a block per (128 queries, head, batch), 384 threads at head dim 128 (the
    warp-specialised kernel: a producer warpgroup, two consumers), 256 at head dim 64 (the plain kernel, two blocks an
    SM); V^T's pre-pass a block per (32 keys, 32 dims, key head, batch) over the keys padded to 32, its word form
    (taken where v has a word view) a block per (128 keys, key head, batch); one plan per shape (cached)."""
    from flashnb.kernels import forward_fp8
    p = plan.fp8_forward(2, 300, 500, 8, 2, 128, True, "bfloat16")
    assert p.forward.grid == 2 * 8 * 3 and p.forward.threads == forward_fp8.NTHREADS_WS == 384
    assert plan.fp8_forward(2, 300, 500, 8, 2, 64, True, "bfloat16").forward.threads == forward_fp8.NTHREADS == 256
    assert p.vt_keys == 512 and p.prepare.grid == 2 * 2 * (512 // 32) * (128 // 32)
    assert p.prepare.threads == forward_fp8.PREP_THREADS
    assert p.prepare_words.grid == 2 * 2 * (512 // 128) and p.prepare_words.threads == forward_fp8.PREP_THREADS
    assert p.forward.shared >= 128 * 128 + 2 * (128 * 128 + 128 * 128), "Q, then two stages of K_j and V_j^T"
    assert plan.fp8_forward(2, 300, 500, 8, 2, 128, True, "bfloat16") is p
    packed = plan.fp8_forward_packed(3, 200, 12, 8, 2, 128, False, "bfloat16")     # 12 column groups: 3 tiles
    assert packed.prepare_words.grid == 3 * 2 and packed.prepare_words.threads == forward_fp8.PREP_THREADS
    assert plan.fp8_forward(2, 300, 500, 8, 2, 128, False, "bfloat16").forward.kernel is not p.forward.kernel


def test_flex_section_bits_pick_the_pass(monkeypatch):
    """``FLEX_SECTION``'s bits: 1 gives a mask_mod's forward the section order, 2 its dK/dV kernel; a call without
    a mask_mod never takes it from them."""
    from flashnb import flex
    from flashnb.kernels._scores import Mods
    mods = Mods(None, flex._compiled(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx), None, (128, 128))
    masked = call(dtype="bfloat16", flags=_options.Flags(False, False, True, False, False, False, False, mods))
    plain = call(dtype="bfloat16")
    for bits, fwd, bwd in ((0, False, False), (1, True, False), (2, False, True), (3, True, True)):
        monkeypatch.setattr(plan, "FLEX_SECTION", bits)
        assert plan._section(masked, 8, 1) == ({"SECTION": 8} if fwd else {})
        assert plan._section(masked, 8, 2) == ({"SECTION": 8} if bwd else {})
        assert plan._section(plain, 8, 1) == {} and plan._section(plain, 8, 2) == {}


@pytest.mark.parametrize("score, setting, two_blocks", [
    (False, {}, True),                                       # the mask alone: FLEX_TWO_BLOCKS (on, measured)
    (True, {}, True),                                        # a score_mod too: FLEX_TWO_BLOCKS_SCORE (on, measured)
    (True, {"FLEX_TWO_BLOCKS_SCORE": False}, False),         # ... its setting off: it keeps its registers
    (False, {"FLEX_TWO_BLOCKS": False}, False)])
def test_flex_launch_bounds(device, monkeypatch, score, setting, two_blocks):
    """A flex_attention call's Hopper forward at head dim 64: two blocks an SM for a mask_mod alone
    (``FLEX_TWO_BLOCKS``), with a score_mod under ``FLEX_TWO_BLOCKS_SCORE``; the mask_mod's call takes causal's
    section order (``FLEX_SECTION``'s forward bit), and not with the bit off."""
    from flashnb import flex
    from flashnb.kernels._scores import Mods
    device(**H100)
    for name, value in setting.items():
        monkeypatch.setattr(plan, name, value)
    monkeypatch.setattr(plan, "FLEX_SECTION", 1)
    mods = Mods(flex._compiled(lambda score, b, h, q_idx, kv_idx: score * 0.5) if score else None,
                flex._compiled(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx), None, (128, 128))
    flags = _options.Flags(False, False, True, False, False, False, False, mods)
    built = {}
    real = plan.make_forward_tc
    monkeypatch.setattr(plan, "make_forward_tc", lambda *a, **k: (built.update(k), real(*a, **k))[1])
    plan.forward(call(dtype="bfloat16", flags=flags))
    assert built.get("WGMMA") and built.get("MIN_BLOCKS") == (2 if two_blocks else None), built
    assert built.get("SECTION") == plan.LPT_SECTION_FWD, built
    monkeypatch.setattr(plan, "FLEX_SECTION", 2)
    built.clear()
    plan.forward(call(dtype="bfloat16", flags=flags))
    assert "SECTION" not in built, built
