"""Stage `model` core (hy3rl.hub) against a local test double of the hub
(tests/fixtures/hub.py) serving the tiny Hy3: a pinned download whose manifest carries the
hub's hashes, resumption after a dropped connection and after a killed run, verification,
refusals (branch revision, too little disk, offline) and HF_TOKEN kept out of every output."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import string
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
from fixtures.hub import REPO_ID, FakeHub, git_blob_id
from hy3rl import hub, timefmt

SHARD = "model-00002-of-00003.safetensors"
CUT = 100_000  # bytes of SHARD sent before the connection drops / the client is killed


def fetch(fake: FakeHub, tmp_path: Path, **kw) -> hub.Manifest:
    """hub.run in-process into tmp_path/model, manifest at tmp_path/out/manifest.json."""
    kw.setdefault("threads", 2)
    return hub.run(REPO_ID, fake.commit, tmp_path / "model",
                   manifest=tmp_path / "out" / "manifest.json", progress=False, **kw)


def resolve_gets(fake: FakeHub) -> list:
    return [r for r in fake.requests if r.method == "GET" and "/resolve/" in r.path]


SUBPROCESS = """
import logging, sys
from pathlib import Path
from hy3rl import hub
source, revision, dest, manifest, log = sys.argv[1:6]
logging.basicConfig(filename=log, level=logging.DEBUG, force=True)
logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
try:
    hub.run(source, revision, Path(dest), manifest=Path(manifest), threads=2)
