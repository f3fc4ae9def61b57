"""Starts one engine detached from whoever asked: ``python -m manager.cluster.launcher`` reads
``{"argv", "env", "log_path", "cwd"}`` as JSON on stdin, starts the engine in its own session writing
to its log file, prints ``{"pid", "create_time", "cmdline"}`` and exits.

A node's agent starts engines through it so that they are not the agent's children: Ray ends the
children of a worker process when it exits, and an engine must outlive its agent (a manager restart
re-adopts it) and a lost raylet (the node coming back re-adopts it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from manager import processes
from manager.host import process


def main() -> int:
    order = json.loads(sys.stdin.read())
    try:
        popen = process.spawn(order["argv"], order["env"], Path(order["log_path"]), Path(order["cwd"]))
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 0
    found = processes.identity(popen.pid)
    print(
        json.dumps(
            {
                "pid": popen.pid,
                "create_time": found.create_time if found else None,
                "cmdline": list(found.cmdline) if found else order["argv"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
