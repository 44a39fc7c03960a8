import pytest

from hierremat import format_bytes, parse_budget
from hierremat.plans.schedule import Backward, ChainSchedule, FAll, FCk, FNone, Loss


@pytest.mark.parametrize(
    "text, expected",
    [("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("3GB", 3 * 10**9), ("2e9", 2 * 10**9),
     ("100KiB", 100 * 1024), (" 64 mib ", 64 * 2**20), (2**21, 2**21), ("4096B", 4096)],
)
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", [4, 12, "8", 1000.0])
def test_small_bare_numbers_look_like_segment_counts(bad):
    with pytest.raises(ValueError, match="segment count"):
        parse_budget(bad)


@pytest.mark.parametrize("bad", ["lots", "5 parsecs", "-3MiB", "0.1B"])
def test_garbage_budgets_name_the_argument(bad):
    with pytest.raises(ValueError, match="budget"):
        parse_budget(bad)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_schedule_json_roundtrip_is_lossless():
    ops = (FCk(0), FNone(1), FAll(2, 3), Loss(), Backward(2), FAll(0), FAll(1, 1), Backward(1), Backward(0))
    s = ChainSchedule(ops, 3, 0.1 + 0.2, 12345, 99999, 7)
    back = ChainSchedule.from_json(s.to_json())
    assert back == s
    assert back.predicted_time == 0.1 + 0.2
    assert back.loss_index == 3
    assert back.forward_counts() == [2, 2, 1]
    assert str(s).startswith("F_ck(0) F_none(1) F_all(2, 3) Loss")


def test_schedule_json_rejects_other_documents():
    with pytest.raises(ValueError, match="ChainSchedule"):
        ChainSchedule.from_json('{"format": "something else"}')


def test_allocated_bytes_rounds_to_the_cuda_allocator_block_and_is_exact_elsewhere():
    from hierremat.device.memory import allocated_bytes

    assert [allocated_bytes(n, "cuda") for n in (0, 1, 128, 512, 513, 4096)] == [0, 512, 512, 512, 1024, 4096]
    assert [allocated_bytes(n, "cpu") for n in (0, 1, 128, 513)] == [0, 1, 128, 513]
