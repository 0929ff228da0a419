"""``train.notify_command``: a site's hook (a mail or chat command) run at each training
attempt's end, on the submit host.

The workflow's controller (the process running ``snakemake``) starts a :class:`Watcher` in
``onstart:`` (rules/common.smk), only when a ``train`` or ``train_segment`` job is to run
and the command is set. Its daemon thread polls ``train/attempts/`` every ``poll_s`` (10)
seconds for attempt records that are closed (``outcome`` other than ``running``) and not
yet in ``train/attempts/notified.json`` (``Layout.train_notified``, a JSON list of attempt
numbers, written atomically), and runs the command for each: ``shlex.split`` of it (no
shell), the record's absolute path appended as the last argument. ``onsuccess:`` and
``onerror:`` call :meth:`Watcher.stop`, which makes one last pass synchronously, so the
final attempt is notified before snakemake exits.

At most once: a record is added to notified.json before its hook starts, under a lock (a
thread lock in this process, and ``flock`` on the attempts folder across processes where
the filesystem offers it), so two watchers never both notify it, and a rerun never notifies
it again (a controller killed while a hook runs does not repeat it either). The first
watcher of a run (no notified.json yet) marks the records already closed as notified
without running the hook: turning the hook on for a run in progress does not replay its
history.

Never fatal: the hook's output and exit status, a timeout (``timeout_s``, 300; its process
group is killed) or a failure to start go to ``logs/notify.log`` (``Layout.log("notify")``),
a failure also as a warning on the controller's log; nothing here raises into training or
the workflow. The log names the hook's program only, not its arguments (a webhook URL may
hold a token).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hy3rl.atomic import write_json_atomic
from hy3rl.layout import ATTEMPT_RE, Layout
from hy3rl.timefmt import utc_now

log = logging.getLogger("hy3rl.notify")

POLL_S = 10.0
TIMEOUT_S = 300.0
_THREAD_LOCK = threading.Lock()


def closed_attempts(layout: Layout) -> list[int]:
    """Attempts whose record is closed (``outcome``, for older records ``exit_reason``, is
    not ``running``), ascending. A record that cannot be read counts as not closed yet."""
    folder = Path(layout.train_attempts)
    closed = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        m = ATTEMPT_RE.match(path.name)
        if not m:
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("outcome", rec.get("exit_reason", "running")) != "running":
            closed.append(int(m.group(1)))
    return sorted(closed)


def read_notified(layout: Layout) -> list[int] | None:
    """The attempts already notified; None when the run has no notified.json yet."""
    path = Path(layout.train_notified)
    if not path.exists():
        return None
    try:
        return sorted(int(k) for k in json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a JSON list of attempt numbers ({exc})") from None


@contextmanager
def _locked(layout: Layout) -> Iterator[None]:
    """Exclusive access to notified.json: this process's watchers, and other processes
    through flock on the attempts folder (a filesystem refusing flock on a folder leaves
    Snakemake's own lock, one controller per working directory)."""
    folder = Path(layout.train_attempts)
    folder.mkdir(parents=True, exist_ok=True)
    with _THREAD_LOCK:
        fd = os.open(folder, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                log.debug("no flock on %s (%s): this process's lock only", folder, exc)
            yield
        finally:
            os.close(fd)


def run_hook(command: str, record: Path, log_path: Path,
             timeout_s: float = TIMEOUT_S) -> str | None:
    """Run ``command`` with ``record`` appended, its output appended to ``log_path``.
    Returns None when it exited 0, else what went wrong (its exit status, a timeout: it is
    killed with its process group, or why it could not start)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as fh:
        def note(text: str) -> str:
            fh.write(f"{utc_now()} notify {record.name}: {text}\n")
            fh.flush()
            return text

        try:
            argv = [*shlex.split(command), str(record)]
        except ValueError as exc:
            return note(f"train.notify_command cannot be split into arguments: {exc}")
        note(f"running {argv[0]} (output below)")
        started = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            return note(f"could not start {argv[0]}: {exc}")
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return note(f"{argv[0]} timed out after {timeout_s:g} s: killed")
        done = note(f"{argv[0]} exited {code} after {time.monotonic() - started:.1f} s")
        return done if code else None


class Watcher:
    """Runs ``command`` once per closed attempt record of the run at ``layout`` (see the
    module doc): :meth:`start` the thread, :meth:`stop` it with a last pass."""

    def __init__(self, command: str, layout: Layout, *, poll_s: float = POLL_S,
                 timeout_s: float = TIMEOUT_S):
        self.command, self.layout = command, layout
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.log_path = Path(layout.log("notify"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hy3rl-notify", daemon=True)

    def _note(self, text: str) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as fh:
            fh.write(f"{utc_now()} notify: {text}\n")

    def start(self) -> Watcher:
        """Mark what was closed before the hook's first watcher (see the module doc), then
        poll in a daemon thread."""
        try:
            with _locked(self.layout):
                if read_notified(self.layout) is None:
                    before = closed_attempts(self.layout)
                    write_json_atomic(Path(self.layout.train_notified), before)
                    self._note(f"first watcher of this run: attempts {before} ended before "
                               "train.notify_command was watched; not notified")
        except (OSError, ValueError) as exc:
            self._failed(f"cannot read {self.layout.train_attempts}: {exc}")
        self._thread.start()
        return self

    def _claim(self) -> list[int]:
        """The closed attempts not notified yet, recorded as notified before any hook."""
        with _locked(self.layout):
            done = read_notified(self.layout) or []
            new = [k for k in closed_attempts(self.layout) if k not in done]
            if new:
                write_json_atomic(Path(self.layout.train_notified), sorted(done + new))
        return new

    def _failed(self, text: str) -> None:
        """A failure of this watcher (not of a hook): logged, never raised."""
        log.warning("train.notify_command: %s (see %s)", text, self.log_path)
        try:
            self._note(text)
        except OSError:
            pass  # the warning above is all there is

    def pass_once(self) -> list[int]:
        """Run the hook for every closed record not notified yet; the attempts notified."""
        try:
            new = self._claim()
        except (OSError, ValueError) as exc:
            self._failed(f"cannot read {self.layout.train_attempts}: {exc}")
            return []
        for k in new:
            record = Path(self.layout.attempt_record(k)).resolve()
            try:
                problem = run_hook(self.command, record, self.log_path, self.timeout_s)
            except OSError as exc:
                problem = f"cannot write {self.log_path}: {exc}"
            if problem:  # already in the log, where it could be written
                log.warning("train.notify_command: attempt %d: %s (see %s)", k, problem,
                            self.log_path)
        return new

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.pass_once()

    def stop(self) -> list[int]:
        """Stop polling (waiting for a hook in progress), then one last pass."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.pass_once()