except hub.HubError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def start_subprocess(fake: FakeHub, tmp_path: Path, env: dict[str, str] | None = None
                     ) -> subprocess.Popen:
    """hub.run in a fresh interpreter: HF_ENDPOINT (and HF_TOKEN) in its environment before
    huggingface_hub is imported, its log at tmp_path/model.log (DEBUG, every library)."""
    args = [REPO_ID, fake.commit, str(tmp_path / "model"), str(tmp_path / "out/manifest.json"),
            str(tmp_path / "model.log")]
    return subprocess.Popen([sys.executable, "-c", SUBPROCESS, *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


# --------------------------------------------------------------------------- download


def test_clean_download_manifest_matches_hub(fake_hub: FakeHub, tmp_path: Path) -> None:
    m = fetch(fake_hub, tmp_path)
    doc = json.loads((tmp_path / "out/manifest.json").read_text())
    assert doc["source"] == {"kind": "hub", "repo_id": REPO_ID,
                             "requested_revision": fake_hub.commit,
                             "resolved_revision": fake_hub.commit, "endpoint": fake_hub.url}
    assert doc["dir"] == str(tmp_path / "model")
    assert timefmt.parse(doc["created"]) is not None
    assert doc["file_count"] == len(fake_hub.files) == len(m.files)
    assert doc["total_size"] == sum(len(d) for d in fake_hub.files.values())
    listed = {f["path"]: f for f in doc["files"]}
    assert sorted(listed) == sorted(fake_hub.files)
    for path, data in fake_hub.files.items():
        entry = listed[path]
        assert entry["size"] == len(data)
        if path in fake_hub.lfs:  # the hub's sha256 for LFS files, its git blob id otherwise
            assert entry == {"path": path, "size": len(data),
                             "sha256": hashlib.sha256(data).hexdigest()}
        else:
            assert entry == {"path": path, "size": len(data), "git_blob": git_blob_id(data)}
        assert (tmp_path / "model" / path).read_bytes() == data
    assert any(p.endswith(".safetensors") for p in fake_hub.lfs) and len(fake_hub.lfs) == 3
    assert hub.verify(tmp_path / "out/manifest.json", tmp_path / "model", sha256=True,
                      threads=2, progress=False) == []
    # Each file fetched once, in one piece; a rerun asks for the file list only.
    assert sorted(r.path.rsplit("/", 1)[-1] for r in resolve_gets(fake_hub)) == \
        sorted(p.rsplit("/", 1)[-1] for p in fake_hub.files)
    assert all(r.range is None for r in resolve_gets(fake_hub))
    before = len(fake_hub.requests)
    fetch(fake_hub, tmp_path)
    assert [r.path for r in fake_hub.requests[before:]] == [
        f"/api/models/{REPO_ID}/revision/{fake_hub.commit}"]
    prov = hub.provenance(tmp_path / "out/manifest.json")
    assert prov["model.revision"] == fake_hub.commit and REPO_ID in prov["model.source"]
    assert prov["model.manifest_sha256"] == hashlib.sha256(
        (tmp_path / "out/manifest.json").read_bytes()).hexdigest()


def test_dropped_connection_resumes_with_range(fake_hub: FakeHub, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    fake_hub.drop_once[SHARD] = CUT
    with caplog.at_level("INFO", logger="hy3rl.hub"):
        fetch(fake_hub, tmp_path)
    assert f"{SHARD}: RemoteProtocolError" in caplog.text
    assert f"at byte {CUT} of {len(fake_hub.files[SHARD])}; resuming in 1 s" in caplog.text
    size = len(fake_hub.files[SHARD])
    gets = fake_hub.gets(SHARD)
    assert [(g.range, g.sent) for g in gets] == [(None, CUT), (f"bytes={CUT}-", size - CUT)]
    assert fake_hub.bytes_served(SHARD) == size
    assert (tmp_path / "model" / SHARD).read_bytes() == fake_hub.files[SHARD]
    assert hub.verify(tmp_path / "out/manifest.json", tmp_path / "model", sha256=True,
                      threads=2, progress=False) == []


def test_killed_run_resumes_on_rerun(fake_hub: FakeHub, tmp_path: Path) -> None:
    """A run killed mid-file (SIGKILL: no cleanup at all), then a rerun: the file continues
    from the bytes already on disk and nothing finished is fetched again."""
    fake_hub.stall_at[SHARD] = CUT
    proc = start_subprocess(fake_hub, tmp_path)
    try:
        assert fake_hub.stalled.wait(120), proc.communicate(timeout=5)
        part_dir = tmp_path / "model" / hub.CACHE_DIR / "partial"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                p.stat().st_size == CUT for p in part_dir.glob(f"{SHARD}.*.part")):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
        fake_hub.release()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "out/manifest.json").exists()
    size = len(fake_hub.files[SHARD])
    deadline = time.monotonic() + 10  # the stalled request is logged once released
    while not fake_hub.gets(SHARD) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(g.range, g.sent) for g in fake_hub.gets(SHARD)] == [(None, CUT)]
    # What the killed run left: finished files in place, partial files under .cache.
    model, part_dir = tmp_path / "model", tmp_path / "model" / hub.CACHE_DIR / "partial"
    finished = set(hub.list_files(model))
    partial = {p.relative_to(part_dir).as_posix().rsplit(".", 2)[0]: p.stat().st_size
               for p in part_dir.rglob("*.part")}
    assert partial[SHARD] == CUT
    first_run = len(fake_hub.requests)

    fetch(fake_hub, tmp_path)
    rerun = {r.path.split(f"/resolve/{fake_hub.commit}/", 1)[1]: r
             for r in fake_hub.requests[first_run:] if "/resolve/" in r.path}
    assert rerun[SHARD].range == f"bytes={CUT}-" and rerun[SHARD].sent == size - CUT < size
    assert not finished & set(rerun)  # nothing finished is fetched again
    for path, have in partial.items():  # every partial file continues where it stopped
        left = len(fake_hub.files[path]) - have
        assert ((rerun[path].range, rerun[path].sent) if left else path in rerun) == (
            (f"bytes={have}-" if have else None, left) if left else False)
    assert not list((tmp_path / "model" / hub.CACHE_DIR / "partial").rglob("*.part"))
    assert hub.verify(tmp_path / "out/manifest.json", tmp_path / "model", sha256=True,
                      threads=2, progress=False) == []


