"""The GPU tiers' machinery that runs without a GPU: the order tests/gpu/tier.py full starts tests in."""

from pathlib import Path


def test_longest_first_gives_each_worker_a_lane_of_its_own():
    """tests/conftest.py: with worksteal's contiguous shares (the later ones one longer), worker w starts
    with the w-th longest test, and every lane runs longest first."""
    from conftest import longest_first

    seconds = {f"t{i}": 100.0 - i for i in range(40)}
    items = [type("Item", (), {"nodeid": f"t{i}"})() for i in range(40)] + \
        [type("Item", (), {"nodeid": f"short{i}"})() for i in range(10)]
    order = [item.nodeid for item in longest_first(items, seconds, 16)]
    assert sorted(order) == sorted(item.nodeid for item in items)
    starts, at = [], 0
    for w in range(16):                 # pytest-xdist worksteal: len(pending) // nodes_remaining each
        share = (len(order) - at) // (16 - w)
        lane = order[at:at + share]
        starts.append(lane[0])
        assert [seconds.get(t, 0) for t in lane] == sorted((seconds.get(t, 0) for t in lane), reverse=True)
        at += share
    assert sorted(starts, key=lambda t: int(t[1:])) == [f"t{i}" for i in range(16)]


def test_the_durations_table_parses_and_names_test_files_that_exist():
    from conftest import measured_durations

    table = measured_durations()
    assert table and all(seconds > 0 for seconds in table.values())
    root = Path(__file__).resolve().parent.parent
    assert all((root / nodeid.split("::")[0]).is_file() for nodeid in table)
