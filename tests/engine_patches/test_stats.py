import json
import os
import subprocess
import sys
import time

from engine_patches import stats


def test_publish_writes_one_file_per_process_atomically(tmp_path):
    stats.configure(tmp_path, role="worker", interval_s=0.05)
    stats.publish("pinned", {"pinned_bytes": 10})
    stats.publish("lora_pool", {"hits": 3})
    deadline = time.time() + 5
    while time.time() < deadline and not stats.stats_path(tmp_path).exists():
        time.sleep(0.02)
    time.sleep(0.2)
    docs = stats.read_stats(tmp_path)
    assert len(docs) == 1
    doc = docs[0]
    assert doc["pid"] == os.getpid() and doc["role"] == "worker"
    assert doc["pinned"] == {"pinned_bytes": 10} and doc["lora_pool"] == {"hits": 3}
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed, not left behind
    stats.configure(None)


def test_reader_skips_dead_pids_and_half_written_files(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    (tmp_path / f"stats-{dead_pid}.json").write_text(json.dumps({"pid": dead_pid}))
    (tmp_path / f"stats-{os.getpid()}.json").write_text('{"pid": ')  # half written
    assert stats.read_stats(tmp_path) == []
    (tmp_path / f"stats-{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid()}))
    assert [d["pid"] for d in stats.read_stats(tmp_path)] == [os.getpid()]
    assert stats.read_stats(tmp_path / "missing") == []


def test_writes_at_most_once_a_second(tmp_path):
    stats.configure(tmp_path, interval_s=1.0)
    stats.flush()
    path = stats.stats_path(tmp_path)
    first = path.stat().st_mtime_ns
    for i in range(50):
        stats.publish("pinned", {"n": i})
    time.sleep(0.3)
    assert path.stat().st_mtime_ns == first  # still the old file, 50 publishes later
    time.sleep(1.5)
    assert json.loads(path.read_text())["pinned"] == {"n": 49}
    stats.configure(None)