def test_content_not_matching_the_hub_hash_refused(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.corrupt.add(SHARD)
    with pytest.raises(hub.HubError) as info:
        fetch(fake_hub, tmp_path)
    data = fake_hub.files[SHARD]
    bad = hashlib.sha256(data[:-1] + bytes([data[-1] ^ 1])).hexdigest()
    assert (f"{SHARD}: downloaded sha256 {bad} != hub {hashlib.sha256(data).hexdigest()}"
            in str(info.value))
    assert not (tmp_path / "model" / SHARD).exists()
    assert not (tmp_path / "out/manifest.json").exists()
    fake_hub.corrupt.clear()
    fetch(fake_hub, tmp_path)  # the rerun fetches that file again, whole
    assert [(g.range, g.sent) for g in fake_hub.gets(SHARD)][-1] == (None, len(data))


def test_existing_copy_is_adopted_without_download(fake_hub: FakeHub, tiny_hy3_dir: Path,
                                                   tmp_path: Path) -> None:
    """Files already in model.dir (a copy made by hand) are hashed, not fetched again."""
    shutil.copytree(tiny_hy3_dir, tmp_path / "model")
    fetch(fake_hub, tmp_path)
    assert [r.path.rsplit("/", 1)[-1] for r in resolve_gets(fake_hub)] == [".gitattributes"]


# --------------------------------------------------------------------------- verify


def test_corrupted_byte_caught_with_both_hashes(fake_hub: FakeHub, tmp_path: Path) -> None:
    fetch(fake_hub, tmp_path)
    shard = tmp_path / "model" / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = tmp_path / "out/manifest.json"
    assert hub.verify(manifest, tmp_path / "model", sha256=False, threads=2,
                      progress=False) == []  # same size: only hashing sees it
    problems = hub.verify(manifest, tmp_path / "model", sha256=True, threads=2, progress=False)
    want = hashlib.sha256(fake_hub.files[SHARD]).hexdigest()
    got = hashlib.sha256(bytes(data)).hexdigest()
    assert problems == [f"{SHARD}: sha256 {got} (on disk) != {want} (manifest)"]


def test_verify_sizes_missing_extra_and_git_blobs(fake_hub: FakeHub, tmp_path: Path) -> None:
    fetch(fake_hub, tmp_path)
    model, manifest = tmp_path / "model", tmp_path / "out/manifest.json"
    (model / "model-00001-of-00003.safetensors").open("ab").write(b"\0")
    (model / "tokenizer_config.json").unlink()
    (model / "stray.bin").write_bytes(b"x")
    config = model / "config.json"
    config.write_bytes(config.read_bytes().replace(b"{", b"[", 1))  # same size, other blob
    problems = hub.verify(manifest, model, sha256=False, threads=2, progress=False)
    size = len(fake_hub.files["model-00001-of-00003.safetensors"])
    assert sorted(problems) == sorted([
        f"model-00001-of-00003.safetensors: size {size + 1} bytes != manifest {size}",
        "tokenizer_config.json: missing from "
        f"{model} (the manifest lists {len(fake_hub.files['tokenizer_config.json'])} bytes)",
        f"stray.bin: in {model} but not in the manifest {manifest}"])
    hashed = hub.verify(manifest, model, sha256=True, threads=2, progress=False)
    blob = git_blob_id(config.read_bytes())
    assert (f"config.json: git_blob {blob} (on disk) != "
            f"{git_blob_id(fake_hub.files['config.json'])} (manifest)") in hashed


def test_local_directory_manifest(tiny_hy3_copy, tmp_path: Path) -> None:
    src = tiny_hy3_copy("local")
    (src / ".cache").mkdir()
    (src / ".cache" / "ignored").write_text("not part of the checkpoint")
    manifest = tmp_path / "out" / "manifest.json"
    m = hub.run(str(src), None, tmp_path / "unused", manifest=manifest, threads=2,
                progress=False)
    doc = json.loads(manifest.read_text())
    assert doc["source"] == {"kind": "local", "path": str(src.resolve())}
    assert doc["dir"] == str(src.resolve())
    files = {p.name: p for p in src.iterdir() if p.is_file()}
    assert {f["path"] for f in doc["files"]} == set(files)
    for f in doc["files"]:
        data = files[f["path"]].read_bytes()
        assert f == {"path": f["path"], "size": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()}
    assert len(m.files) == len(files) and not (tmp_path / "unused").exists()
    assert hub.verify(manifest, src, sha256=True, threads=2, progress=False) == []
    shard = src / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    [problem] = hub.verify(manifest, src, sha256=True, threads=2, progress=False)
    want = next(f["sha256"] for f in doc["files"] if f["path"] == SHARD)
    assert problem == (f"{SHARD}: sha256 {hashlib.sha256(bytes(data)).hexdigest()} (on disk) "
                       f"!= {want} (manifest)")


def test_local_directory_cheap_identity_without_hashes(tiny_hy3_copy, tmp_path: Path) -> None:
    """checks.checkpoint.sha256 false: a local directory is described by sizes and
    modification times (no file is read), and a changed file still shows, in the check
    and in the run identity (issue 18)."""
    from hy3rl.identity import model_identity

    src = tiny_hy3_copy("cheap")
    manifest = tmp_path / "manifest.json"
    hub.run(str(src), None, tmp_path / "unused", manifest=manifest, threads=2,
            progress=False, hash_local=False)
    doc = json.loads(manifest.read_text())
    for f in doc["files"]:
        st = (src / f["path"]).stat()
        assert f == {"path": f["path"], "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    assert hub.verify(manifest, src, sha256=False, threads=2, progress=False) == []
    before = model_identity(doc)
    shard = src / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))  # same size, new content
    [problem] = hub.verify(manifest, src, sha256=False, threads=2, progress=False)
    assert problem.startswith(f"{SHARD}: modified after the manifest was written")
    hub.run(str(src), None, tmp_path / "unused", manifest=manifest, threads=2,
            progress=False, hash_local=False)
    assert model_identity(json.loads(manifest.read_text())) != before


