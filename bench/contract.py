"""schemathesis' own CLI against a real `vllm-manager serve` with an admin token, as an outside tester
would run it: every operation, all phases, all checks, once sending the token and once without it.

From the repository root:

    python -m bench.contract --max-examples 30 --out bench/results/contract.json

With the token, three checks are left out, each for a reason no schema can carry:
``not_a_server_error`` (a start of a stored config answers its declared 503 here: no engine can
come up within the run), ``positive_data_acceptance`` (a request valid by the schema can still name
a config or profile that does not exist, or a range longer than a report allows: 404 or 422 by design)
and ``ignored_auth`` (after ten wrong tokens the throttle answers 429, which the check reads as auth
being ignored). Without the token every check runs. Responses may take up to 60 s: a command preview
runs vLLM's own parser (5-12 s on a 2-core box). Reported: schemathesis' summary, and the manager's
500s and tracebacks from its log.
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

import httpx

from bench.served import free_port, manager

EXCLUDED_WITH_TOKEN = "not_a_server_error,positive_data_acceptance,ignored_auth"
TOKEN = "vmt_contract-bench-" + "b" * 24
RUNS: tuple[tuple[str, list[str], str | None], ...] = (
    ("no_token", [], None),
    ("token", [f"Authorization: Bearer {TOKEN}"], EXCLUDED_WITH_TOKEN),
)


def st_run(schema: Path, url: str, headers: list[str], exclude: str | None, max_examples: int, report: Path) -> dict:
    argv = [
        str(Path(sys.executable).with_name("st")), "run", str(schema), "--url", url,
        "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(max_examples), "--seed", "20261125", "--workers", "2",
        "--request-timeout", "60", "--max-response-time", "60",
        "--report", "ndjson", "--report-ndjson-path", str(report),
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
    return {"exit": done.returncode, "scenarios": cases, "summary": summary, "tail": tail, "output": done.stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=30)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="a folder for schemathesis' whole output of each run")
    parser.add_argument("--only", choices=[label for label, _, _ in RUNS], help="one of the two runs")
    args = parser.parse_args()
    results: dict = {}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with tempfile.TemporaryDirectory(prefix="contract-") as tmp:
        data = Path(tmp) / "data"
        with manager(data, free_port(), {"VLLM_MANAGER_API_TOKEN": TOKEN}) as server:
            # The document itself is a read, closed without the token: it is fetched once, with it.
            schema = Path(tmp) / "openapi.json"
            schema.write_bytes(httpx.get(f"{server.url}/openapi.json", headers=auth).content)
            for label, headers, exclude in RUNS:
                if args.only and label != args.only:
                    continue
                report = Path(tmp) / f"{label}.ndjson"
                results[label] = st_run(schema, server.url, headers, exclude, args.max_examples, report)
                (Path(tmp) / f"{label}.txt").write_text("\n".join(results[label].pop("tail")))
                if args.keep:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    (args.keep / f"{label}.txt").write_text(results[label]["output"])
                results[label].pop("output")
        log = (data.parent / "manager.log").read_text(errors="replace")
        results["manager_tracebacks"] = log.count("Traceback (most recent call last)")
        results["manager_500s"] = len(re.findall(r'" 500 ', log))
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
