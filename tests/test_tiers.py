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


def test_the_full_tier_reads_its_durations_back_from_pytests_report():
    """tests/gpu/tier.py --write-durations: the seconds of pytest's "slowest durations" section, a test's
    phases summed, written longest first under durations.txt's comments."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tier", Path(__file__).resolve().parent / "gpu" / "tier.py")
    tier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tier)
    report = ["..........  [100%]\n",
              "============================= slowest durations =============================\n",
              "158.88s call     tests/test_bias_mask.py::test_backward[v2]\n",
              "6.50s setup    tests/test_gpu.py::test_inputs_not_modified\n",
              "5.25s call     tests/test_forward_result.py::test_free[float16-causal softcap alibi]\n",
              "5.00s call     tests/test_gpu.py::test_inputs_not_modified\n",
              "(40 durations < 5s hidden.  Use -vv to show these durations.)\n",
              "=========================== 1002 passed in 190.00s ===========================\n",
              "9.00s call     tests/after_the_section.py::test_not_read\n"]
    seconds = tier.seconds_of_tests(report)
    assert seconds == {"tests/test_bias_mask.py::test_backward[v2]": 158.88,
                       "tests/test_gpu.py::test_inputs_not_modified": 11.5,
                       "tests/test_forward_result.py::test_free[float16-causal softcap alibi]": 5.25}
    text = tier.durations_text(seconds, "# a comment\n# another\n1 tests/old.py::test_gone\n")
    assert text.splitlines() == ["# a comment", "# another", "159 tests/test_bias_mask.py::test_backward[v2]",
                                 "12 tests/test_gpu.py::test_inputs_not_modified",
                                 "5 tests/test_forward_result.py::test_free[float16-causal softcap alibi]"]
