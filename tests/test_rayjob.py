"""hy3rl.rayjob without a Ray cluster: the per-launch token, a submission that failed, a
dashboard that accepts connections and never answers.
(The job's end from Ray's status, the re-attached stream and the refusal of a request
without the token run on a real Ray cluster: tests/test_train_ray.py.)"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hy3rl import launch, rayjob
from hy3rl import watchdog as wd


def test_auth_token_is_private_fresh_and_removed(tmp_path: Path) -> None:
    token = rayjob.AuthToken.create(tmp_path / "attempt-1")
    assert token.path.stat().st_mode & 0o777 == 0o600
    assert len(token.token) == 64 and token.path.read_text() == token.token
    assert token.env() == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token.path)}
    assert token.headers() == {"Authorization": f"Bearer {token.token}"}
    again = rayjob.AuthToken.create(tmp_path / "attempt-1")  # a restart: a new token
    assert again.token != token.token and again.path.read_text() == again.token
    again.remove()
    assert not again.path.exists()
    env = {"PATH": "/bin", "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "x",
           "RAY_AUTH_TOKEN_PATH": "/y"}
    assert rayjob.without_auth(env) == {"PATH": "/bin"}


def test_a_submission_that_failed_says_why(tmp_path: Path) -> None:
    log = tmp_path / "driver.log"
    log.write_text("Job submission server address: http://h:1\n"
                   "RuntimeError: Request failed with status code 401: Unauthorized\n")
    job = rayjob.JobRun("http://127.0.0.1:9", "r-1-1", "ray", log, env={}, headers={})
    assert job.submit_failed() is None  # not submitted
    job.proc = subprocess.Popen(["sh", "-c", "exit 3"])
    job.proc.wait()
    why = job.submit_failed()
    assert why and why.startswith("ray job submit exited 3: ") and "401" in why
    job.known = True  # Ray knew the job: its status decides, not the CLI's exit
    assert job.submit_failed() is None


def test_a_stream_resumes_where_it_ended_not_after_the_clis_own_lines() -> None:
    log = "".join(f"step:{k} - critic/rewards/mean:0.{k}\n" for k in range(1, 9))
    written = log[:log.index("step:4")]
    # the CLI printed the job's status after its tail ended: those lines are not the job's
    chatter = "------------------------------------------\nStatus for job 'r-1-1': RUNNING\n"
    at = rayjob.resume_offset(log, (written + chatter)[-rayjob.TAIL_KEPT:], len(written) + 70)
    assert log[at:].startswith("step:4 - ")
    assert rayjob.resume_offset(log, written, len(written)) == len(written)
    # too little written to be told apart, or not found: the count
    assert rayjob.resume_offset(log, "step:", 5) == 5
    assert rayjob.resume_offset(log, "x" * 50, 10 ** 6) == len(log)


# --------------------------------------------------------------------------- a silent dashboard


@pytest.fixture
def silent_dashboard():
    """A dashboard address whose server accepts every connection and never answers (a
    listening socket and a thread that accepts and holds the connections)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", held
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


def test_status_and_stop_return_unknown_within_their_timeout(tmp_path: Path,
                                                             silent_dashboard) -> None:
    address, held = silent_dashboard
    job = rayjob.JobRun(address, "r-1-1", "ray", tmp_path / "driver.log", env={},
                        headers={}, timeout_s=0.4)
    rayjob._bounded_class()  # Ray's import is not the call's time
    threads = threading.active_count()
    for call, unknown in ((job.status, None), (job.stop, False), (job.status, None)):
        t0 = time.monotonic()
        assert call() is unknown
        took = time.monotonic() - t0
        assert 0.35 <= took < 1.5, (call, took)  # it waited for an answer, then gave up
    assert held, "the calls never reached the silent dashboard"
    assert not job.known
    assert threading.active_count() == threads  # nothing left running behind a call
    with pytest.raises(Exception):  # noqa: B017 - Ray's or requests' own error
        job.info()


@pytest.fixture
def odd_dashboard():
    """A dashboard (a real HTTP server here) that answers Ray's version check, then for a
    job's status either sends its body a byte every 0.2 s (``mode["body"] = "trickle"``) or
    answers HTTP 500 (``"error"``), or a well-formed status (``"ok"``)."""
    import http.server
    import json as _json

    import ray

    mode = {"body": "trickle"}
    job = _json.dumps({"type": "SUBMISSION", "job_id": None, "submission_id": "r-1-1",
                       "status": "RUNNING", "entrypoint": "x"}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_args):
            pass

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/api/version":
                body = _json.dumps({"ray_version": ray.__version__, "version": "4",
                                    "ray_commit": "x", "session_name": "s"}).encode()
            elif mode["body"] == "error":
                self.send_response(500)
                self.send_header("Content-Length", "4")
                self.end_headers()
                self.wfile.write(b"boom")
                return
            else:
                body = job
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.path == "/api/version" or mode["body"] == "ok":
                self.wfile.write(body)
                return
            for i in range(len(body)):  # a byte at a time: each read well within its timeout
                try:
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", mode
    server.shutdown()
    server.server_close()


