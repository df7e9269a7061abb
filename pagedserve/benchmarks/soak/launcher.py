"""`pagedserve bench soak --serve-args ...`: the soak starts the server itself (so that it knows its pid and
can check its processes), and at the end stops it with SIGTERM, which must exit 0."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


class LaunchedServer:
    def __init__(self, serve_args: str, log_path: str, start_timeout: float = 600.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        argv = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", *shlex.split(serve_args),
                "--host", "127.0.0.1", "--port", str(port)]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_healthy(start_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(f"the server exited with {self.proc.returncode} before serving; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise ValueError(f"the server did not answer /health within {timeout:g} s; see {self.log_path}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM; the exit status (killed and -9 if it does not exit within `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
