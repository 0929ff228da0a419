"""The SLURM profile proven on a real SLURM cluster (tests/slurm_cluster.py): Snakemake ->
snakemake-executor-plugin-slurm -> sbatch -> jobs on two logical nodes with fake GPUs.
What SLURM received is read back with `scontrol show job` (MinJobAge keeps finished jobs).
The paper dry run, the profile install and the probe's own logic need no cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import slurm_cluster as cluster_mod
import yaml
from fixtures.common import REPO_ROOT, SNAKEMAKE, make_config, run_snakemake
from fixtures.deps import make_upstreams
from hy3rl import cluster as probe_mod
from hy3rl.errors import StageError

TEST_SNAKEFILE = REPO_ROOT / "tests" / "slurm" / "Snakefile"
PROFILE = REPO_ROOT / "profiles" / "slurm"
# A site's override of the profile's CHANGE_ME_ values (the Snakefile refuses those by key):
# the test cluster's (partition hy3rl, account hy3rl-test).
SITE_PROFILE = REPO_ROOT / "tests" / "slurm" / "profile"


# ---------------------------------------------------------------------------- helpers


def show_job(job_id: str) -> dict[str, str]:
    """`scontrol show job -o <id>` as a dict (values without spaces)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], check=True,
                         capture_output=True, text=True).stdout
    return dict(re.findall(r"(\S+?)=(\S*)", out))


def run_id(output: str) -> str:
    m = re.search(r"SLURM run ID: (\S+)", output)
    assert m, f"no SLURM run ID in Snakemake output:\n{output[-3000:]}"
    return m.group(1)


def submitted(output: str) -> dict[str, tuple[str, Path]]:
    """rule -> (SLURM job id, SLURM log path) from Snakemake's submission lines."""
    jobs = {}
    for jid, log in re.findall(r"submitted with SLURM jobid (\d+) \(log: (\S+)\)\.", output):
        rule = Path(log).parent.name.removeprefix("rule_")
        jobs[rule] = (jid, Path(log))
    return jobs


