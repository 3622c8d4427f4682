"""`llgraph serve` in a subprocess, for the serve tests."""

import signal
import socket
import subprocess
import sys
import threading
import time

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`llgraph serve ...` in a subprocess, ready once it says where it listens."""

    def __init__(self, *args, ready_timeout: float = 180):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "llgraph", "serve", *args, "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while not any("listening at" in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def rss_mb(self) -> float:
        """The server process's resident memory (Linux)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