def test_local_directory_changed_in_place_changes_rule_models_params(tiny_hy3_copy,
                                                                     tmp_path: Path) -> None:
    """Issue 27 item 11: rule model's params for a local directory (local_file_stats: a
    stat per file, at every invocation) change exactly for a file rewritten, replaced or
    added in place, naming it with its size and mtime, so Snakemake re-runs rule model and
    the manifest and the run identity follow the directory; .cache is not the checkpoint."""
    src = tiny_hy3_copy("inplace")
    (src / ".cache").mkdir()
    (src / ".cache" / "ignored").write_text("not part of the checkpoint")
    before = hub.local_file_stats(src)
    assert sorted(v.split(":")[0] for v in before.values()) == hub.list_files(src)
    assert hub.local_file_stats(src) == before  # stable: nothing read, nothing written
    shard = src / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))  # same size, new content
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000))
    (src / "extra.txt").write_text("added")
    after = hub.local_file_stats(src)
    changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
               if before.get(k) != after.get(k)}
    st = shard.stat()
    assert sorted(changed.values(), key=str) == sorted([
        (next(v for v in before.values() if v.startswith(f"{SHARD}: ")),
         f"{SHARD}: {st.st_size} bytes, mtime_ns {st.st_mtime_ns}"),
        (None, f"extra.txt: 5 bytes, mtime_ns {(src / 'extra.txt').stat().st_mtime_ns}"),
    ], key=str)
    assert hub.local_file_stats(tmp_path / "nope") == {}


