"""One attempt's Ray job, from its submission to its end, and the token that closes the
Ray cluster to everyone else (the cluster's bring-up is ``hy3rl.launch``).

- **Submission and output.** ``ray job submit --submission-id <id>`` (this interpreter's
  Ray CLI) streams the driver's output into ``driver.log`` and this process's stdout (the
  rule's log). Ray 2.60's log tail can end quietly while the job still runs (its websocket
  closes: ray-project/ray#51601, #60665), so **the job's end comes from Ray's job status**
  (``JobSubmissionClient.get_job_status``, a terminal state: SUCCEEDED, FAILED, STOPPED),
  polled while the job runs, never from the end of the stream. A stream that ends while
  the job is not terminal is re-attached (``tail_job_logs``) from the character of the
  job's log where it ended, so that ``driver.log`` holds the whole log once.
- **Authentication.** Ray's dashboard and jobs API answer anyone on the network by
  default: a job's runtime env can be read (it holds no secret: ``hy3rl.jobenv``) and jobs
  submitted that run as this user. :class:`AuthToken` makes a fresh 256-bit token
  per launch in a file only this user can read (0600, on the shared results storage, so
  that every node's ``ray start`` reads the same file), removed at the teardown; every Ray
  process of the launch runs with ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` (Ray
  2.60's token authentication), and the launcher's own job client sends the token as a
  bearer header. A request without it is refused (401).
- **Bounded calls.** Every call to the dashboard has a time limit (``timeout_s``,
  ``train.ray.dashboard_timeout_s``): Ray's job SDK passes no timeout to ``requests`` (a
  dashboard that accepts the connection and never answers blocks it for ever), but its
  ``_do_request`` forwards keyword arguments to ``requests.request``, so
  :func:`bounded_client` gives each request what is left of the call's budget, the client's
  own version checks included, and reads each body against it (:func:`body_by`: ``requests``
  bounds each read, not the body). A call that does not answer in time is "unknown"
  (``status()`` returns None, ``stop()`` gives up), logged as silence, or as the HTTP error
  the dashboard answered (:meth:`JobRun.why`); no thread is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from hy3rl.jobenv import write_private

log = logging.getLogger("hy3rl.rayjob")

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# how Ray's job SDK reports an HTTP error the dashboard answered (dashboard_sdk._raise_error)
HTTP_ERROR = re.compile(r"status code (\d{3})")
# The line after which `ray job submit` prints the job's own log (ray/dashboard/modules/
# job/cli.py); what comes before it is the CLI's own chatter.
TAIL_MARKER = "Tailing logs until the job exits"
TOKEN_NAME = ".ray-auth-token"
TAIL_KEPT = 4096  # characters of the job's log kept to find where a stream ended


@cache
def _bounded_class() -> type:
    from ray.job_submission import JobSubmissionClient

    class BoundedJobClient(JobSubmissionClient):
        """Ray's job client whose every HTTP request (the constructor's version checks
        included) gets what is left of the budget ending at ``until`` (monotonic seconds)
        as its ``requests`` timeout (module doc)."""

        def __init__(self, address: str, headers: dict[str, str], until: float):
            self.until = until
            super().__init__(address, headers=headers)

        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            left = self.until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no time left for {method} {endpoint}")
            kwargs.setdefault("timeout", left)
            kwargs.setdefault("hooks", {"response": body_by(self.until)})
            return super()._do_request(method, endpoint, **kwargs)

    return BoundedJobClient


def body_by(until: float) -> Callable[..., Any]:
    """A ``requests`` response hook that reads the body by ``until`` (monotonic seconds):
    ``requests``' own timeout bounds each read, not the whole body, so a body sent a byte
    at a time kept a call for minutes. The hook runs before ``requests`` reads the body; it
    reads what arrives (urllib3's ``read1``), checks the time between reads, and raises
    :class:`TimeoutError` once it is past."""
    def hook(r: Any, *_args: Any, **_kwargs: Any) -> Any:
        chunks = []
        while True:
            if time.monotonic() > until:
                r.close()
                raise TimeoutError(f"{r.request.method} {r.url}: the body did not arrive "
                                   f"in the call's time ({sum(map(len, chunks))} bytes)")
            data = r.raw.read1(65536, decode_content=True)
            if not data:
                break
            chunks.append(data)
        r._content, r._content_consumed = b"".join(chunks), True  # what requests reads
        return r
    return hook


def bounded_client(address: str, headers: dict[str, str], until: float) -> Any:
    """A JobSubmissionClient for ``address`` whose requests end by ``until`` (module doc)."""
    return _bounded_class()(address, dict(headers), until)


def resume_offset(full: str, tail: str, counted: int) -> int:
    """Where in ``full`` (the job's whole log so far) a stream that ended stopped: right
    after ``tail``, the last characters it wrote. The CLI may have printed lines of its own
    after its tail ended (the job's status): up to five last lines of ``tail`` are dropped
    until the rest is found. Falls back to ``counted`` (the characters it wrote) when
    ``tail`` is too short to be told apart or is not found."""
    lines = tail.splitlines(keepends=True)
    for drop in range(min(len(lines), 6)):
        probe = "".join(lines[:len(lines) - drop])
        if len(probe) < 40:
            break
        at = full.rfind(probe)
        if at >= 0:
            return at + len(probe)
    return min(counted, len(full))


@dataclass
class AuthToken:
    """A per-launch Ray token in ``path`` (0600)."""

    path: Path
    token: str

    @classmethod
    def create(cls, directory: Path) -> AuthToken:
        path = directory / TOKEN_NAME
        token = secrets.token_hex(32)
        write_private(path, token)
        return cls(path, token)

    def env(self) -> dict[str, str]:
        """What every Ray process of the launch runs with."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.path)}

    def headers(self) -> dict[str, str]:
        """The job client's bearer header."""
        return {"Authorization": f"Bearer {self.token}"}

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def without_auth(env: dict[str, str]) -> dict[str, str]:
    """``env`` without Ray's authentication variables (a launch sets its own)."""
    return {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                                                      "RAY_AUTH_TOKEN_PATH")}


@dataclass
class JobRun:
    """The Ray job ``submission_id`` on the dashboard at ``address`` (module doc).
    ``ray_cli``: the Ray CLI; ``env``: the environment of the CLI (with the token's);
    ``headers``: the job client's; ``redact``: applied to every line of output before it is
    written; ``driver_log``: where the output goes (and this process's stdout);
    ``timeout_s``: the limit of each call to the dashboard (module doc)."""

    address: str
    submission_id: str
    ray_cli: str
    driver_log: Path
    env: dict[str, str]
    headers: dict[str, str]
    redact: Callable[[str], str] = str
    timeout_s: float = 10.0
    proc: subprocess.Popen | None = None
    job_chars: int = 0  # characters of the job's own log written so far
    job_tail: str = ""  # the last TAIL_KEPT of them
    reattached: int = 0
    known: bool = False  # Ray answered a status for the job at least once
    # the dashboard's last answer was that the job does not exist yet (the submission, an
    # upload first, is still on its way): an answer, not an outage
    unregistered: bool = False
    streams: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, until: float | None = None) -> Any:
        """A job client whose requests end by ``until`` (default: ``timeout_s`` from now)."""
        if until is None:
            until = time.monotonic() + self.timeout_s
        return bounded_client(self.address, self.headers, until)

    def submit(self, runtime_env: Path, entrypoint: list[str]) -> list[str]:
        """Submit the job; its output streams from now on. Returns the command."""
        cmd = [self.ray_cli, "job", "submit", "--address", self.address,
               "--submission-id", self.submission_id, "--runtime-env", str(runtime_env),
               "--", *entrypoint]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=self.env)
        reader = threading.Thread(target=self._pump_cli, daemon=True)
        reader.start()
        self.streams.append(reader)
        return cmd

    def _write(self, text: str, job: bool) -> None:
        line = self.redact(text)
        with self._lock, open(self.driver_log, "a") as fh:
            fh.write(line)
            if job:
                self.job_chars += len(text)
                self.job_tail = (self.job_tail + text)[-TAIL_KEPT:]
        sys.stdout.write(line)
        sys.stdout.flush()

    def _pump_cli(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        in_log = False
        for raw in self.proc.stdout:
            text = raw.decode(errors="replace")
            self._write(text, in_log)
            if not in_log and TAIL_MARKER in text:
                in_log = True

    def stream_open(self) -> bool:
        """Whether a log stream still runs."""
        return any(t.is_alive() for t in self.streams)

    def reattach(self) -> None:
        """Follow the job's log again from the character where the last stream ended
        (:func:`resume_offset` on the job's log so far; a thread running Ray's
        ``tail_job_logs``, which starts at the log's beginning)."""
        self.reattached += 1
        try:
            skip = resume_offset(self.client().get_job_logs(self.submission_id),
                                 self.job_tail, self.job_chars)
        except Exception as exc:  # the count is the next best answer
            log.warning("ray job logs %s: %s", self.submission_id, exc)
            skip = self.job_chars
        log.warning("the log stream of Ray job %s ended while the job runs: re-attached "
                    "(%d) from character %d of its log", self.submission_id,
                    self.reattached, skip)
        reader = threading.Thread(target=self._pump_tail, args=(skip,), daemon=True)
        reader.start()
        self.streams.append(reader)

    def _pump_tail(self, skip: int) -> None:
        async def follow() -> None:
            left = skip
            # The stream itself lasts as long as the job: only setting it up is bounded.
            async for chunk in self.client().tail_job_logs(self.submission_id):
                if left >= len(chunk):
                    left -= len(chunk)
                    continue
                chunk, left = chunk[left:], 0
                self._write(chunk, True)

        try:
            asyncio.run(follow())
        except Exception as exc:  # the next status poll decides; another re-attach may come
            log.warning("re-attached log stream of %s ended: %s", self.submission_id, exc)

    def status(self) -> str | None:
        """Ray's status of the job (PENDING, RUNNING, SUCCEEDED, ...); None (unknown) when
        the dashboard does not answer within ``timeout_s``."""
        try:
            status = self.client().get_job_status(self.submission_id)
        except Exception as exc:
            # Ray's SDK raises RuntimeError("Request failed with status code 404: Job <id>
            # does not exist.") for a job the dashboard does not know yet
            self.unregistered = not self.known and "does not exist" in str(exc)
            if self.unregistered:
                log.info("ray job status %s: not registered yet", self.submission_id)
            else:
                log.warning("ray job status %s: %s (unknown)", self.submission_id,
                            self.why(exc))
            return None
        self.known, self.unregistered = True, False
        return str(getattr(status, "value", status))

    def why(self, exc: BaseException) -> str:
        """What a dashboard call's failure was: an HTTP error it answered (Ray's SDK raises
        "Request failed with status code <n>: ..."), or no answer in time."""
        m = HTTP_ERROR.search(str(exc))
        if m:
            return (f"the dashboard at {self.address} answered HTTP {m.group(1)}: "
                    f"{str(exc)[:300]}")
        return f"no answer from {self.address} within {self.timeout_s:g}s: {exc}"

    def submit_failed(self) -> str | None:
        """When ``ray job submit`` exited non-zero and Ray never knew the job (the
        submission itself failed: a bad runtime env, a refused token): the CLI's last
        output lines; else None."""
        code = None if self.proc is None else self.proc.poll()
        if self.known or code in (None, 0):
            return None
        try:
            tail = self.driver_log.read_text(errors="replace").splitlines()[-15:]
        except OSError:
            tail = []
        return f"ray job submit exited {code}: " + " | ".join(ln.strip() for ln in tail
                                                             if ln.strip())

    def info(self) -> Any:
        return self.client().get_job_info(self.submission_id)

    def stop(self) -> bool:
        """Ask Ray to stop the job: the job client first (no CLI start-up: a stop right
        after a save must land before the next step), the CLI if that fails and time is
        left; both within ``timeout_s``. Whether a stop was sent."""
        until = time.monotonic() + self.timeout_s
        try:
            self.client(until).stop_job(self.submission_id)
            log.info("ray job stop %s", self.submission_id)
            return True
        except Exception as exc:
            left = until - time.monotonic()
            log.warning("ray job stop %s via the job client: %s; %s", self.submission_id,
                        self.why(exc),
                        f"trying the CLI ({left:.0f}s left)" if left >= 1 else
                        f"no answer within {self.timeout_s:g}s (not stopped by Ray)")
            if left < 1:
                return False
        try:
            proc = subprocess.run([self.ray_cli, "job", "stop", "--no-wait", "--address",
                                   self.address, self.submission_id],
                                  capture_output=True, timeout=left, env=self.env)
        except (subprocess.TimeoutExpired, OSError) as exc:
            log.warning("ray job stop %s (CLI): %s", self.submission_id, exc)
            return False
        log.info("ray job stop %s (CLI): exit %d", self.submission_id, proc.returncode)
        return proc.returncode == 0

    def close(self, wait_s: float = 10) -> None:
        """End the CLI's stream (it may still tail a job being stopped) and let the
        streams finish writing."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + wait_s
        for t in self.streams:
            t.join(max(0.0, deadline - time.monotonic()))
