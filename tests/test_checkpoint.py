"""check_checkpoint on real tiny Hy3 checkpoints: the clean one passes, and each defect is
caught by the right check with a message naming the file/tensor at fault."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from fixtures.checkpoint import FAKE_BRIDGE, rewrite_checkpoint
from fixtures.common import make_config
from hy3rl import checkpoint as ck
from hy3rl import hub
from hy3rl.bridge_source import bridge_source_from_lock

REPO = Path(__file__).resolve().parents[1]
SHARD2 = "model-00002-of-00003.safetensors"


def run_checks(ckpt: Path, lock: Path | None = None, **kw):
    source, why = bridge_source_from_lock(lock) if lock else (None, "no lock")
    results, extra = ck.check_checkpoint(ckpt, source, why, try_import=False, **kw)
    return {r.name: r for r in results}, extra


def failing(results) -> set[str]:
    return {n for n, r in results.items() if r.status == "fail"}


def text(result) -> str:
    return result.details + "\n" + "\n".join(result.problems)


@pytest.fixture
def lock(bridge_repo_factory) -> Path:
    return bridge_repo_factory()[2]


def test_clean_tiny_passes_every_check(tiny_hy3_dir: Path, lock: Path):
    results, extra = run_checks(tiny_hy3_dir, lock)
    assert failing(results) == set()
    for name in ("config", "index", "headers", "index_vs_shards", "total_size", "format",
                 "inventory", "expert_bias", "bridge_mapping"):
        assert results[name].status == "pass", (name, text(results[name]))
    assert results["bridge_mapping_import"].status == "not run"
    assert results["manifest"].status == "not run"  # no model manifest given
    assert extra["inventory"]["layers"] == {"dense": [0], "moe": [1, 2], "mtp": [3]}
    assert "exactly one mapping" in results["bridge_mapping"].details


def test_missing_shard(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    (ckpt / SHARD2).unlink()
    results, _ = run_checks(ckpt, lock)
    assert results["index"].status == "fail"
    assert f"shard {SHARD2} is missing" in text(results["index"])


def test_extra_shard_file(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    (ckpt / "model-00004-of-00003.safetensors").write_bytes((ckpt / SHARD2).read_bytes())
    results, _ = run_checks(ckpt, lock)
    assert "model-00004-of-00003.safetensors: shard file in the directory but not in" in text(
        results["index"])


def test_truncated_header(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    raw = (ckpt / SHARD2).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    (ckpt / SHARD2).write_bytes(raw[: 8 + n // 2])
    results, _ = run_checks(ckpt, lock)
    assert results["headers"].status == "fail"
    assert f"{SHARD2}: truncated header" in text(results["headers"])
    assert results["total_size"].status == "not run"


def _edit_header(path: Path, edit) -> None:
    """Rewrite a shard's JSON header in place, padded with spaces to its old length."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = edit(raw[8:8 + n].decode())
    assert len(text.encode()) <= n
    path.write_bytes(raw[:8] + text.encode().ljust(n) + raw[8 + n:])


@pytest.mark.parametrize("edit, message", [
    (lambda h: "{" + h[2:], "header is not valid JSON"),
    (lambda h: h.replace('"BF16"', '"Q8"', 1), "unknown dtype 'Q8'"),
    (lambda h: h.replace('"F32"', '"F16"', 1), "do not hold F16"),
])
def test_corrupt_header_named(tiny_hy3_copy, lock, edit, message):
    ckpt = tiny_hy3_copy()
    shard = SHARD2  # holds F32 expert biases
    _edit_header(ckpt / shard, edit)
    results, _ = run_checks(ckpt, lock)
    assert results["headers"].status == "fail"
    assert any(p.startswith(f"{shard}: ") and message in p for p in results["headers"].problems), \
        text(results["headers"])
    assert results["total_size"].status == "not run"


def test_truncated_data_region(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    raw = (ckpt / SHARD2).read_bytes()
    (ckpt / SHARD2).write_bytes(raw[:-100])
    results, _ = run_checks(ckpt, lock)
    assert f"{SHARD2}: data region truncated" in text(results["headers"])


def test_indexed_key_absent_from_its_shard(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    victim = next(k for k, s in index["weight_map"].items() if s == SHARD2)
    rewrite_checkpoint(ckpt, lambda t: {k: v for k, v in t.items() if k != victim})
    index_after = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index_after["weight_map"][victim] = SHARD2  # the index still lists it
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index_after))
    results, _ = run_checks(ckpt, lock)
    assert results["index_vs_shards"].status == "fail"
    assert f"{victim}: indexed in {SHARD2} but absent from that shard's header" in text(
        results["index_vs_shards"])