@pytest.mark.slow  # a real run of rule model, then a dry run: ~20 s
def test_rule_model_reruns_for_a_local_directory_changed_in_place(tiny_hy3_copy,
                                                                  tmp_path: Path) -> None:
    """Through Snakemake: rule model made the manifest of a local directory; a shard then
    rewritten in place (same size) makes the next invocation re-run rule model, the reason
    naming the file with its mtime before and now (the manifest, an input of preflight, and
    the run identity follow)."""
    from fixtures.common import REPO_ROOT, run_snakemake

    src = tiny_hy3_copy("inplace")
    override = tmp_path / "model.yaml"
    override.write_text(f"model: {{source: {src}, revision: null}}\n")
    target = "results/tiny-default/model/manifest.json"
    args = [target, "--profile", str(REPO_ROOT / "profiles/local"), "--configfile",
            str(REPO_ROOT / "config/config.yaml"), str(override)]
    run_snakemake(args, tmp_path / "work")
    shard = src / SHARD
    old = shard.stat().st_mtime_ns
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    out = run_snakemake([*args, "-n"], tmp_path / "work").stdout
    new = shard.stat().st_mtime_ns
    assert (f"before: '{SHARD}: {len(data)} bytes, mtime_ns {old}' "
            f"now: '{SHARD}: {len(data)} bytes, mtime_ns {new}'") in out, out[-3000:]


def test_a_hub_checkpoint_edited_in_place_is_refused_while_the_dag_is_built(
        fake_hub: FakeHub, tmp_path: Path) -> None:
    """Issue 40: a hub model's identity is repo@commit, so its chat template edited in
    ``model.dir`` would change what every start reads under the same identity. Every DAG
    build checks each file's size and the small files' hub hashes (hy3rl.hub.
    in_place_problems): a dry run is refused before any job, naming the file; restored,
    nothing is said."""
    import shutil

    from fixtures.common import REPO_ROOT, run_snakemake

    fetch(fake_hub, tmp_path)
    manifest, model = tmp_path / "out/manifest.json", tmp_path / "model"
    assert hub.in_place_problems(manifest, model, REPO_ID, fake_hub.commit) == []
    small = next(p for p in sorted(fake_hub.files) if p.endswith(".json")
                 and p not in fake_hub.lfs)
    data = (model / small).read_bytes()
    (model / small).write_bytes(data.replace(b'"', b"'", 1))  # same size, other bytes
    (problem,) = hub.in_place_problems(manifest, model, REPO_ID, fake_hub.commit)
    assert problem.startswith(f"{small}: git_blob ") and "(manifest)" in problem, problem
    # another revision's manifest: rule model runs again, nothing to say here
    assert hub.in_place_problems(manifest, model, REPO_ID, "0" * 40) == []

    work = tmp_path / "work"
    layout_manifest = work / "results/tiny-default/model/manifest.json"
    layout_manifest.parent.mkdir(parents=True)
    shutil.copy(manifest, layout_manifest)
    override = tmp_path / "model.yaml"
    override.write_text(f"model: {{source: {REPO_ID}, revision: {fake_hub.commit}, "
                        f"dir: {model}}}\n")
    args = ["results/tiny-default/model/manifest.json", "-n", "--profile",
            str(REPO_ROOT / "profiles/local"), "--configfile",
            str(REPO_ROOT / "config/config.yaml"), str(override)]
    refused = run_snakemake(args, work, check=False)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and f"model.dir {model} no longer holds" in out, out[-3000:]
    assert f"{small}: git_blob" in out and "snakemake -R model" in out
    (model / small).write_bytes(data)
    assert "Nothing to be done" in run_snakemake(args, work).stdout


def test_missing_local_directory_named(tmp_path: Path) -> None:
    with pytest.raises(hub.HubError, match=r"model\.source: .*is not a directory"):
        hub.run(str(tmp_path / "nope"), None, tmp_path / "m", manifest=tmp_path / "x.json")


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("revision, why", [
    ("main", "branch names and tags are refused"),
    ("v1.0", "branch names and tags are refused"),
    ("abc1234", "short SHA"),
    ("A" * 40, "lowercase"),
    (None, "missing"),
])
def test_revision_not_a_full_sha_refused_before_any_request(
        fake_hub: FakeHub, tmp_path: Path, revision: str | None, why: str) -> None:
    with pytest.raises(hub.RevisionError, match=r"^model\.revision: ") as info:
        hub.run(REPO_ID, revision, tmp_path / "model", manifest=tmp_path / "m.json")
    assert why in str(info.value)
    assert fake_hub.requests == []
    assert not (tmp_path / "model").exists()


