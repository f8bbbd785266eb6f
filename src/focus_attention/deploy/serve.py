"""Serving an exported Focus model over HTTP (docs/deploy.md): ``transformers serve`` run on
a directory written by ``focus export`` (it loads through ``trust_remote_code``, so Focus is
active), as a subprocess on the loopback address that :class:`ServedModel` starts, waits for
and always stops. Used by ``focus bench serve`` and the server's tests. Imports neither torch
nor transformers: the server runs in its own process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

__all__ = ["LOOPBACK", "ServedModel", "free_port", "serve_command"]

#: the only address the server listens on
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now (the system picks it; another process may still take
    it before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_command(
    model_dir: str | os.PathLike,
    port: int,
    *,
    device: str = "cpu",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The ``transformers serve`` command line that serves ``model_dir`` (an exported Focus
    directory, or any model directory) on :data:`LOOPBACK` ``port``, pinned to that model,
    with ``trust_remote_code`` (an export's ``modeling_focus.py`` attaches Focus) and
    ``extra`` flags of ``transformers serve`` (``--continuous-batching``...)."""
    return [
        sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
        "--trust-remote-code", "--device", device, "--host", LOOPBACK, "--port", str(port),
        *extra,
    ]  # fmt: skip


class ServedModel:
    """``transformers serve`` on ``model_dir`` as a subprocess (:func:`serve_command`), as a
    context manager: entering starts it and waits until ``GET /health`` answers (at most
    ``ready_timeout`` seconds), leaving stops it (SIGTERM, then SIGKILL after 10 s).

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        model: the model name requests give (``model_dir`` as passed to the server).
        log_path: the server's stdout and stderr.

    Raises:
        ValueError: ``model_dir`` is not a directory.
        RuntimeError: on entering, the server exited or did not answer in time (with the
            end of its log).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        log_path: str | os.PathLike,
        *,
        device: str = "cpu",
        extra: tuple[str, ...] = (),
        ready_timeout: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if not Path(model_dir).is_dir():
            raise ValueError(f"model_dir: expected a model directory, received {model_dir}")
        self.model = str(model_dir)
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = Path(log_path)
        self.ready_timeout = ready_timeout
        self.command = serve_command(model_dir, self.port, device=device, extra=extra)
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self._log: IO[Any] | None = None

    def __enter__(self) -> ServedModel:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start(self) -> None:
        """Start the server's process without waiting for it (:meth:`wait_ready` waits; the
        context manager does both). Servers started one after another this way load at
        the same time."""
        self._log = self.log_path.open("w", encoding="utf-8")
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        """Whether the server's process is running."""
        return self.process is not None and self.process.poll() is None

    def wait_ready(self) -> None:
        """Poll ``GET /health`` until it answers 200 (see the class for the errors)."""
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"transformers serve exited while starting:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"transformers serve did not answer on {self.url} within {self.ready_timeout:.0f} s:"
            f"\n{self.log_tail()}"
        )

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log."""
        if self._log is not None:
            self._log.flush()
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server (idempotent): SIGTERM, SIGKILL after 10 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
