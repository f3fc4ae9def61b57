"""Host collector on this machine's real psutil."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from manager.metrics.host import HostCollector

MIB = 1024**2


def _meminfo_kib(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def test_host_totals_agree_with_the_kernel(tmp_path):
    sample = HostCollector().sample([("data", tmp_path)])
    assert sample.ram_total_bytes == _meminfo_kib("MemTotal") * 1024
    assert sample.ram_used_bytes + sample.ram_available_bytes == sample.ram_total_bytes
    assert sample.swap_total_bytes == _meminfo_kib("SwapTotal") * 1024
    assert 0.0 <= sample.cpu_pct <= 100.0
    st = os.statvfs(tmp_path)
    (disk,) = sample.disks
    assert disk.label == "data" and disk.total_bytes == st.f_blocks * st.f_frsize
    assert 0 < disk.used_pct < 100


def test_dev_shm_usage_counts_files_written_there():
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this system")
    collector = HostCollector()
    before = collector.sample().shm.used_bytes
    path = Path("/dev/shm") / f"vllm-manager-test-{os.getpid()}"
    try:
        path.write_bytes(b"\1" * (64 * MIB))  # like a KV offload mmap file
        after = collector.sample().shm.used_bytes
    finally:
        path.unlink(missing_ok=True)
    assert after - before >= 60 * MIB


def test_a_missing_model_dir_is_reported_not_raised(tmp_path):
    missing = tmp_path / "no-such-dir"
    (disk,) = HostCollector().sample([("models", missing)]).disks
    assert disk.total_bytes is None
    assert str(missing) in disk.error


@pytest.fixture
def busy_tree():
    """A parent that starts a child holding 200 MiB and spinning a core, like an engine core."""
    child = textwrap.dedent(
        """
        import time
        block = bytearray(200 * 1024 * 1024)
        for i in range(0, len(block), 4096):
            block[i] = 1
        end = time.time() + 60
        while time.time() < end:
            pass
        """
    )
    parent = textwrap.dedent(
        f"""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", {child!r}])
        p.wait()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    yield proc
    import psutil

    for p in psutil.Process(proc.pid).children(recursive=True):
        p.kill()
    proc.kill()
    proc.wait()


def test_process_tree_sums_rss_and_cpu_of_the_whole_tree(busy_tree):
    collector = HostCollector()
    deadline = time.time() + 30
    tree = None
    while time.time() < deadline:
        tree = collector.process_trees([busy_tree.pid])[busy_tree.pid]
        if len(tree.pids) == 2 and tree.rss_bytes > 200 * MIB:
            break
        time.sleep(0.2)
    assert tree.alive and len(tree.pids) == 2 and busy_tree.pid in tree.pids
    assert tree.rss_bytes > 200 * MIB
    time.sleep(1.0)
    tree = collector.process_trees([busy_tree.pid])[busy_tree.pid]
    # The child spins one core; on a shared 2-core box it still gets a good part of it.
    assert tree.cpu_pct is not None and tree.cpu_pct > 30


def test_first_reading_has_no_cpu_and_a_dead_root_reads_as_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        first = HostCollector().process_trees([proc.pid])[proc.pid]
        assert first.alive and first.cpu_pct is None  # no interval yet: n/a, not 0
    finally:
        proc.kill()
        proc.wait()
    gone = HostCollector().process_trees([proc.pid])[proc.pid]
    assert gone.alive is False and gone.rss_bytes is None