def jobs_of_run(name: str) -> dict[str, tuple[str, str]]:
    """comment (rule_<name>) -> (job id, state) of the jobs of one Snakemake run."""
    out = subprocess.run(["squeue", "-h", "--states=all", "--name", name, "-o", "%i|%k|%T"],
                         check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        jid, comment, state = line.strip().split("|")
        res[comment.strip()] = (jid, state)
    return res


def snakemake_popen(args: list[str], workdir: Path) -> subprocess.Popen:
    cmd = [*SNAKEMAKE, "--snakefile", str(TEST_SNAKEFILE), "--directory", str(workdir), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def resources_line(output: str, rule: str) -> dict[str, str]:
    """The `resources:` line Snakemake prints under `rule <rule>:` (dry run or real)."""
    m = re.search(rf"rule {rule}:\n(?:    .*\n)*?    resources: (.*)\n", output)
    assert m, f"no resources for rule {rule} in:\n{output[-4000:]}"
    return dict(kv.split("=", 1) for kv in re.split(r", (?=\w+=)", m.group(1)))


# ---------------------------------------------------------------------------- real SLURM


@pytest.mark.slurm
def test_cpu_rule_and_two_node_gpu_probe_run_as_sbatch_jobs(slurm_cluster, slurm_profile_args,
                                                            tmp_path):
    up = make_upstreams(tmp_path / "upstream")
    cfg = tmp_path / "deps.yaml"
    cfg.write_text(yaml.safe_dump({"deps": up.section(tmp_path / "deps")}))
    work = tmp_path / "work"
    res = work / "results" / "tiny-default"
    proc = run_snakemake([*slurm_profile_args, str(cfg), "--",
                          "results/tiny-default/deps/lock.json", "resources/tiny-hy3",
                          "results/tiny-default/cluster/probe.json"], work)
    out = proc.stdout + proc.stderr
    rid = run_id(out)
    jobs = submitted(out)
    assert set(jobs) == {"tiny_model", "cluster_probe"}, out[-3000:]
    by_comment = jobs_of_run(rid)

    # (a) a light rule (localrules: deps) ran on the submit host, no SLURM job
    assert re.search(r"localrule deps:", out), out[-3000:]
    assert "rule_deps" not in by_comment
    lock = json.loads((res / "deps" / "lock.json").read_text())
    assert set(lock["repos"]) == {"verl", "megatron_bridge", "transfer_queue"}
    # ... and a CPU rule ran as a real sbatch job, with the resources the rule asked for
    assert (work / "resources" / "tiny-hy3" / "config.json").is_file()
    jid, log = jobs["tiny_model"]
    assert by_comment["rule_tiny_model"] == (jid, "COMPLETED")
    job = show_job(jid)
    assert job["JobName"] == rid and job["Comment"] == "rule_tiny_model"
    assert job["Partition"] == slurm_cluster.partition
    assert job["Account"] == slurm_cluster.account
    assert job["NumNodes"] == "1" and job["NumTasks"] == "1" and job["CPUs/Task"] == "1"
    assert job["TimeLimit"] == "00:10:00"  # rules/model.smk runtime=10
    assert job["MinMemoryNode"] == "2000M"  # rules/model.smk mem_mb=2000
    assert job["OverSubscribe"] == "OK"  # not exclusive
    assert "TresPerNode" not in job
    assert job["StdOut"] == str(log) and log.is_file()  # kept: slurm-keep-successful-logs
    assert log.parent == work / ".snakemake" / "slurm_logs" / "rule_tiny_model"

    # (b) the 2-node GPU job: the training shape, and what its nodes saw
    jid, log = jobs["cluster_probe"]
    assert by_comment["rule_cluster_probe"] == (jid, "COMPLETED")
    job = show_job(jid)
    assert job["JobName"] == rid and job["Comment"] == "rule_cluster_probe"
    assert job["Partition"] == slurm_cluster.partition
    assert job["NumNodes"] == "2" and job["NodeList"] == "n[1-2]"
    assert job["TresPerNode"] == f"gres:gpu:{slurm_cluster.gpu_type}:2"  # gres per node
    assert job["NumTasks"] == "2" and job["NtasksPerN:B:S:C"].startswith("1:")  # 1 per node
    assert job["OverSubscribe"] == "NO"  # --exclusive
    assert job["TimeLimit"] == "00:10:00"
    assert job["CPUs/Task"] == "2" and job["MinMemoryNode"] == "1000M"  # tests/slurm/config
    assert job["StdOut"] == str(log) and log.is_file()
    probe = json.loads((res / "cluster" / "probe.json").read_text())
    assert probe["status"] == "pass", probe
    assert probe["job_id"] == jid
    assert probe["allocation"] == ["n1", "n2"]
    assert [n["node"] for n in probe["nodes"]] == ["n1", "n2"]
    assert all(n["gpus"] == 2 and n["cuda_visible_devices"] == "0,1" for n in probe["nodes"])
    assert probe["created"].endswith("+00:00")
    rule_log = (res / "logs" / "cluster_probe.log").read_text()  # the adapter's triggers
    assert "  cluster.nodes=2" in rule_log and "  cluster.gpus_per_node=2" in rule_log


@pytest.mark.slurm
@pytest.mark.slow  # ~3 min: SLURM's 1-minute time limit plus the plugin's status polling
def test_failed_cancelled_and_timed_out_jobs_are_reported_then_rerun(slurm_cluster, tmp_path):
    """(c) exit 1, scancel, time limit: Snakemake reports each failure with the SLURM log
    kept and its path in the message; after the fix only the missing outputs are built."""
    work = tmp_path / "work"
    work.mkdir()
    prefix = f"hy3rltest{os.getpid()}"  # our jobs, even if another session shares the cluster
    args = ["--profile", str(PROFILE), "--profile", str(REPO_ROOT / "tests/slurm/profile"),
            "--keep-going", "--slurm-jobname-prefix", prefix]
    proc = snakemake_popen(args, work)
    try:
        # scancel the `cancelled` job once it runs its shell (its rule log appears)
        deadline = time.monotonic() + 300
        jid = None
        while time.monotonic() < deadline:
            if (work / "logs" / "cancelled.log").exists():
                rows = subprocess.run(["squeue", "-h", "-o", "%i|%k|%j"], capture_output=True,
                                      text=True).stdout.split()
                jid = next((i for i, k, j in (r.split("|") for r in rows)
                            if k == "rule_cancelled" and j.startswith(f"{prefix}_")), None)
                if jid:
                    break
            time.sleep(1)
        assert jid, "job of rule `cancelled` never started"
        subprocess.run(["scancel", jid], check=True)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-3000:]
    jobs = submitted(out)
    assert set(jobs) == {"ok", "fail", "cancelled", "overtime"}, out[-3000:]
    assert jobs["cancelled"][0] == jid
    for rule, state in (("fail", "FAILED"), ("cancelled", "CANCELLED"),
                        ("overtime", "TIMEOUT")):
        job_id, log = jobs[rule]
        assert show_job(job_id)["JobState"] == state
        assert f"SLURM-job '{job_id}' failed, SLURM status is: '{state}'" in out, out[-4000:]
        m = re.search(rf"Error in rule {rule}:\n(?:    .*\n)*?    log: (.*) \(check log", out)
        assert m and str(log) in m.group(1), out[-4000:]
        assert log.is_file(), f"SLURM log of {rule} not kept: {log}"
    assert "failing on purpose" in (work / "logs" / "fail.log").read_text()
    assert "DUE TO TIME LIMIT" in jobs["overtime"][1].read_text()
    assert "CANCELLED" in jobs["cancelled"][1].read_text()
    ok = work / "out" / "ok.txt"
    assert ok.read_text().startswith("ok slurm_job=" + jobs["ok"][0])
    ok_mtime = ok.stat().st_mtime_ns
    for name in ("fail", "cancelled", "overtime", "summary"):
        assert not (work / "out" / f"{name}.txt").exists()

    # fix the cause, rerun: only what is missing runs; `summary` is a localrule
    (work / "fixed").write_text("")
    proc = snakemake_popen(args, work)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert set(submitted(out)) == {"fail", "cancelled", "overtime"}, out[-3000:]
    assert re.search(r"localrule summary:", out), out[-3000:]
    assert ok.stat().st_mtime_ns == ok_mtime
    summary = (work / "out" / "summary.txt").read_text()
    assert summary.startswith("slurm_job=none\n"), summary  # ran on the submit host
    assert "fail fixed" in summary and "overtime fixed" in summary


@pytest.mark.slurm
def test_cluster_state_is_discoverable_and_joined(slurm_cluster):
    """A second user (another pytest session, the CLI) finds and joins the same cluster."""
    info = cluster_mod.status()
    assert info is not None and info.state_dir == slurm_cluster.state_dir
    conf = (Path(slurm_cluster.conf_dir) / "slurm.conf").read_text()
    assert conf.startswith(f"{cluster_mod.MARKER}{slurm_cluster.state_dir}\n")
    assert set(cluster_mod.node_states()) == {"n1", "n2", "n3", "n4", "n5"}
    # one partition per lane of SLURM tests (tests/conftest.py), the first the default
    rows = subprocess.run(["sinfo", "-h", "-N", "-o", "%P %N"], capture_output=True,
                          text=True, check=True, timeout=30).stdout.split("\n")
    lanes = sorted(tuple(r.split()) for r in rows if r.strip())
    assert lanes == [("hy3rl*", "n1"), ("hy3rl*", "n2"), ("hy3rl-b", "n3"),
                     ("hy3rl-b", "n4"), ("hy3rl-r", "n5")], lanes
    assert slurm_cluster.partitions == {"hy3rl": ["n1", "n2"], "hy3rl-b": ["n3", "n4"],
                                        "hy3rl-r": ["n5"]}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "slurm_cluster.py"),
                           "status"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pids"] == slurm_cluster.pids
    with cluster_mod.session(wait_s=30) as again:  # joining does not restart anything
        assert again.pids == slurm_cluster.pids
    assert cluster_mod.status() is not None  # still running: this session still uses it