def test_key_missing_from_index(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    path = ckpt / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    victim = "model.layers.1.self_attn.q_proj.weight"
    shard = index["weight_map"].pop(victim)
    path.write_text(json.dumps(index))
    results, _ = run_checks(ckpt, lock)
    assert failing(results) == {"index_vs_shards"}
    assert f"{victim}: in {shard} but missing from the index" in text(results["index_vs_shards"])


def test_wrong_dtype(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    name = "model.layers.2.mlp.experts.1.up_proj.weight"
    rewrite_checkpoint(ckpt, lambda t: {**t, name: t[name].float()})
    results, _ = run_checks(ckpt, lock)
    assert failing(results) == {"inventory"}
    assert f"{name} in " in text(results["inventory"])
    assert "dtype F32, expected BF16" in text(results["inventory"])


def test_wrong_shape(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    name = "model.layers.3.eh_proj.weight"  # the MTP layer
    rewrite_checkpoint(ckpt, lambda t: {**t, name: t[name][:, :64].clone()})
    results, _ = run_checks(ckpt, lock)
    assert failing(results) == {"inventory"}
    assert "shape [64, 64], expected [64, 128] from config.json" in text(results["inventory"])


def test_wrong_shape_in_the_dense_layer(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    name = "model.layers.0.mlp.gate_proj.weight"  # the dense layer (intermediate 128)
    rewrite_checkpoint(ckpt, lambda t: {**t, name: t[name][:96].clone()})
    results, _ = run_checks(ckpt, lock)
    assert failing(results) == {"inventory"}
    assert f"{name} in " in text(results["inventory"])
    assert "shape [96, 64], expected [128, 64] from config.json" in text(results["inventory"])


def test_missing_expert_bias(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    name = "model.layers.2.mlp.expert_bias"
    rewrite_checkpoint(ckpt, lambda t: {k: v for k, v in t.items() if k != name})
    results, _ = run_checks(ckpt, lock)
    assert {"expert_bias", "inventory", "bridge_mapping"} == failing(results)
    assert f"missing {name}: the bridge would leave layer 2's router.expert_bias at zero" in text(
        results["expert_bias"])
    assert "Can't find ... in hf_keys" in text(results["bridge_mapping"])


def test_all_zero_expert_bias(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    name = "model.layers.3.mlp.expert_bias"  # MTP layer's
    rewrite_checkpoint(ckpt, lambda t: {**t, name: torch.zeros_like(t[name])})
    results, _ = run_checks(ckpt, lock)
    assert failing(results) == {"expert_bias"}
    assert f"{name} in " in text(results["expert_bias"]) and "all zero" in text(
        results["expert_bias"])


def test_non_finite_expert_bias(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    name = "model.layers.1.mlp.expert_bias"
    rewrite_checkpoint(ckpt, lambda t: {**t, name: torch.tensor([0.1, float("nan"), 0.2, 0.3])})
    results, _ = run_checks(ckpt, lock)
    assert "1 non-finite values" in text(results["expert_bias"])


def _to_outer(t: dict) -> dict:
    """Rewrite inner names into Tencent's outer fused format (what the bridge cannot read)."""
    out = {}
    layers = sorted({int(k.split(".")[2]) for k in t if ".mlp.experts." in k})
    for k, v in t.items():
        if ".mlp.experts." in k:
            continue
        k = k.replace("mlp.expert_bias", "mlp.e_score_correction_bias")
        k = k.replace("mlp.shared_mlp.", "mlp.shared_experts.").replace("mlp.router.gate.",
                                                                        "mlp.gate.")
        out[k] = v
    for i in layers:
        p = f"model.layers.{i}.mlp.experts"
        n = len({k for k in t if k.startswith(p) and k.endswith("down_proj.weight")})
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]])
             for e in range(n)])
        out[f"{p}.down_proj"] = torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(n)])
    return out


