"""minibatch.sim.hardware: the registry holds the published datasheet numbers."""

import pytest

from minibatch.sim import available_hardware, get_hardware, parse_hardware
from minibatch.sim.hardware import GiB


def test_registry_names():
    assert set(available_hardware()) >= {"a10", "l4", "rtx4090", "a100-40g", "a100-80g", "h100", "h200", "cpu"}


@pytest.mark.parametrize("name, tflops, gbps, gib", [
    ("a10", 125, 600, 22.5), ("l4", 121, 300, 22.5), ("rtx4090", 165.2, 1008, 24),
    ("a100-40g", 312, 1555, 40), ("a100-80g", 312, 2039, 80), ("h100", 989, 3350, 80),
    ("h200", 989, 4800, 141),
])
def test_datasheet_numbers(name, tflops, gbps, gib):
    hw = get_hardware(name)
    assert hw.peak_flops == pytest.approx(tflops * 1e12)
    assert hw.memory_bandwidth == pytest.approx(gbps * 1e9)
    assert hw.memory_bytes / GiB == pytest.approx(gib)
    assert "TFLOP" in hw.source and "GB/s" in hw.source
    assert 0 < hw.flop_efficiency <= 1 and 0 < hw.bandwidth_efficiency <= 1


def test_links():
    assert get_hardware("a100-80g").interconnect == "nvlink"
    assert get_hardware("a10").interconnect == "pcie"
    assert get_hardware("h100").interconnect_bandwidth > get_hardware("a100-80g").interconnect_bandwidth


def test_names_are_case_insensitive_and_tp_prefix_parses():
    assert get_hardware("A100-80G").name == "a100-80g"
    assert parse_hardware("4xa10") == (get_hardware("a10"), 4)
    assert parse_hardware("rtx4090") == (get_hardware("rtx4090"), 1)
    assert parse_hardware("8xH100") == (get_hardware("h100"), 8)


@pytest.mark.parametrize("bad", ["v100", "4xfoo", "tpu"])
def test_unknown_hardware_lists_available(bad):
    with pytest.raises(ValueError, match="a100-80g.*h100"):
        parse_hardware(bad)
