"""Serving with forwarder processes (VLLM_MANAGER_FORWARDERS > 0): they take the HTTP port, and the
manager's process serves them on Unix sockets in a private directory (its HTTP server, for what they
relay, and the lease channel). It starts them, starts one again when it dies, and stops them last.

One Python process forwards a few thousand small /v1 answers a second; past that, clients wait
in line for its one event loop (bench/README.md, "The front door's own cost"). Forwarders share the
work while the scheduler, the store and every worker stay the manager process's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Protocol

import uvicorn
from fastapi import FastAPI

from manager.auth.throttle import WrongTokenThrottle
from manager.frontdoor import forwarder
from manager.frontdoor.lease_channel import Door, LeaseServer
from manager.settings import Settings

log = logging.getLogger("vllm_manager.frontdoor")

RESTART_PAUSE_S = 1.0


class ManagerParts(Protocol):
    """What the lease channel serves the forwarders from: the running manager's front door and its
    limits on wrong secrets (``manager.runtime.Runtime``, the app's ``state.runtime``)."""

    @property
    def front_door(self) -> Door: ...

    @property
    def throttles(self) -> Mapping[str, WrongTokenThrottle]: ...


class Forwarders:
    """The forwarder processes: started, watched, started again when one dies, stopped."""

    def __init__(self, settings: Settings, sockets: forwarder.Sockets) -> None:
        self.settings = settings
        self.sockets = sockets
        self._spawn = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess | None] = [None] * settings.forwarders
        self.stopping = False  # set as soon as the manager is told to stop: a forwarder that ends then stays ended

    def _start(self, number: int) -> None:
        process = self._spawn.Process(
            target=forwarder.run,
            args=(self.settings, self.sockets, number),
            name=f"vllm-manager forwarder {number}",
            daemon=True,
        )
        process.start()
        self.processes[number] = process

    def start(self) -> None:
        for number in range(len(self.processes)):
            self._start(number)

    async def watch(self) -> None:
        while not self.stopping:
            await asyncio.sleep(RESTART_PAUSE_S)
            for number, process in enumerate(self.processes):
                if process is not None and not process.is_alive() and not self.stopping:
                    log.warning(
                        "forwarder %d (pid %s) ended with exit code %s: starting it again",
                        number,
                        process.pid,
                        process.exitcode,
                    )
                    self._start(number)

    def stop(self) -> None:
        """SIGTERM to each: it stops taking connections and finishes its requests (up to
        forwarder.DRAIN_S), then ends; one that does not is killed."""
        self.stopping = True
        for process in self.processes:
            if process is not None and process.is_alive():
                process.terminate()
        for process in self.processes:
            if process is not None:
                process.join(forwarder.DRAIN_S + 5)
                if process.is_alive():
                    process.kill()
                    process.join()


class ManagerServer(uvicorn.Server):
    """The manager's own server when forwarders take the port: told to stop, it first stops them (they
    finish their requests, whose leases it still serves) and closes the lease channel; then its own
    parts stop (the app's shutdown), and the private directory goes. All of it before a SIGTERM,
    which uvicorn raises again once it is done, ends the process."""

    def __init__(self, config: uvicorn.Config, processes: Forwarders, run_dir: Path) -> None:
        super().__init__(config)
        self.processes = processes
        self.run_dir = run_dir
        self.leases: LeaseServer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.processes.stopping = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(self.processes.stop)
        if self.leases is not None:
            await self.leases.close()
        await super().shutdown(sockets)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def hold_port(host: str, port: int) -> tuple[socket.socket, socket.socket | None]:
    """The port, held for this manager while it runs: a socket bound to it (not listened on), and on
    Linux a name in the abstract socket namespace that no second manager can take, since forwarders'
    SO_REUSEPORT would otherwise let one share the port unnoticed. OSError: the port is taken."""
    claim = None
    if sys.platform == "linux":
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0vllm-manager {host}:{port}")
        except OSError:
            claim.close()
            raise OSError(f"another vllm-manager with forwarders serves {host}:{port}") from None
    try:
        return forwarder.port_socket(host, port), claim
    except OSError:
        if claim is not None:
            claim.close()
        raise


async def _serve(app: FastAPI, settings: Settings, run_dir: Path) -> None:
    sockets = forwarder.Sockets(http=run_dir / "manager.sock", leases=run_dir / "leases.sock")
    try:
        held = hold_port(settings.host, settings.port)  # for as long as the manager runs
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        raise SystemExit(3) from None
    # The manager's own server: on a Unix socket only the forwarders reach (its directory is private).
    # It trusts the client address they pass on (a forwarder believes a client's X-Forwarded-For only
    # from a proxy the admin named: manager.frontdoor.forwarder.run); its access log is theirs.
    config = uvicorn.Config(
        app, uds=str(sockets.http), log_level="info", access_log=False, proxy_headers=True, forwarded_allow_ips="*"
    )
    processes = Forwarders(settings, sockets)
    server = ManagerServer(config, processes, run_dir)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            await serving  # its start failed: the reason is logged, and it ends here
            return
        await asyncio.sleep(0.05)
    runtime: ManagerParts = app.state.runtime
    server.leases = LeaseServer(runtime.front_door, sockets.leases, runtime.throttles)
    await server.leases.start()
    processes.start()
    log.info(
        "%d forwarder processes take connections on http://%s:%d", settings.forwarders, settings.host, settings.port
    )
    watching = asyncio.create_task(processes.watch())
    try:
        await serving
    finally:
        watching.cancel()
        for sock in held:
            if sock is not None:
                sock.close()


def serve(app: FastAPI, settings: Settings) -> None:
    """Run the manager with ``settings.forwarders`` forwarder processes until it is told to stop."""
    run_dir = Path(tempfile.mkdtemp(prefix="vllm-manager-"))  # 0700: this user's alone
    loop_factory = uvicorn.Config(app).get_loop_factory()  # uvloop where it is installed, as uvicorn.run
    try:
        with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_serve(app, settings, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