def test_a_trickled_body_or_an_http_error_is_bounded_and_named(tmp_path: Path, odd_dashboard,
                                                               caplog) -> None:
    """Issue 44: requests' timeout bounds each read, not the body: a status body sent a byte
    every 0.2 s kept status() for minutes with its 5-s limit. Now the whole call ends within
    its limit (unknown); an HTTP 500 is logged as the dashboard's answer, not as silence;
    a well-formed answer is read."""
    address, mode = odd_dashboard
    job = rayjob.JobRun(address, "r-1-1", "ray", tmp_path / "driver.log", env={},
                        headers={}, timeout_s=1.0)
    rayjob._bounded_class()

    def ours() -> int:  # threads other than the test server's own request handlers
        return sum(1 for t in threading.enumerate() if "process_request" not in t.name)

    threads = ours()
    t0 = time.monotonic()
    assert job.status() is None
    # the body takes ~20 s at a byte every 0.2 s; the call ends at its 1-s budget plus at
    # most one read's wait (a wide margin for a loaded machine)
    assert time.monotonic() - t0 < 5.0
    assert "the body did not arrive in the call's time" in caplog.text
    assert ours() == threads  # nothing left running behind the call
    mode["body"] = "error"
    caplog.clear()
    assert job.status() is None
    assert f"the dashboard at {address} answered HTTP 500: " in caplog.text
    assert "no answer" not in caplog.text
    mode["body"] = "ok"
    assert job.status() == "RUNNING" and job.known


def silent_launch(tmp_path: Path, address: str, monkeypatch, outage_s: float, steps: int,
                  shutdown_s: float):
    """A Launcher whose dashboard is ``address``, supervising a trainer that logs one
    metrics line every 0.3 s for ``steps`` steps and then lingers: the submission is
    ``ray job submit`` as far as the launcher knows (a CLI that runs the entrypoint here, as
    Ray would on the cluster)."""

    cli = tmp_path / "ray"
    cli.write_text('#!/bin/bash\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n')
    cli.chmod(0o755)
    metrics = tmp_path / "attempt-1.metrics.jsonl"
    trainer = tmp_path / "launch.sh"
    trainer.write_text(
        f'for s in $(seq 1 {steps}); do sleep 0.3\n'
        f'  echo "{{\\"step\\": $s, \\"data\\": {{\\"timing_s/step\\": 0.3}}}}" >> {metrics}\n'
        'done\nexec sleep 30\n')
    monkeypatch.setattr(launch, "RAY", str(cli))
    monitor = wd.Monitor(
        metrics=metrics, schedule=wd.Schedule(0, 0, steps),
        model=wd.TimeModel(wd.Allowances(60, 60, None, None, shutdown_s, 60, 600)),
        stall=wd.StallPolicy(None, 3, 60, 600), margin_s=0, is_saved=lambda s: False,
        deadline=wd.Deadline(lambda: None))
    spec = launch.LaunchSpec(
        submission_id="r-1-1", launch_script=trainer, runtime_env=tmp_path / "env.yaml",
        log_dir=tmp_path / "logs", monitor=monitor, poll_s=0.2,
        ray=dataclasses.replace(launch.default_ray(), dashboard_timeout_s=0.4,
                                dashboard_outage_s=outage_s))
    spec.log_dir.mkdir()
    launcher = launch.Launcher(spec)
    launcher.dashboard = address
    return launcher, metrics


def stop_bounded(launcher) -> bool:
    """The teardown's stop of the Ray job (bounded: the dashboard is silent), then the
    stand-in CLI's process ended."""
    t0 = time.monotonic()
    sent = launcher.job.stop()
    assert time.monotonic() - t0 < 1.5
    launcher.job.proc.kill()
    launcher.job.close(wait_s=2)
    return sent


def test_a_silent_dashboard_is_ridden_out_while_the_trainer_progresses(
        tmp_path: Path, silent_dashboard, monkeypatch, caplog) -> None:
    """The status is unknown throughout; the trainer's own lines are watched, and the
    attempt ends for the trainer's state only: its last step logged, then no exit within
    the shutdown allowance (no checkpoint schedule: ``succeeded``), never launcher_error."""
    rayjob._bounded_class()
    launcher, metrics = silent_launch(tmp_path, silent_dashboard[0], monkeypatch,
                                      outage_s=30, steps=6, shutdown_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchError) as ended:
        try:
            launcher.run_job(tmp_path / "env.yaml")
        finally:
            stopped_by_ray = stop_bounded(launcher)
    assert ended.value.outcome == "succeeded", ended.value
    assert "after the line of the final step 6" in str(ended.value)
    assert len(metrics.read_text().splitlines()) == 6
    assert time.monotonic() - t0 < 6 and stopped_by_ray is False
    assert "does not answer: the job's status is unknown; riding it out for up to 30s" \
        in caplog.text


def test_a_dashboard_silent_past_its_outage_limit_ends_the_attempt_by_name(
        tmp_path: Path, silent_dashboard, monkeypatch) -> None:
    rayjob._bounded_class()
    launcher, metrics = silent_launch(tmp_path, silent_dashboard[0], monkeypatch,
                                      outage_s=1.5, steps=100, shutdown_s=0.5)
    with pytest.raises(launch.LaunchError) as ended:
        try:
            launcher.run_job(tmp_path / "env.yaml")
        finally:
            stopped_by_ray = stop_bounded(launcher)
    assert stopped_by_ray is False
    assert ended.value.outcome == "launcher_error"
    assert "unavailable for 1.5s: the dashboard at http://127.0.0.1:" in str(ended.value)
    assert "(train.ray.dashboard_outage_s)" in str(ended.value)
    assert 2 <= len(metrics.read_text().splitlines()) < 100  # it ran meanwhile
