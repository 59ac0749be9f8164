"""tools.tune_decode without a GPU: its candidates parse, a typo is refused before any GPU work, the settings
come back after a row, and without a GPU it says so."""
import pytest

from flashnb import kvcache
from tools import tune_decode


def test_variants_parse_to_kvcache_settings():
    for spec in tune_decode.VARIANTS:
        values = tune_decode.parse_variant(spec)
        assert values and all(isinstance(getattr(kvcache, k), int) for k in values)
    assert tune_decode.parse_variant("LEAN=1, STAGES=6") == {"LEAN": 1, "STAGES": 6}
    with pytest.raises(ValueError, match="'STAGE'"):
        tune_decode.parse_variant("STAGE=6")


def test_settings_are_restored():
    before = kvcache.STAGES, kvcache.LEAN
    with tune_decode.settings({"STAGES": before[0] + 1, "LEAN": 0}):
        assert kvcache.STAGES == before[0] + 1 and kvcache.LEAN is False      # the setting's own type
    assert (kvcache.STAGES, kvcache.LEAN) == before


def test_without_gpu_says_so(capsys):
    from flashnb.kernels._jit import SIMULATOR
    if not SIMULATOR:
        pytest.skip("on a GPU machine main() times things")
    assert tune_decode.main(["--sweep"]) == 0
    assert "nothing measured" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not an int setting"):
        tune_decode.main(["NOPE=1"])
