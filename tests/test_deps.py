"""Stage `deps` on real git repositories made in the test (tests/fixtures/deps.py):
clone at pins, verify, refuse bad pins and dirty clones, stay offline when nothing changed,
serialise concurrent runs; and the real `deps` rule through Snakemake."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures.common import REPO_ROOT, git, run_snakemake
from fixtures.deps import Upstreams
from hy3rl import deps

NAMES = ("verl", "megatron_bridge", "transfer_queue")


def run_cli(section: dict, out: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the CLI in a subprocess (its own environment, like the rule does)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hy3rl.deps", "--config-json", json.dumps({"deps": section}),
         "--lock", str(out / "lock.json"), "--runtime-env", str(out / "runtime_env.yaml")],
        capture_output=True, text=True, timeout=120, cwd=out.parent,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "scripts"), **(env or {})},
    )
    return proc.returncode, proc.stdout + proc.stderr


def run_main(section: dict, out: Path) -> int:
    return deps.main(["--config-json", json.dumps({"deps": section}),
                      "--lock", str(out / "lock.json"),
                      "--runtime-env", str(out / "runtime_env.yaml")])


def head(path: Path) -> str:
    return git("rev-parse", "HEAD", cwd=path)


def load_lock(out: Path) -> dict:
    return json.loads((out / "lock.json").read_text())


def test_clones_verifies_and_writes_lock_and_runtime_env(deps_upstreams: Upstreams,
                                                         tmp_path: Path):
    up = deps_upstreams
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    pins = dict(up.first)  # an older commit, not the branch tip
    assert run_main(up.section(deps_dir, pins), out) == 0

    lock = load_lock(out)
    assert lock["schema_version"] == 1
    assert lock["git_version"].startswith("git version ")
    assert lock["deps_dir"] == str(deps_dir)
    assert set(lock["repos"]) == set(NAMES)
    for name in NAMES:
        entry = lock["repos"][name]
        clone = deps_dir / name
        assert head(clone) == pins[name] == entry["commit"] == entry["head"]
        assert entry["url"] == str(up.paths[name])
        assert entry["path"] == str(clone)
        assert entry["action"] == "cloned" and entry["fetched"] is True
        assert entry["fetch_mode"] == "shallow-sha" and entry["shallow"] is True
        assert entry["verified_at"].endswith("Z")
        assert all(c["present"] for c in entry["checks"]), entry["checks"]
        # detached HEAD, clean tree, and only the pinned commit fetched
        assert subprocess.run(["git", "symbolic-ref", "-q", "HEAD"], cwd=clone).returncode == 1
        assert git("status", "--porcelain", cwd=clone) == ""
        assert git("rev-list", "--all", "--count", cwd=clone) == "1"
    checks = {c["name"]: c for c in lock["repos"]["verl"]["checks"]}
    assert checks["hy3_script"]["path"] == "examples/grpo_trainer/run_hy_v3_megatron.sh"
    assert lock["warnings"] == []
    assert lock["runtime_env"]["base"] == str(deps_dir / "verl/verl/trainer/runtime_env.yaml")

    env = yaml.safe_load((out / "runtime_env.yaml").read_text())
    assert env["working_dir"] == str(deps_dir / "verl")
    assert {".git", "__pycache__"} <= set(env["excludes"])
    assert "/.git/" in env["excludes"]  # kept from verl's own runtime_env.yaml
    pythonpath = env["env_vars"]["PYTHONPATH"].split(os.pathsep)
    assert pythonpath == [str(deps_dir / "megatron_bridge/src"), str(deps_dir / "transfer_queue")]
    assert all(Path(p).is_absolute() and Path(p).is_dir() for p in pythonpath)
    assert env["env_vars"]["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"  # from verl's file
    assert env["env_vars"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert all(isinstance(v, str) for v in env["env_vars"].values())
    from ray.runtime_env import RuntimeEnv

    RuntimeEnv(**env)  # Ray's own validation of the fields (working_dir, excludes, env_vars)
    # no temporary files left behind
    assert sorted(p.name for p in out.iterdir()) == ["lock.json", "runtime_env.yaml"]
    assert sorted(p.name for p in deps_dir.iterdir()) == [".hy3rl-deps.lock", *sorted(NAMES)]


def test_second_run_needs_no_network(deps_upstreams: Upstreams, tmp_path: Path):
    up = deps_upstreams
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    section = up.section(deps_dir)
    assert run_main(section, out) == 0
    for name, path in up.paths.items():  # every remote gone: any fetch would fail
        path.rename(path.with_name(name + ".gone"))
    rc, text = run_cli(section, out)
    assert rc == 0, text
    lock = load_lock(out)
    for name in NAMES:
        entry = lock["repos"][name]
        assert entry["action"] == "unchanged" and entry["fetched"] is False, entry
        assert entry["fetch_mode"] is None and entry["head"] == up.head[name]


@pytest.mark.parametrize(
    "commit, expected",
    [
        ("220e903", "short SHA (7 characters)"),
        ("220e9039902c6db56860e2afd659803dc34ec00", "short SHA (39 characters)"),
        ("main", "branch names and tags are refused"),
        ("v0.1.8", "branch names and tags are refused"),
        ("220E9039902C6DB56860E2AFD659803DC34EC005", "must be lowercase hex"),
    ],
)
def test_bad_pins_refused_naming_the_key(deps_upstreams: Upstreams, tmp_path: Path,
                                         commit: str, expected: str, capsys):
    section = deps_upstreams.section(tmp_path / "deps")
    section["repos"]["transfer_queue"]["commit"] = commit
    assert run_main(section, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert f"deps.repos.transfer_queue.commit: {commit!r}" in err and expected in err, err
    assert not (tmp_path / "deps").exists() and not (tmp_path / "out").exists()


def test_missing_and_unknown_keys_named(tmp_path: Path):
    with pytest.raises(deps.DepsError, match=r"deps.repos.verl.commit: missing"):
        deps.run({"dir": "d", "repos": {"verl": {"url": "x", "commit": ""}}},
                 tmp_path / "l.json", tmp_path / "r.yaml")
    with pytest.raises(deps.DepsError, match=r"deps.repos.vrel"):
        deps.run({"dir": "d", "repos": {"vrel": {"url": "x", "commit": "a" * 40}}},
                 tmp_path / "l.json", tmp_path / "r.yaml")


def test_missing_commit_names_repo_url_and_sha(deps_upstreams: Upstreams, tmp_path: Path,
                                               capsys):
    up = deps_upstreams
    ghost = "0123456789abcdef0123456789abcdef01234567"
    section = up.section(tmp_path / "deps", {"megatron_bridge": ghost})
    assert run_main(section, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert "deps.repos.megatron_bridge.commit" in err
    assert f"commit {ghost}" in err and repr(str(up.paths["megatron_bridge"])) in err
    assert "repo megatron_bridge" in err and "force-pushed" in err
    # verl was cloned before the failure; megatron_bridge left nothing behind; no outputs
    assert sorted(p.name for p in (tmp_path / "deps").iterdir()) == [".hy3rl-deps.lock", "verl"]
    assert not (tmp_path / "out" / "lock.json").exists()


def test_full_fetch_fallback_when_server_refuses_sha_requests(deps_upstreams: Upstreams,
                                                              tmp_path: Path):
    up = deps_upstreams
    # Protocol v0 servers refuse `want <sha>` for a commit that is not a ref tip.
    v0 = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "protocol.version",
          "GIT_CONFIG_VALUE_0": "0"}
    untagged = {n: up.first[n] for n in NAMES}
    for name in NAMES:  # make the old commits reachable from no tag, only from history
        git("tag", "-d", "v0.1.8", cwd=up.paths[name])
    out = tmp_path / "out"
    rc, text = run_cli(up.section(tmp_path / "deps", untagged), out, env=v0)
    assert rc == 0, text
    for name in NAMES:
        entry = load_lock(out)["repos"][name]
        assert entry["fetch_mode"] == "full" and entry["head"] == untagged[name]
    ghost = "f" * 40
    rc, text = run_cli(up.section(tmp_path / "deps2", {"verl": ghost}), out, env=v0)
    assert rc == 1 and f"commit {ghost} is not in any branch or tag" in text, text


def test_unreachable_url(deps_upstreams: Upstreams, tmp_path: Path, capsys):
    section = deps_upstreams.section(tmp_path / "deps",
                                     urls={"verl": str(tmp_path / "no-such-repo")})
    assert run_main(section, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert "deps.repos.verl: cannot fetch from" in err and "no-such-repo" in err
    assert not (tmp_path / "deps" / "verl").exists()


def test_moving_the_pin_updates_the_clone(deps_upstreams: Upstreams, tmp_path: Path):
    up = deps_upstreams
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    assert run_main(up.section(deps_dir, up.first), out) == 0
    new = up.add_commit("verl", {"verl/new.py": "x = 1\n"})
    assert run_main(up.section(deps_dir, {**up.first, "verl": new}), out) == 0
    entry = load_lock(out)["repos"]["verl"]
    assert entry["action"] == "checked_out" and entry["fetched"] is True
    assert head(deps_dir / "verl") == new and (deps_dir / "verl/verl/new.py").exists()
    assert load_lock(out)["repos"]["megatron_bridge"]["action"] == "unchanged"
    # Back to the old pin: already in the clone, so no fetch (the remote may be gone).
    up.paths["verl"].rename(tmp_path / "verl.gone")
    assert run_main(up.section(deps_dir, up.first), out) == 0
    entry = load_lock(out)["repos"]["verl"]
    assert entry["action"] == "checked_out" and entry["fetched"] is False
    assert head(deps_dir / "verl") == up.first["verl"]
    assert not (deps_dir / "verl/verl/new.py").exists()


@pytest.mark.parametrize("change", ["modified", "untracked"])
def test_dirty_clone_is_refused_and_kept(deps_upstreams: Upstreams, tmp_path: Path,
                                         change: str, capsys):
    up = deps_upstreams
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    assert run_main(up.section(deps_dir, up.first), out) == 0
    clone = deps_dir / "transfer_queue"
    target = clone / ("transfer_queue/__init__.py" if change == "modified" else "notes.txt")
    target.write_text("my work\n")
    for pins in (up.first, up.head):  # same pin and a moved pin: both refused
        assert run_main(up.section(deps_dir, pins), out) == 1
        err = capsys.readouterr().err
        assert "deps.repos.transfer_queue" in err and "local changes" in err, err
        assert target.name in err
        assert target.read_text() == "my work\n"
        assert head(clone) == up.first["transfer_queue"]


def test_non_git_directory_refused(deps_upstreams: Upstreams, tmp_path: Path, capsys):
    deps_dir = tmp_path / "deps"
    (deps_dir / "verl").mkdir(parents=True)
    (deps_dir / "verl" / "keep.txt").write_text("x")
    assert run_main(deps_upstreams.section(deps_dir), tmp_path / "out") == 1
    assert "is not a git clone" in capsys.readouterr().err
    assert (deps_dir / "verl" / "keep.txt").read_text() == "x"


def test_missing_expected_paths_are_warnings(deps_upstreams: Upstreams, tmp_path: Path):
    up = deps_upstreams
    git("rm", "-q", "examples/grpo_trainer/run_hy_v3_megatron.sh",
        "verl/trainer/runtime_env.yaml", cwd=up.paths["verl"])
    git("-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "rm", cwd=up.paths["verl"])
    sha = head(up.paths["verl"])
    out = tmp_path / "out"
    assert run_main(up.section(tmp_path / "deps", {"verl": sha}), out) == 0
    lock = load_lock(out)
    assert any("run_hy_v3_megatron.sh is missing" in w for w in lock["warnings"])
    assert any("runtime_env.yaml is missing" in w for w in lock["warnings"])
    checks = {c["name"]: c["present"] for c in lock["repos"]["verl"]["checks"]}
    assert checks["hy3_script"] is False and checks["trainer_config"] is True
    env = yaml.safe_load((out / "runtime_env.yaml").read_text())
    assert lock["runtime_env"]["base"] is None
    assert env["working_dir"] == str(tmp_path / "deps" / "verl")
    assert env["excludes"] == deps.RUNTIME_ENV_EXCLUDES


def test_concurrent_run_waits_for_the_lock(deps_upstreams: Upstreams, tmp_path: Path):
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    deps_dir.mkdir()
    errlog = tmp_path / "second.err"
    with open(deps_dir / deps.LOCK_FILE, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 1 (the test)\n")
        held.flush()
        with open(errlog, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hy3rl.deps", "--config-json",
                 json.dumps({"deps": deps_upstreams.section(deps_dir)}),
                 "--lock", str(out / "lock.json"), "--runtime-env", str(out / "rt.yaml")],
                stderr=err, stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "scripts")},
            )
        try:
            deadline = time.monotonic() + 60
            while "waiting for the lock" not in errlog.read_text():
                assert proc.poll() is None, errlog.read_text()
                assert time.monotonic() < deadline, "second run never reported the lock"
                time.sleep(0.05)
            assert "pid 1 (the test)" in errlog.read_text()
            assert not (deps_dir / "verl").exists()  # nothing done while the lock is held
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    assert proc.wait(timeout=120) == 0, errlog.read_text()
    assert load_lock(out)["repos"]["verl"]["action"] == "cloned"


def test_interrupted_clone_leftovers_are_removed(deps_upstreams: Upstreams, tmp_path: Path):
    deps_dir = tmp_path / "deps"
    leftover = deps_dir / ".verl.tmp-abc123"
    (leftover / ".git").mkdir(parents=True)
    assert run_main(deps_upstreams.section(deps_dir), tmp_path / "out") == 0
    assert not leftover.exists()


def test_deps_rule_through_snakemake(deps_upstreams: Upstreams, tmp_path: Path):
    """The real `deps` rule on the embedded default config, with the URLs pointed at local
    repositories (what a user behind a firewall does with mirrors)."""
    up = deps_upstreams
    work = tmp_path / "work"
    work.mkdir()
    override = {"run": {"name": "t"},
                "deps": {"dir": "deps", "repos": up.section(work / "deps")["repos"]}}
    cfg = tmp_path / "local-mirrors.yaml"
    cfg.write_text(yaml.safe_dump(override))
    target = "results/t/deps/lock.json"
    run_snakemake(["--configfile", str(REPO_ROOT / "config/config.yaml"), str(cfg),
                   "--cores", "1", target], work)
    lock = json.loads((work / target).read_text())
    assert {n: e["head"] for n, e in lock["repos"].items()} == up.head
    assert lock["deps_dir"] == str(work / "deps")
    env = yaml.safe_load((work / "results/t/deps/runtime_env.yaml").read_text())
    assert env["working_dir"] == str(work / "deps/verl")
    assert "verl: " in (work / "results/t/logs/deps.log").read_text()
    # Forced rerun with every remote gone: the rule succeeds offline, nothing fetched.
    for name, path in up.paths.items():
        path.rename(path.with_name(name + ".gone"))
    run_snakemake(["--configfile", str(REPO_ROOT / "config/config.yaml"), str(cfg),
                   "--cores", "1", "-f", target], work)
    lock = json.loads((work / target).read_text())
    assert not any(e["fetched"] for e in lock["repos"].values()), lock
    # A bad pin stops Snakemake before any job, naming the key.
    override["deps"]["repos"]["verl"]["commit"] = "main"
    cfg.write_text(yaml.safe_dump(override))
    proc = run_snakemake(["--configfile", str(REPO_ROOT / "config/config.yaml"), str(cfg),
                          "--cores", "1", "-n", target], work, check=False)
    assert proc.returncode != 0
    assert "deps.repos.verl.commit" in proc.stdout + proc.stderr
