"""Layer ids: id k = output of decoder layer k = HF hidden_states[k+1]; DFlash's default."""

import pytest

from vx.errors import UsageError
from vx.data.layers import check_layer_ids, default_layer_ids, parse_layer_ids


def test_dflash_default_for_a_64_layer_target():
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]


def test_default_for_the_tiny_model_stays_in_range():
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]


def test_out_of_range_ids_are_a_clear_error():
    with pytest.raises(UsageError, match="out of range.*8 decoder layers"):
        check_layer_ids([0, 8], 8)
    with pytest.raises(UsageError):
        check_layer_ids([-1], 8)


def test_parse_and_sort():
    assert check_layer_ids(parse_layer_ids("7, 0,3"), 8) == [0, 3, 7]
    with pytest.raises(UsageError):
        parse_layer_ids("1,two")
    with pytest.raises(UsageError, match="duplicate"):
        check_layer_ids([1, 1], 8)


def test_presets_name_a_trainers_layers_and_a_typo_is_one_line():
    from vx.data.layers import resolve_layer_ids

    assert parse_layer_ids("speculators-dflash") == "speculators-dflash"
    assert resolve_layer_ids("dflash", 64) == resolve_layer_ids(None, 64) == [1, 16, 31, 46, 61]
    assert resolve_layer_ids("speculators-dflash", 64) == [1, 16, 31, 46, 61, 63]  # and the verifier's last
    assert resolve_layer_ids("speculators", 64) == [1, 31, 60, 63]  # speculators' 2, 32, 61 (embedding = 0)
    assert resolve_layer_ids("speculators-dflash", 8) == [1, 2, 3, 4, 5, 7]
    with pytest.raises(UsageError, match="preset"):
        parse_layer_ids("speculator-dflash")
