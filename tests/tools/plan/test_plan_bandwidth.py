"""shardkit-plan on gloo: a bandwidth measured on this machine and cached, or no time and why.

No assertion depends on how fast the machine is: only on where the figure came from and that
the plan uses it.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest

from shardkit.tools.plan.cli import main
from shardkit.tools.plan.timing.bandwidth import (
    CACHE_ENV,
    cache_path,
    gloo_bandwidth,
    measure_gloo_gbps,
    read_cached_gbps,
)

TINY = "shardkit.tools.examples:llama_tiny"


class FakeMeasure:
    """Stands in for the calibration: counts its calls and returns a fixed rate."""

    def __init__(self, gbps: float = 1.5) -> None:
        self.gbps = gbps
        self.calls: list[int] = []

    def __call__(self, ranks: int) -> float:
        self.calls.append(ranks)
        return self.gbps


def test_measured_once_then_cached(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "gloo-bandwidth.json"
    measure = FakeMeasure()
    first = gloo_bandwidth(8, path=path, measure=measure)
    assert (first.source, first.gbps, measure.calls) == ("measured", 1.5, [4])  # 4 ranks at most
    assert str(path) in first.detail and "4 ranks" in first.detail
    again = gloo_bandwidth(8, path=path, measure=measure)
    assert (again.source, again.gbps, measure.calls) == ("cached", 1.5, [4])
    two = gloo_bandwidth(2, path=path, measure=measure)  # another key: measured anew
    assert (two.source, measure.calls) == ("measured", [4, 2])
    assert read_cached_gbps(path, 4) == 1.5 and read_cached_gbps(path, 2) == 1.5
    assert gloo_bandwidth(1, path=path, measure=measure).gbps is None  # nothing to send


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff not json",
        b"[1, 2]",
        b"[" * 20_000 + b"]" * 20_000,  # nested deeper than json's parser recurses
        b'{"version": 1, "entries": []}',
        b'{"version": 99, "entries": {}}',
        b'{"version": 1, "entries": {"HOST/ranks=2": {"gbps": NaN}}}',
        b'{"version": 1, "entries": {"HOST/ranks=2": {"gbps": -3}}}',
        b'{"version": 1, "entries": {"HOST/ranks=2": {"gbps": true}}}',
        b'{"version": 1, "entries": {"HOST/ranks=2": {"gbps": "fast"}}}',
        b'{"version": 1, "entries": {"HOST/ranks=2": {"gbps": 1e300}}}',
        b'{"version": 1, "entries": {"HOST/ranks=2": {"gbps": 2.0}}, "pad": "'
        + b"x" * 100_000
        + b'"}',
    ],
)
def test_a_bad_cache_is_measured_again_and_rewritten(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "gloo-bandwidth.json"
    path.write_bytes(content.replace(b"HOST", socket.gethostname().encode()))
    measure = FakeMeasure(0.25)
    result = gloo_bandwidth(2, path=path, measure=measure)
    assert (result.source, result.gbps, measure.calls) == ("measured", 0.25, [2])
    data = json.loads(path.read_text())
    assert data["version"] == 1 and list(data["entries"]) == [f"{socket.gethostname()}/ranks=2"]
    assert gloo_bandwidth(2, path=path, measure=measure).source == "cached"


def test_a_failed_calibration_gives_no_time_and_says_why(tmp_path: Path) -> None:
    def broken(ranks: int) -> float:
        raise RuntimeError("no loopback")

    result = gloo_bandwidth(2, path=tmp_path / "c.json", measure=broken)
    assert result.gbps is None and result.source == "unavailable"
    assert "calibration failed: no loopback" in result.detail
    assert not (tmp_path / "c.json").exists()
    nan = gloo_bandwidth(2, path=tmp_path / "c.json", measure=FakeMeasure(math.nan))
    assert nan.gbps is None and "not a rate" in nan.detail


def test_the_real_calibration_measures_a_rate() -> None:
    gbps = measure_gloo_gbps(2, nbytes=256 * 1024)
    assert math.isfinite(gbps) and gbps > 0


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "sk"))
    assert cache_path() == tmp_path / "sk" / "gloo-bandwidth.json"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "shardkit" / "gloo-bandwidth.json"


def test_plan_on_gloo_uses_the_measured_bandwidth(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    argv = [TINY, "--world-size", "2", "--backend", "gloo", "--json"]
    assert main(argv) == 0  # measures, for real, and caches
    first = json.loads(capsys.readouterr().out)
    bandwidth = first["bandwidth"]
    assert bandwidth["source"] == "measured" and bandwidth["gbps"] > 0
    assert first["options"]["bandwidth_gbps"] == bandwidth["gbps"]
    assert first["comm_seconds"] == pytest.approx(
        first["sent_bytes_per_step"] / (bandwidth["gbps"] * 1e9)
    )
    assert main(argv) == 0  # the second plan reads the cache
    second = json.loads(capsys.readouterr().out)
    assert second["bandwidth"]["source"] == "cached"
    assert second["bandwidth"]["gbps"] == bandwidth["gbps"]
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "communication time at " in out and "(gloo measured on " in out
    assert f"cached in {tmp_path / 'gloo-bandwidth.json'}" in out


def test_no_calibration_prints_no_time(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [TINY, "--world-size", "2", "--backend", "gloo", "--no-calibrate"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "communication time: not estimated (gloo runs at this machine's speed" in out
    assert " ms (not overlapped)" not in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["comm_seconds"] is None and data["bandwidth"]["gbps"] is None
    # nccl keeps its default, and says it is one.
    assert main([TINY, "--world-size", "2"]) == 0
    assert "GB/s (the default, an InfiniBand-class network" in capsys.readouterr().out