def test_outer_format_refused_with_what_to_do(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    rewrite_checkpoint(ckpt, _to_outer)
    results, _ = run_checks(ckpt, lock)
    fmt = results["format"]
    assert fmt.status == "fail"
    assert "outer (fused) format" in fmt.details and "save_pretrained" in fmt.details
    assert any("e_score_correction_bias" in p for p in fmt.problems)
    assert any("gate_up_proj" in p for p in fmt.problems)
    assert results["bridge_mapping"].status == "fail"
    assert "no bridge mapping claims it" in text(results["bridge_mapping"])


def test_wrong_total_size(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    path = ckpt / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["metadata"]["total_size"] += 2
    path.write_text(json.dumps(index))
    results, _ = run_checks(ckpt, lock)
    assert failing(results) == {"total_size"}
    assert "metadata.total_size is" in results["total_size"].details
    assert "(difference -2)" in results["total_size"].details


def test_config_not_hy_v3(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    cfg["model_type"] = "deepseek_v3"
    path.write_text(json.dumps(cfg))
    results, _ = run_checks(ckpt, lock)
    assert results["config"].status == "fail"
    assert "model_type is 'deepseek_v3', expected 'hy_v3'" in results["config"].details
    for dependent in ("inventory", "expert_bias", "bridge_mapping"):
        assert results[dependent].status == "not run"


def test_bridge_table_unreadable_is_not_run(tiny_hy3_dir, bridge_repo_factory):
    # File moved away in the pinned clone.
    _, _, lock = bridge_repo_factory(text=None, name="moved")
    results, _ = run_checks(tiny_hy3_dir, lock)
    r = results["bridge_mapping"]
    assert r.status == "not run" and "not found at" in r.details
    # Format changed: the table now comes from a file read at run time.
    changed = FAKE_BRIDGE.replace("        simple = {", "        simple = load_yaml('m.yaml')\n"
                                  "        unused = {", 1)
    _, _, lock = bridge_repo_factory(text=changed, name="changed")
    results, _ = run_checks(tiny_hy3_dir, lock)
    r = results["bridge_mapping"]
    assert r.status == "not run" and "call of load_yaml()" in r.details
    # No lock at all.
    results, _ = run_checks(tiny_hy3_dir, None)
    assert results["bridge_mapping"].status == "not run"


def test_bridge_missing_mapping_fails(tiny_hy3_dir, bridge_repo_factory):
    line = '"decoder.layers.*.mlp.router.expert_bias": "model.layers.*.mlp.expert_bias",\n'
    text_ = FAKE_BRIDGE.replace(" " * 12 + line, "")
    assert text_ != FAKE_BRIDGE
    _, _, lock = bridge_repo_factory(text=text_, name="nobias")
    results, _ = run_checks(tiny_hy3_dir, lock)
    r = results["bridge_mapping"]
    assert r.status == "fail"
    assert any(p.startswith("checkpoint tensor model.layers.1.mlp.expert_bias (moe): no bridge "
                            "mapping claims it") for p in r.problems)
    # The MTP loop reuses the per-layer table, so the MTP layer's bias is unclaimed too.
    assert any("model.layers.3.mlp.expert_bias (mtp): no bridge mapping" in p
               for p in r.problems)
    assert r.problem_count == 3


def test_bridge_ambiguous_claim_fails(tiny_hy3_dir, bridge_repo_factory):
    text_ = FAKE_BRIDGE.replace(
        '            "output_layer.weight": "lm_head.weight",\n',
        '            "output_layer.weight": "lm_head.weight",\n'
        '            "decoder.layers.*.mlp.router.bias": "model.layers.*.mlp.**",\n')
    _, _, lock = bridge_repo_factory(text=text_, name="ambiguous")
    results, _ = run_checks(tiny_hy3_dir, lock)
    r = results["bridge_mapping"]
    assert r.status == "fail"
    assert any(p.startswith("model.layers.1.mlp.expert_bias: claimed by 2 different mappings")
               for p in r.problems)


def test_bridge_partial_qkv_fails(tiny_hy3_copy, lock):
    ckpt = tiny_hy3_copy()
    name = "model.layers.0.self_attn.v_proj.weight"
    rewrite_checkpoint(ckpt, lambda t: {k: v for k, v in t.items() if k != name})
    results, _ = run_checks(ckpt, lock)
    r = results["bridge_mapping"]
    assert any(f"but not its v part {name}" in p for p in r.problems)


def write_manifest(ckpt: Path, out: Path) -> Path:
    """Rule model's manifest of a local directory (hy3rl.hub.run: sizes + sha256)."""
    hub.run(str(ckpt), None, "", manifest=out, threads=2, progress=False)
    return out


def test_manifest_sizes_always_hashes_with_sha256(tiny_hy3_copy, tmp_path: Path, lock: Path):
    """The model manifest check: a clean copy passes; a corrupted byte in a local copy (same
    size) passes on sizes alone and is caught with sha256 on, naming the file and both
    hashes; a truncated file is caught by its size even with hashing off."""
    ckpt = tiny_hy3_copy()
    manifest = write_manifest(ckpt, tmp_path / "model" / "manifest.json")
    for sha in (False, True):
        results, extra = run_checks(ckpt, lock, sha256=sha, manifest=manifest)
        assert failing(results) == set(), {n: text(r) for n, r in results.items()}
        assert results["manifest"].status == "pass"
        assert ("hashes" in results["manifest"].details) and extra["manifest"] == str(manifest)
    assert "not compared" in run_checks(ckpt, lock, manifest=manifest)[0]["manifest"].details
    shard = ckpt / SHARD2
    want = hashlib.sha256(shard.read_bytes()).hexdigest()
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0x01  # a weight byte: the header and sizes stay valid
    shard.write_bytes(bytes(blob))
    got = hashlib.sha256(bytes(blob)).hexdigest()
    results, _ = run_checks(ckpt, lock, sha256=False, manifest=manifest)
    assert failing(results) == set()  # sizes alone cannot see it
    results, _ = run_checks(ckpt, lock, sha256=True, manifest=manifest)
    assert failing(results) == {"manifest"}
    assert results["manifest"].problems == [
        f"{SHARD2}: sha256 {got} (on disk) != {want} (manifest)"]
    with open(shard, "r+b") as fh:  # truncated: caught by size with hashing off
        fh.truncate(len(blob) - 8)
    results, _ = run_checks(ckpt, lock, sha256=False, manifest=manifest)
    assert f"{SHARD2}: size {len(blob) - 8} bytes != manifest {len(blob)}" in \
        results["manifest"].problems


def test_manifest_of_another_directory_or_unreadable_fails(tiny_hy3_copy, tmp_path: Path):
    ckpt, other = tiny_hy3_copy("a"), tiny_hy3_copy("b")
    manifest = write_manifest(other, tmp_path / "manifest.json")
    results, _ = run_checks(ckpt, manifest=manifest)
    assert results["manifest"].status == "fail"
    assert f"describes {other}, not {ckpt}" in results["manifest"].problems[0]
    manifest.write_text("{}")
    results, _ = run_checks(ckpt, manifest=manifest)
    assert results["manifest"].status == "fail"
    assert "not a model manifest" in results["manifest"].details


def test_run_writes_report_and_fails_on_a_failed_check(tiny_hy3_copy, lock, tmp_path: Path,
                                                       capfd):
    ckpt = tiny_hy3_copy()
    out = tmp_path / "checks" / "checkpoint.json"
    checks = make_config(checks={"checkpoint": {"sha256": False}}).checks.checkpoint
    manifest = write_manifest(ckpt, tmp_path / "model" / "manifest.json")
    doc = ck.run(checks, model=ckpt, manifest=manifest, lock=lock, out=out, threads=2)
    assert json.loads(out.read_text()) == doc
    assert doc["ok"] is True and doc["counts"]["fail"] == 0
    assert doc["created"].endswith("+00:00")  # hy3rl.timefmt
    assert [c["name"] for c in doc["checks"]][:3] == ["config", "index", "headers"]
    assert "PASS     inventory" in capfd.readouterr().out
    # The import attempt records why it did not run.
    imp = next(c for c in doc["checks"] if c["name"] == "bridge_mapping_import")
    assert imp["status"] == "not run" and imp["details"].startswith("not run: ")
    (ckpt / SHARD2).unlink()
    with pytest.raises(ck.ChecksFailed, match=r"\d+ check\(s\) failed \(index, "):
        ck.run(checks, model=ckpt, manifest=manifest, lock=lock, out=out, threads=2)
    doc = json.loads(out.read_text())  # written before the error
    assert doc["ok"] is False and "FAIL     index" in capfd.readouterr().out


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_hy3rl_check_checkpoint_exit_code_and_message(tiny_hy3_copy, lock, tmp_path: Path):
    """`hy3rl model` then `hy3rl check_checkpoint`: the layout's paths, exit 0 on pass; on a
    failed check the report is written, the message names the check, exit 1 (no
    traceback)."""
    ckpt = tiny_hy3_copy()
    work = tmp_path / "work"
    (work / "results/t/deps").mkdir(parents=True)
    shutil.copy(lock, work / "results/t/deps/lock.json")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "t"}, "model": {"source": str(ckpt)},
                                   "checks": {"checkpoint": {"sha256": False}}}))
    configs = ["--configfile", str(REPO / "config/config.yaml"), "--configfile", str(cfg)]
    proc = subprocess.run([sys.executable, "-m", "hy3rl.cli", "model", *configs],
                          capture_output=True, text=True, cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((work / "results/t/model/manifest.json").read_text())["dir"] == str(ckpt)
    cmd = [sys.executable, "-m", "hy3rl.cli", "check_checkpoint", *configs]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = work / "results/t/checks/checkpoint.json"
    assert json.loads(out.read_text())["ok"] is True
    (ckpt / SHARD2).unlink()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    assert proc.returncode == 1
    assert "hy3rl check_checkpoint: error: check_checkpoint of" in proc.stderr
    assert "check(s) failed (index, " in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads(out.read_text())["ok"] is False


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_workflow_builds_tiny_model_then_checks_it(deps_upstreams, tmp_path: Path,
                                                   tiny_hy3_dir: Path):
    """The real rules: deps (local mirrors) -> tiny_model -> model -> check_checkpoint,
    through Snakemake on the embedded default; then another local model.source drops
    tiny_model, and a hub source has rule model with no input."""
    import yaml
    from fixtures.checkpoint import BRIDGE_PATH
    from fixtures.common import run_snakemake

    up = deps_upstreams
    up.add_commit("megatron_bridge", {BRIDGE_PATH: FAKE_BRIDGE})
    work = tmp_path / "work"
    work.mkdir()
    override = {"run": {"name": "t"},
                "deps": {"dir": "deps", "repos": up.section(work / "deps")["repos"]}}
    cfg = tmp_path / "mirrors.yaml"
    cfg.write_text(yaml.safe_dump(override))
    target = "results/t/checks/checkpoint.json"
    base = ["--configfile", str(REPO / "config/config.yaml"), str(cfg)]
    run_snakemake([*base, "--cores", "2", target], work)
    doc = json.loads((work / target).read_text())
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert doc["ok"] and status["bridge_mapping"] == "pass" and status["inventory"] == "pass"
    assert status["manifest"] == "pass"  # the embedded default hashes (sha256: true)
    assert doc["manifest"] == "results/t/model/manifest.json"
    manifest = json.loads((work / doc["manifest"]).read_text())
    assert manifest["source"] == {"kind": "local", "path": str(work / "resources/tiny-hy3")}
    assert sorted(f["path"] for f in manifest["files"]) == sorted(
        p.name for p in tiny_hy3_dir.iterdir())
    assert "rule model: 4 rerun trigger(s)" in (work / "results/t/logs/model.log").read_text()
    assert (work / "resources/tiny-hy3/config.json").is_file()
    for name in sorted(p.name for p in tiny_hy3_dir.iterdir()):  # same seed, same bytes
        assert (work / "resources/tiny-hy3" / name).read_bytes() == \
            (tiny_hy3_dir / name).read_bytes(), name
    assert "PASS     bridge_mapping" in (work / "results/t/logs/check_checkpoint.log").read_text()
    # Another local model.source: no rule builds it; rule model describes it in place.
    proc = run_snakemake([*base, "--config", f"model={{'source': '{tiny_hy3_dir}'}}", "-n",
                          target], work)
    assert "tiny_model" not in proc.stdout and "rule model:" in proc.stdout
    assert f"input: {tiny_hy3_dir}" in proc.stdout
    assert "model.source" in proc.stdout  # the changed key is the rerun reason
    # A hub source: rule model downloads (no input), everything reading the model waits.
    sha = "0123456789abcdef0123456789abcdef01234567"
    proc = run_snakemake([*base, "--config", "model={'source': 'tencent/Hy3', 'revision': "
                          f"'{sha}', 'dir': '{tmp_path / 'hy3'}'}}", "-n", target], work)
    job = proc.stdout.split("rule model:")[1].split("\n\n")[0]
    assert "input:" not in job.split("reason:")[0] and "model/manifest.json" in job


def test_nothing_to_check_is_never_a_pass(tiny_hy3_copy, lock):
    """A directory with config.json only (no index, no shards): every check that had nothing
    to read says `not run` or `fail`; only the config check can pass."""
    ckpt = tiny_hy3_copy()
    for p in [*ckpt.glob("*.safetensors"), ckpt / "model.safetensors.index.json"]:
        p.unlink()
    results, extra = run_checks(ckpt, lock)
    passed = {n for n, r in results.items() if r.status == "pass"}
    assert passed == {"config"}, {n: r.details for n, r in results.items()}
    assert results["headers"].status == "not run" and "no *.safetensors" in \
        results["headers"].details
    assert results["format"].status == "not run"
    assert {"index", "inventory", "expert_bias"} <= failing(results)
    assert extra["inventory"]["tensors"] == 0
    # An index that lists nothing, with the shards still there, is not a whole checkpoint.
    ckpt = tiny_hy3_copy("empty-index")
    path = ckpt / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": {}}))
    results, _ = run_checks(ckpt, lock)
    assert results["index"].status == "fail" and "weight_map' is empty" in results["index"].details
    assert results["index_vs_shards"].status == "not run"
