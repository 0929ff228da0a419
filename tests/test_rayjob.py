"""hy3rl.rayjob without a Ray cluster: the per-launch token and a submission that failed.
(The job's end from Ray's status, the re-attached stream and the refusal of a request
without the token run on a real Ray cluster: tests/test_train_ray.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

from hy3rl import rayjob


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
