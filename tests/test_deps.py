"""Stage `deps` on real git repositories made in the test (tests/fixtures/deps.py):
clone at pins, verify, refuse bad pins and dirty clones, stay offline when nothing changed,
serialise concurrent runs; `hy3rl deps` by hand; and the real `deps` rule through Snakemake."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures.common import REPO_ROOT, git, make_config, run_snakemake
from fixtures.deps import Upstreams
from hy3rl import deps, timefmt
from hy3rl.config import ConfigError
from hy3rl.layout import Layout
from hy3rl.settings import Config, Repo

NAMES = ("verl", "megatron_bridge", "transfer_queue")
# `hy3rl deps` run from a work directory writes the run's layout there.
CLI_LAYOUT = Layout("results", "t")


def run_deps(section: dict, out: Path) -> deps.Lock:
    """The stage in-process: the typed `deps` section, explicit output paths."""
    return deps.run(make_config(deps=section).deps, lock=out / "lock.json",
                    runtime_env=out / "runtime_env.yaml")


def deps_error(section: dict, out: Path) -> str:
    """The message of the DepsError the stage stops with."""
    with pytest.raises(deps.DepsError) as info:
        run_deps(section, out)
    return str(info.value)


def cli(section: dict, work: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`hy3rl deps --configfile <work>/config.yaml` from ``work``, started (not waited for)."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": CLI_LAYOUT.run}, "deps": section}))
    return subprocess.Popen(
        [sys.executable, "-m", "hy3rl.cli", "deps", "--configfile", str(cfg)], cwd=work,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )


def run_cli(section: dict, work: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `hy3rl deps` in a subprocess (its own environment, like the rule's job)."""
    proc = cli(section, work, env)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def cli_out(work: Path) -> Path:
    """The directory of lock.json and runtime_env.yaml that `hy3rl deps` writes in ``work``."""
    return (work / CLI_LAYOUT.deps_lock).parent


def head(path: Path) -> str:
    return git("rev-parse", "HEAD", cwd=path)


def load_lock(out: Path) -> dict:
    return json.loads((out / "lock.json").read_text())


def test_clones_verifies_and_writes_lock_and_runtime_env(deps_upstreams: Upstreams,
                                                         tmp_path: Path):
    up = deps_upstreams
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    pins = dict(up.first)  # an older commit, not the branch tip
    run_deps(up.section(deps_dir, pins), out)

    lock = load_lock(out)
    assert lock["schema_version"] == 1
    assert lock["created"].endswith("+00:00") and timefmt.parse(lock["created"])
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
        assert entry["verified_at"].endswith("+00:00")  # timefmt.utc_now()
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
    run_deps(section, out)
    for name, path in up.paths.items():  # every remote gone: any fetch would fail
        path.rename(path.with_name(name + ".gone"))
    work = tmp_path / "work"
    rc, text = run_cli(section, work)
    assert rc == 0, text
    lock = load_lock(cli_out(work))
    for name in NAMES:
        entry = lock["repos"][name]
        assert entry["action"] == "unchanged" and entry["fetched"] is False, entry
        assert entry["fetch_mode"] is None and entry["head"] == up.head[name]


BAD_PINS = [
    ("220e903", "short SHA (7 characters)"),
    ("220e9039902c6db56860e2afd659803dc34ec00", "short SHA (39 characters)"),
    ("main", "branch names and tags are refused"),
    ("v0.1.8", "branch names and tags are refused"),
    ("220E9039902C6DB56860E2AFD659803DC34EC005", "must be lowercase hex"),
    ("", "missing; pin a full 40-hex commit SHA"),
]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("commit, expected", BAD_PINS)
def test_bad_pins_refused_naming_the_key(deps_upstreams: Upstreams, tmp_path: Path,
                                         commit: str, expected: str):
    section = deps_upstreams.section(tmp_path / "deps")
    section["repos"]["transfer_queue"]["commit"] = commit
    # The schema refuses it first (the Snakefile and `hy3rl` validate the config) ...
    with pytest.raises(ConfigError, match=r"deps\.repos\.transfer_queue\.commit: "):
        make_config(deps=section)
    # ... and run() re-checks a section built by hand before git sees the value, saying why.
    typed = make_config(deps=deps_upstreams.section(tmp_path / "deps")).deps
    bad = dataclasses.replace(typed, repos=dataclasses.replace(
        typed.repos, transfer_queue=Repo(str(deps_upstreams.paths["transfer_queue"]), commit)))
    with pytest.raises(deps.DepsError) as info:
        deps.run(bad, lock=tmp_path / "out/lock.json", runtime_env=tmp_path / "out/rt.yaml")
    err = str(info.value)
    key = "deps.repos.transfer_queue.commit: " + (repr(commit) if commit else "missing")
    assert key in err and expected in err, err
    assert not (tmp_path / "deps").exists() and not (tmp_path / "out").exists()


def test_missing_and_unknown_keys_named():
    with pytest.raises(ConfigError, match=r"deps.repos.verl: 'commit' is a required property"):
        Config.from_dict({"deps": {"dir": "d", "repos": {"verl": {"url": "x"}}}})
    with pytest.raises(ConfigError, match=r"unknown key deps.repos.vrel"):
        Config.from_dict({"deps": {"dir": "d",
                                   "repos": {"vrel": {"url": "x", "commit": "a" * 40}}}})


def test_hy3rl_deps_refuses_a_bad_pin_by_key(deps_upstreams: Upstreams, tmp_path: Path):
    """`hy3rl deps` by hand: a bad pin is a one-line error naming the key, no traceback,
    nothing cloned or written."""
    section = deps_upstreams.section(tmp_path / "deps", {"verl": "main"})
    work = tmp_path / "work"
    rc, text = run_cli(section, work)
    assert rc != 0 and "deps.repos.verl.commit" in text and "Traceback" not in text, text
    assert not (tmp_path / "deps").exists() and not (work / "results").exists()


