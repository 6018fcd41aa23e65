"""A peer engine's worker process, spoken to one JSON line at a time (see ortgenai_worker.py)."""

from __future__ import annotations

import json
import subprocess
import tempfile

from dspark_trt.errors import DsparkError


class WorkerClient:
    """Starts ``cmd`` and asks it ``hello``; :meth:`ask` sends one command and returns its answer, raising
    a one-line DsparkError (naming ``name``) when the worker failed or stopped."""

    def __init__(self, cmd: list[str], name: str, env: dict | None = None):
        self.name = name
        # The worker's log goes to a file (a pipe nobody reads while it runs would fill up and stall it).
        self.log = tempfile.TemporaryFile(mode="w+", prefix=f"dspark-peer-{name}-")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env)
        self.hello = self.ask({"cmd": "hello"})

    def ask(self, msg: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            while line and not line.startswith("{"):  # not ours: a stray print that reached the pipe
                line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait()
            self.log.seek(0)
            lines = [s for s in self.log.read().strip().splitlines() if s.strip()]
            # The exception's own line where there is one (a library may log more after it).
            at = max((i for i, s in enumerate(lines) if "Error" in s), default=len(lines) - 1)
            err = lines[at:at + 2] if at + 1 < len(lines) and lines[at + 1].startswith(" ") else lines[at:at + 1]
            err = [" ".join(s.strip() for s in err)] if err else []
            raise DsparkError(f"the {self.name} peer's worker stopped (exit {self.proc.returncode}): "
                              f"{(err or ['no message'])[0].strip()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise DsparkError(f"the {self.name} peer failed: {reply.get('error')}")
        return reply

    def run(self, prompts, concurrency: int, n_requests: int, max_new_tokens: int) -> dict:
        """{"wall_s", "requests": [{"token_ids", "generated_tokens", "latency_s"}]} for one closed-loop run."""
        return self.ask({"cmd": "run", "prompts": prompts, "concurrency": int(concurrency),
                         "requests": int(n_requests), "max_new_tokens": int(max_new_tokens)})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