# ---------------------------------------------------------------------------- no cluster


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_paper_dry_run_shows_the_training_shape(tmp_path):
    """(d) config/paper.yaml + profiles/slurm (+ a site's partition/account), the whole DAG:
    the training job (and the probe, same shape) is 16 nodes x 8 H20 per node, one task per
    node, exclusive; every job gets the site's partition/account."""
    site = tmp_path / "site.yaml"  # paper.yaml's site placeholders: model, checkpoints, runtime
    site.write_text(yaml.safe_dump({"model": {"revision": "a" * 40,
                                              "dir": str(tmp_path / "models")},
                                    "data": {"heldout": {"revision": "b" * 40}}, "train": {
        "checkpoint_root": str(tmp_path / "ckpt"),
        "runtime": {"prefix": "apptainer exec --nv --bind /shared docker://verl:x"}}}))
    proc = run_snakemake(["-n", "--profile", str(PROFILE), "--profile", str(SITE_PROFILE),
                          "--configfile", str(REPO_ROOT / "config/config.yaml"),
                          str(REPO_ROOT / "config/paper.yaml"), str(site)], tmp_path)
    out = proc.stdout + proc.stderr
    for rule, runtime in (("train", "4320"), ("cluster_probe", "10")):
        res = resources_line(out, rule)
        assert res["nodes"] == "16" and res["gres"] == "gpu:h20:8", (rule, res)
        assert res["slurm_extra"] == "--ntasks-per-node=1 --exclusive", (rule, res)
        assert res["cpus_per_task"] == "96" and res["mem_mb"] == "1800000", (rule, res)
        assert res["runtime"] == runtime, (rule, res)
        assert "gpu" not in res  # never the plugin's per-job GPU total
    # the rehearsal: one node of the same shape, exclusive, its own time limit
    res = resources_line(out, "rehearsal")
    # paper.yaml: rehearsal.runtime_min 180 for the stage (its two loads of 46.7 GB, its
    # three full-length steps)
    assert (res["nodes"], res["gres"], res["runtime"]) == ("1", "gpu:h20:8", "180"), res
    assert res["slurm_extra"] == "--ntasks-per-node=1 --exclusive", res
    # rehearsal.shape stage: the stage's random weights are written in a CPU job
    res = resources_line(out, "rehearsal_model")
    assert (res["runtime"], res["mem_mb"], "gres" in res) == ("120", "16000", False), res
    # a release (eval.backend vllm): the evaluation's shape (2 x 8 H20: TP16), where its
    # generates check loads it with vLLM; release.runtime_min
    res = resources_line(out, "release_model")
    assert (res["nodes"], res["gres"], res["runtime"], res["cpus_per_task"]) == (
        "2", "gpu:h20:8", "240", "96"), res
    for line in re.findall(r"    resources: (.*)", out):
        assert "slurm_partition=hy3rl" in line, line
        assert "slurm_account=hy3rl-test" in line, line


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_gpu_shape_untyped_with_constraint(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"cluster": {"gpu": True, "nodes": 4, "gpus_per_node": 8,
                                               "gpu_type": "", "constraint": "h20"},
                                   "train": {"cpu": {"enable": False}}}))
    proc = run_snakemake(["-n", "--profile", str(PROFILE), "--profile", str(SITE_PROFILE),
                          "--configfile", str(REPO_ROOT / "config/config.yaml"), str(cfg), "--",
                          "results/tiny-default/cluster/probe.json"], tmp_path)
    res = resources_line(proc.stdout + proc.stderr, "cluster_probe")
    assert res["nodes"] == "4" and res["gres"] == "gpu:8" and res["constraint"] == "h20", res


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_profile_install_makes_the_literal_command_work(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    pyenv = {**os.environ, **env}  # hy3rl is installed: no PYTHONPATH
    py = [sys.executable, "-m", "hy3rl.profile"]
    assert subprocess.run([*py, "status"], env=pyenv, capture_output=True).returncode == 1
    for _ in range(2):  # idempotent
        proc = subprocess.run([*py, "install"], env=pyenv, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    link = tmp_path / "xdg" / "snakemake" / "slurm"
    assert link.is_symlink() and link.resolve() == PROFILE.resolve()
    # the literal command, from the repository root: the installed profile is used, and
    # refused by key until the site's values replace its placeholders ...
    literal = [sys.executable, "-m", "snakemake", "--profile", "slurm", "-n",
               "--directory", str(tmp_path / "work"),
               "--configfile", str(REPO_ROOT / "config" / "config.yaml")]
    target = ["--", "results/tiny-default/deps/lock.json"]
    proc = subprocess.run([*literal, *target], cwd=REPO_ROOT, env=pyenv, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Using profile slurm" in out, out[-3000:]
    assert "profile default-resources slurm_account: 'CHANGE_ME_account'" in out, out[-3000:]
    # ... which a site profile on top of it does
    proc = subprocess.run([*literal, "--profile", str(SITE_PROFILE), *target], cwd=REPO_ROOT,
                          env=pyenv, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert resources_line(out, "deps")["slurm_account"] == "hy3rl-test"
    # never replaces something that is not its own symlink
    subprocess.run([*py, "uninstall"], env=pyenv, check=True, capture_output=True)
    link.mkdir()
    proc = subprocess.run([*py, "install"], env=pyenv, capture_output=True, text=True)
    assert proc.returncode == 1 and "not replacing" in proc.stderr


def test_profile_every_entry_commented_and_site_values_are_placeholders():
    lines = PROFILE.joinpath("config.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line or lines[i - 1].lstrip().startswith("#"), f"uncommented: {line}"
    prof = yaml.safe_load(PROFILE.joinpath("config.yaml").read_text())
    assert prof["executor"] == "slurm"
    assert prof["default-resources"]["slurm_partition"].startswith("CHANGE_ME_")
    assert prof["default-resources"]["slurm_account"].startswith("CHANGE_ME_")


def test_probe_outside_slurm_is_not_run_and_wrong_shape_fails(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out = tmp_path / "cluster" / "probe.json"
    probe_mod.run(make_config(cluster={"nodes": 2, "gpus_per_node": 8}).cluster, out=out)
    probe = json.loads(out.read_text())
    assert (probe["status"], probe["expected_nodes"], probe["expected_gpus_per_node"]) == \
        ("not run", 2, 8)
    assert probe["created"].endswith("+00:00")
    # the same through `hy3rl cluster_probe` (layout paths under the working directory)
    proc = subprocess.run([sys.executable, "-m", "hy3rl.cli", "cluster_probe", "--configfile",
                           str(REPO_ROOT / "config" / "config.yaml")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "results/tiny-default/cluster/probe.json").read_text())[
        "status"] == "not run"
    node = probe_mod.NodeReport(node="n1", hostname="h", cuda_visible_devices="0,1", gpus=2,
                                job_gpus="0,1")
    result = probe_mod.evaluate(probe_mod.ProbeResult(
        status="", reason="", job_id="1", expected_nodes=2, expected_gpus_per_node=8,
        allocation=["n1"], nodes=[node]))
    assert result.status == "fail"
    assert any("expected 2" in p for p in result.problems)
    assert any("2 GPUs visible" in p and "expected 8" in p for p in result.problems)
    assert issubclass(probe_mod.ProbeFailed, StageError)
    # run(): the failed probe is written (and printed), then the stage error
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setattr(probe_mod, "probe", lambda job_id, nodes, gpus: result)
    with pytest.raises(probe_mod.ProbeFailed, match="cluster probe FAILED: allocation has 1"):
        probe_mod.run(make_config(cluster={"nodes": 2, "gpus_per_node": 8}).cluster, out=out)
    assert json.loads(out.read_text())["status"] == "fail"


def test_conf_backup_and_restore(tmp_path, monkeypatch):
    """/etc/slurm files are backed up before the test cluster writes its own and put back
    (or removed, when there was none) at stop; done here on a stand-in config dir."""
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "slurm.conf").write_text("ClusterName=site\n")
    (conf / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
    monkeypatch.setattr(cluster_mod, "CONF_DIR", conf)
    state = tmp_path / "state"
    state.mkdir()
    info = cluster_mod.ClusterInfo(state_dir=str(state), conf_dir=str(conf), hostname="h")
    cluster_mod._backup_conf(info)
    assert sorted(info.backed_up) == ["cgroup.conf", "slurm.conf"]
    (conf / "slurm.conf").write_text(f"{cluster_mod.MARKER}{state}\nours\n")
    (conf / "gres.conf").write_text("ours\n")
    (conf / "cgroup.conf").unlink()
    cluster_mod._restore_conf(info)
    assert (conf / "slurm.conf").read_text() == "ClusterName=site\n"
    assert (conf / "cgroup.conf").read_text() == "CgroupPlugin=autodetect\n"
    assert not (conf / "gres.conf").exists()


@pytest.mark.slurm
def test_a_cluster_that_cannot_start_is_retried_once_then_fails_with_its_log_tail(
        tmp_path, monkeypatch, request):
    """A test cluster whose slurmctld dies at once (a stand-in on PATH, as a port already
    bound would make it): the start is tried once more in a fresh state directory, then
    fails with each attempt's daemon log tail; the configuration directory is restored."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    ctld = fake_bin / "slurmctld"
    ctld.write_text("#!/bin/sh\necho 'slurmctld: fatal: Unable to bind listen port 1 (test)'\n"
                    "exit 1\n")
    ctld.chmod(0o755)
    conf = tmp_path / "etc-slurm"
    # munged (user munge) must reach its state dir: not under pytest's 0700 tmp_path
    states = Path(tempfile.mkdtemp(prefix="hy3rl-test-starts-"))
    states.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(states, ignore_errors=True))
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HY3RL_SLURM_TMP", str(states))
    monkeypatch.setattr(cluster_mod, "CONF_DIR", conf)
    with pytest.raises(cluster_mod.ClusterError) as err:
        cluster_mod._start_fresh(persistent=False)
    msg = str(err.value)
    assert msg.startswith(f"{cluster_mod.START_ATTEMPTS} starts failed"), msg
    assert cluster_mod.START_ATTEMPTS == 2
    assert msg.count("slurmctld: fatal: Unable to bind listen port 1 (test)") == 2, msg
    assert msg.count("daemons died: slurmctld") == 2, msg
    tried = sorted(states.iterdir())  # one fresh state directory per start, kept for its logs
    assert len(tried) == 2 and all(str(d) in msg for d in tried), msg
    assert not (conf / "slurm.conf").exists() and not (conf / "gres.conf").exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_a_transformers_release_asks_no_more_than_the_node(tmp_path):
    """Issue 42: on the SLURM test cluster (nodes of 2 CPUs) a whole run trained, then both
    release jobs were refused by sbatch: the release asked release.threads (4) CPUs and
    16 GB whatever the nodes held. It now asks at most the node cluster.* describes."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"cluster": {"gpu": True, "cpus_per_node": 2,
                                               "mem_mb_per_node": 4000},
                                   "train": {"cpu": {"enable": False}}}))
    proc = run_snakemake(["-n", "--profile", str(PROFILE), "--profile", str(SITE_PROFILE),
                          "--configfile", str(REPO_ROOT / "config/config.yaml"), str(cfg)],
                         tmp_path)
    out = proc.stdout + proc.stderr
    res = resources_line(out, "release_model")
    assert res["mem_mb"] == "4000", res  # (its threads, min(release.threads, the node's
    # CPUs), reach sbatch as --cpus-per-task; a dry run does not print them)