def test_too_little_disk_refused_before_download(fake_hub: FakeHub, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(hub.DiskSpaceError) as info:
        fetch(fake_hub, tmp_path)
    need = sum(len(d) for d in fake_hub.files.values())
    msg = str(info.value)
    assert msg.startswith(f"model.dir: {tmp_path / 'model'} has 1.00 KB free (1000 bytes)")
    assert f"needs {hub.human(need)} more ({need} bytes" in msg
    assert resolve_gets(fake_hub) == []
    assert not (tmp_path / "out/manifest.json").exists()


def test_offline_mode_error_names_keys(fake_hub: FakeHub, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.OfflineError) as info:
        fetch(fake_hub, tmp_path)
    msg = str(info.value)
    for key in ("model.source", "model.revision", "local directory", "HF_HUB_OFFLINE"):
        assert key in msg
    assert fake_hub.requests == []


def test_unreachable_endpoint_error_names_keys(fake_hub: FakeHub, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(hub.OfflineError) as info:
        fetch(fake_hub, tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"model.source {REPO_ID!r} at model.revision {fake_hub.commit!r}: "
                          "cannot reach the hub (ConnectError")
    assert "local directory" in msg and f"127.0.0.1:{port}" in msg


def test_unknown_revision_and_repo_named(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(hub.HubError, match=r"^model\.revision: 0{40} is not a commit of"):
        hub.run(REPO_ID, "0" * 40, tmp_path / "m", manifest=tmp_path / "m.json")
    with pytest.raises(hub.HubError, match=r"^model\.source: repository 'no/such' not found"):
        hub.run("no/such", fake_hub.commit, tmp_path / "m", manifest=tmp_path / "m.json")


# --------------------------------------------------------------------------- token


def test_token_sent_and_written_nowhere(fake_hub: FakeHub, tmp_path: Path,
                                        capfd: pytest.CaptureFixture[str],
                                        caplog: pytest.LogCaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    alphabet = string.ascii_letters + string.digits
    token = "hf_" + "".join(alphabet[b % len(alphabet)] for b in os.urandom(30))
    env = {"HF_TOKEN": token, "HF_DEBUG": "1"}
    # 1. A mirror that echoes the Authorization header into its error message.
    fake_hub.refuse["config.json"] = (403, "forbidden for {auth}")
    proc = start_subprocess(fake_hub, tmp_path, env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "error: model.source" in err and "config.json" in err and "[REDACTED]" in err
    outputs = [out, err, (tmp_path / "model.log").read_text()]
    # 2. Then a clean run, in a fresh interpreter and in this one.
    del fake_hub.refuse["config.json"]
    proc = start_subprocess(fake_hub, tmp_path, env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    outputs += [out, err, (tmp_path / "model.log").read_text()]
    monkeypatch.setenv("HF_TOKEN", token)
    (tmp_path / "out/manifest.json").unlink()
    with caplog.at_level("DEBUG"):
        fetch(fake_hub, tmp_path)
    captured = capfd.readouterr()
    outputs += [captured.out, captured.err, caplog.text]
    # The token was used for every request about the repository (huggingface_hub's own
    # once-a-day GET /api/agent-harnesses, in the fresh interpreters, goes without it) ...
    assert {r.authorization for r in fake_hub.requests if REPO_ID in r.path} == {
        f"Bearer {token}"}
    # ... and is in no output, log, message or file the stage wrote (the commit is kept).
    assert all(fake_hub.commit in outputs[i] for i in (2, 5, 8))
    for text in outputs:
        assert token not in text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


# --------------------------------------------------------------------------- the stage


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_hy3rl_model_and_check_checkpoint_on_the_layout(fake_hub: FakeHub, tmp_path: Path,
                                                        bridge_repo_factory) -> None:
    """`hy3rl model` (what rule model's adapter runs) on a hub source: the manifest at the
    layout's path, the files in model.dir, HF_TOKEN in neither; `hy3rl check_checkpoint`
    then passes against it with hashing on (git blob ids included). Offline, exit 1 with
    the keys named and no traceback."""
    import yaml

    work = tmp_path / "work"
    (work / "results/t/deps").mkdir(parents=True)
    shutil.copy(bridge_repo_factory()[2], work / "results/t/deps/lock.json")
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": {"name": "t"}, "checks": {"checkpoint": {"sha256": True}},
        "model": {"source": REPO_ID, "revision": fake_hub.commit, "dir": str(tmp_path / "hy3")}}))
    configs = ["--configfile", str(Path(__file__).parents[1] / "config/config.yaml"),
               "--configfile", str(cfg)]
    token = "hf_" + "x7" * 16
    env = {**os.environ, "HF_TOKEN": token}

    def hy3rl(stage: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hy3rl.cli", stage, *configs],
                              capture_output=True, text=True, cwd=work, env={**env, **extra},
                              timeout=300)

    proc = hy3rl("model")
    assert proc.returncode == 0, proc.stderr
    manifest = work / "results/t/model/manifest.json"
    doc = json.loads(manifest.read_text())
    assert doc["source"]["repo_id"] == REPO_ID and doc["dir"] == str(tmp_path / "hy3")
    assert doc["source"]["resolved_revision"] == fake_hub.commit
    assert token not in proc.stdout + proc.stderr and token not in manifest.read_text()
    proc = hy3rl("check_checkpoint")
    assert proc.returncode == 0, proc.stderr
    check = json.loads((work / "results/t/checks/checkpoint.json").read_text())
    row = next(c for c in check["checks"] if c["name"] == "manifest")
    assert row["status"] == "pass" and "sizes and hashes" in row["details"]
    manifest.unlink()
    proc = hy3rl("model", HF_HUB_OFFLINE="1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "hy3rl model: error: model.source" in proc.stderr and "model.revision" in proc.stderr
    assert not manifest.exists()
    # Rule model itself (Snakemake, the environment passed through): the files are there,
    # so it asks the hub for the file list only and writes the manifest.
    from fixtures.common import run_snakemake

    before = len(fake_hub.requests)
    run_snakemake([*configs[:2], str(cfg), "--cores", "2", "--", str(manifest.relative_to(
        work))], work, env={"HF_TOKEN": token})
    assert json.loads(manifest.read_text())["files"] == doc["files"]
    assert [r.path for r in fake_hub.requests[before:] if REPO_ID in r.path] == [
        f"/api/models/{REPO_ID}/revision/{fake_hub.commit}"]
    log = (work / "results/t/logs/model.log").read_text()
    assert "rule model: 4 rerun trigger(s)" in log and token not in log


# --------------------------------------------------------------------------- the double


def test_fixture_serves_huggingface_hub_snapshot_download(fake_hub: FakeHub,
                                                          tmp_path: Path) -> None:
    """huggingface_hub's own snapshot_download (tree listing, HEAD, GET) works against the
    test double, so it answers as the library expects."""
    from huggingface_hub import snapshot_download

    out = snapshot_download(REPO_ID, revision=fake_hub.commit, local_dir=tmp_path / "snap",
                            endpoint=fake_hub.url, cache_dir=tmp_path / "hf-cache")
    for path, data in fake_hub.files.items():
        assert (Path(out) / path).read_bytes() == data
    methods = {(r.method, r.path.split("/")[1]) for r in fake_hub.requests}
    assert ("HEAD", REPO_ID.split("/")[0]) in methods and ("GET", "api") in methods
