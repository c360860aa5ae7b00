"""scripts/try_variants.py: what a variant and a case are, parsed before any
build (the builds and the timing need the GPU machine)."""

import importlib.util

import pytest

from common.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("try_variants", REPO_ROOT / "scripts" / "try_variants.py")
tv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tv)


def test_variants_are_the_stage_then_defines_or_a_replacement_source():
    got = tv.parse_variants("r128:KDA_PREP_REGS=128; old:@.exp/old.cu,KDA_X ;")
    assert got == [("stage", None, ()), ("r128", None, ("KDA_PREP_REGS=128",)), ("old", ".exp/old.cu", ("KDA_X",))]
    assert tv.parse_variants("") == [("stage", None, ())]


@pytest.mark.parametrize("bad", ["stage:KDA_X", "two words:KDA_X", "1x:KDA_X"])
def test_a_variant_name_that_is_no_identifier_or_the_stage_itself_is_refused(bad):
    with pytest.raises(ValueError, match="variant name"):
        tv.parse_variants(bad)


def test_cases_are_a_pinned_path_at_a_shape():
    assert tv.parse_cases("fused8:B8 T1024 H64 K128 V128; split1:B2 T2048 H4 K64 V64") == [
        ("fused8", dict(B=8, T=1024, H=64, K=128, V=128)), ("split1", dict(B=2, T=2048, H=4, K=64, V=64))]
    with pytest.raises(ValueError, match="a shape is 'B.. T.. H.. K.. V..'.*'B8 T1024 H64 K128'"):  # no V
        tv.parse_cases("fused8:B8 T1024 H64 K128")