def test_missing_commit_names_repo_url_and_sha(deps_upstreams: Upstreams, tmp_path: Path):
    up = deps_upstreams
    ghost = "0123456789abcdef0123456789abcdef01234567"
    section = up.section(tmp_path / "deps", {"megatron_bridge": ghost})
    err = deps_error(section, tmp_path / "out")
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
    work = tmp_path / "work"
    rc, text = run_cli(up.section(tmp_path / "deps", untagged), work, env=v0)
    assert rc == 0, text
    for name in NAMES:
        entry = load_lock(cli_out(work))["repos"][name]
        assert entry["fetch_mode"] == "full" and entry["head"] == untagged[name]
    ghost = "f" * 40
    rc, text = run_cli(up.section(tmp_path / "deps2", {"verl": ghost}), work, env=v0)
    assert rc == 1 and f"commit {ghost} is not in any branch or tag" in text, text
    assert "Traceback" not in text, text


def test_unreachable_url(deps_upstreams: Upstreams, tmp_path: Path):
    section = deps_upstreams.section(tmp_path / "deps",
                                     urls={"verl": str(tmp_path / "no-such-repo")})
    err = deps_error(section, tmp_path / "out")
    assert "deps.repos.verl: cannot fetch from" in err and "no-such-repo" in err
    assert not (tmp_path / "deps" / "verl").exists()


def test_moving_the_pin_updates_the_clone(deps_upstreams: Upstreams, tmp_path: Path):
    up = deps_upstreams
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    run_deps(up.section(deps_dir, up.first), out)
    new = up.add_commit("verl", {"verl/new.py": "x = 1\n"})
    run_deps(up.section(deps_dir, {**up.first, "verl": new}), out)
    entry = load_lock(out)["repos"]["verl"]
    assert entry["action"] == "checked_out" and entry["fetched"] is True
    assert head(deps_dir / "verl") == new and (deps_dir / "verl/verl/new.py").exists()
    assert load_lock(out)["repos"]["megatron_bridge"]["action"] == "unchanged"
    # Back to the old pin: already in the clone, so no fetch (the remote may be gone).
    up.paths["verl"].rename(tmp_path / "verl.gone")
    run_deps(up.section(deps_dir, up.first), out)
    entry = load_lock(out)["repos"]["verl"]
    assert entry["action"] == "checked_out" and entry["fetched"] is False
    assert head(deps_dir / "verl") == up.first["verl"]
    assert not (deps_dir / "verl/verl/new.py").exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("change", ["modified", "untracked"])
def test_dirty_clone_is_refused_and_kept(deps_upstreams: Upstreams, tmp_path: Path,
                                         change: str):
    up = deps_upstreams
    deps_dir, out = tmp_path / "deps", tmp_path / "out"
    run_deps(up.section(deps_dir, up.first), out)
    clone = deps_dir / "transfer_queue"
    target = clone / ("transfer_queue/__init__.py" if change == "modified" else "notes.txt")
    target.write_text("my work\n")
    for pins in (up.first, up.head):  # same pin and a moved pin: both refused
        err = deps_error(up.section(deps_dir, pins), out)
        assert "deps.repos.transfer_queue" in err and "local changes" in err, err
        assert target.name in err
        assert target.read_text() == "my work\n"
        assert head(clone) == up.first["transfer_queue"]


def test_non_git_directory_refused(deps_upstreams: Upstreams, tmp_path: Path):
    deps_dir = tmp_path / "deps"
    (deps_dir / "verl").mkdir(parents=True)
    (deps_dir / "verl" / "keep.txt").write_text("x")
    assert "is not a git clone" in deps_error(deps_upstreams.section(deps_dir), tmp_path / "out")
    assert (deps_dir / "verl" / "keep.txt").read_text() == "x"


def test_missing_expected_paths_are_warnings(deps_upstreams: Upstreams, tmp_path: Path):
    up = deps_upstreams
    git("rm", "-q", "examples/grpo_trainer/run_hy_v3_megatron.sh",
        "verl/trainer/runtime_env.yaml", cwd=up.paths["verl"])
    git("-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "rm", cwd=up.paths["verl"])
    sha = head(up.paths["verl"])
    out = tmp_path / "out"
    run_deps(up.section(tmp_path / "deps", {"verl": sha}), out)
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
    deps_dir, work = tmp_path / "deps", tmp_path / "work"
    deps_dir.mkdir()
    with open(deps_dir / deps.LOCK_FILE, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 1 (the test)\n")
        held.flush()
        proc = cli(deps_upstreams.section(deps_dir), work)
        seen = ""
        try:
            deadline = time.monotonic() + 60
            while "waiting for the lock" not in seen:
                assert proc.poll() is None, seen + proc.stdout.read()
                assert time.monotonic() < deadline, "second run never reported the lock"
                seen += proc.stdout.readline()
            assert "pid 1 (the test)" in seen
            assert not (deps_dir / "verl").exists()  # nothing done while the lock is held
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, seen + rest
    assert load_lock(cli_out(work))["repos"]["verl"]["action"] == "cloned"


def test_interrupted_clone_leftovers_are_removed(deps_upstreams: Upstreams, tmp_path: Path):
    deps_dir = tmp_path / "deps"
    leftover = deps_dir / ".verl.tmp-abc123"
    (leftover / ".git").mkdir(parents=True)
    run_deps(deps_upstreams.section(deps_dir), tmp_path / "out")
    assert not leftover.exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
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
