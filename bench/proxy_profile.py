"""One closed loop through the manager's /v1 and straight to its worker, for profiling the front door.

    python -m bench.proxy_profile CLIENTS REQUESTS [--stream] [--py-spy OUT]

A fresh ``python -m manager serve`` (its own data dir) starts bench/fast_upstream.py as its worker;
CLIENTS clients send REQUESTS chat completions straight to the worker, then the same through the
manager, and the summaries (latency, answers a second, the manager's CPU per 1,000 requests) are
printed as JSON. With ``--py-spy OUT``, py-spy records the manager during its loop into OUT (its raw
collapsed-stack format). bench/proxy.py is the full benchmark; this is the quick loop for one change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.closed_loop import Target, batch
from bench.proxy import MODEL, fast_worker, manager_processes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("clients", type=int)
    ap.add_argument("requests", type=int)
    ap.add_argument("--stream", action="store_true", help="streams of 16 chunks, 10 ms apart")
    ap.add_argument("--py-spy", type=Path, help="record the manager with py-spy into this file")
    ap.add_argument("--forwarders", type=int, default=0, help="the manager's VLLM_MANAGER_FORWARDERS")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-profile-"))
    out: dict = {}
    with fast_worker(work, 0.01, args.forwarders) as (mgr, worker):
        for name, port in (("direct", worker["port"]), ("manager", mgr.port)):
            target = Target(name, port, "/v1/chat/completions", MODEL)
            asyncio.run(batch(target, args.clients, 200, args.stream, 16, {}))  # warm up
            spy = None
            if args.py_spy and name == "manager":
                argv = ["py-spy", "record", "-p", str(mgr.pid), "-r", "500", "-f", "raw", "-o", str(args.py_spy)]
                spy = subprocess.Popen([*argv, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1)
            cpu = {"manager": manager_processes(mgr.pid)} if name == "manager" else {}
            samples = asyncio.run(batch(target, args.clients, args.requests, args.stream, 16, cpu))
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            out[name] = samples.summary()
    print(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
