"""schemathesis' own CLI against a real `vllm-manager serve`, as an outside tester would run it: every
operation, all phases, all checks, once with the admin token and once without it.

From the repository root:

    python -m bench.contract --max-examples 30 --out bench/results/contract.json

With the token, three checks are left out, each for a reason no schema can carry:
``not_a_server_error`` (a start of a stored config answers its declared 503 here: no engine can
come up within the run), ``positive_data_acceptance`` (a request valid by the schema can still name
a config or profile that does not exist: a 404 or 422 by design) and ``ignored_auth`` (after ten wrong
tokens the throttle answers 429, which the check reads as auth being ignored). Without a token every
check runs. Reported: schemathesis' own summary lines and the counts from its JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from bench.served import free_port, manager

EXCLUDED_WITH_TOKEN = "not_a_server_error,positive_data_acceptance,ignored_auth"


def st_run(url: str, headers: list[str], exclude: str | None, max_examples: int, report: Path) -> dict:
    argv = [
        str(Path(sys.executable).with_name("st")), "run", f"{url}/openapi.json",
        "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(max_examples), "--seed", "20261125", "--workers", "2",
        "--request-timeout", "30", "--report", "ndjson", "--report-ndjson-path", str(report),
        "--exclude-path-regex", "/stream$",
    ]  # fmt: skip
    for header in headers:
        argv += ["-H", header]
    if exclude:
        argv += ["--exclude-checks", exclude]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    tail = done.stdout.strip().splitlines()[-25:]
    cases = sum(1 for line in report.read_text().splitlines() if '"ScenarioFinished"' in line) if report.exists() else 0
    summary = [line for line in tail if re.search(r"\b(passed|failed|errored|skipped|Test cases)\b", line)]
    return {"exit": done.returncode, "scenarios": cases, "summary": summary, "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    token = "vmt_contract-bench-" + "b" * 24
    results = {}
    with tempfile.TemporaryDirectory(prefix="contract-") as tmp:
        for label, env, headers, exclude in (
            ("no_token", {"VLLM_MANAGER_API_TOKEN": ""}, [], None),
            ("token", {"VLLM_MANAGER_API_TOKEN": token}, [f"Authorization: Bearer {token}"], EXCLUDED_WITH_TOKEN),
        ):
            data = Path(tmp) / label / "data"
            with manager(data, free_port(), env) as server:
                results[label] = st_run(server.url, headers, exclude, args.max_examples, Path(tmp) / f"{label}.ndjson")
            log = (data.parent / "manager.log").read_text(errors="replace")
            results[label]["manager_tracebacks"] = log.count("Traceback (most recent call last)")
            results[label]["manager_500s"] = len(re.findall(r'" 500 ', log))
    out = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "max_examples": args.max_examples,
        "excluded_with_token": EXCLUDED_WITH_TOKEN.split(","),
        **results,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
