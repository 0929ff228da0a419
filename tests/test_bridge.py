"""hy3rl.bridge_source (the mapping table read from source with ast, on our own
bridge-shaped file) and hy3rl.bridge: the CPU-runnable parts of check_bridge (warning
capture, tensor and logits comparison, result writing, `not run` without a GPU) and its
`run()`, which starts the check in the training runtime. The Megatron conversion itself
needs a GPU with Transformer Engine; where a test needs its output, a CPU stand-in plays it."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from fixtures.checkpoint import FAKE_BRIDGE, rewrite_checkpoint
from fixtures.common import make_config
from hy3rl import bridge as br
from hy3rl import bridge_source as bs
from hy3rl import checkpoint as ck

CFG = {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}


# ------------------------------------------------------------------------ mapping table


def test_reads_table_with_mtp_loop():
    table = bs.read_mapping_table(FAKE_BRIDGE, CFG)
    by_mg = {m.megatron: m for m in table}
    assert len(table) == 20 + 21  # 15 simple + 5 special, MTP: 12 reused + 4 heads + 5
    qkv = by_mg["decoder.layers.*.self_attention.linear_qkv.weight"]
    assert qkv.kind == "QKVMapping"
    assert dict(qkv.hf) == {"q": "model.layers.*.self_attn.q_proj.weight",
                            "k": "model.layers.*.self_attn.k_proj.weight",
                            "v": "model.layers.*.self_attn.v_proj.weight"}
    mtp = by_mg["mtp.layers.0.mtp_model_layer.mlp.router.expert_bias"]
    assert mtp.hf == (("param", "model.layers.3.mlp.expert_bias"),)
    assert by_mg["mtp.layers.0.eh_proj.weight"].hf_patterns == ("model.layers.3.eh_proj.weight",)
    gated = by_mg["mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc1.weight*"]
    assert dict(gated.hf)["up"] == "model.layers.3.mlp.experts.*.up_proj.weight"
    # No MTP layer in the config: no MTP mappings.
    assert len(bs.read_mapping_table(FAKE_BRIDGE, {"num_hidden_layers": 3})) == 20


@pytest.mark.parametrize("change, message", [
    (("simple = {", "simple = dict(a=1)\n        other = {"), "keyword arguments to dict()"),
    (("for i in range(n_mtp):", "while n_mtp:"), "unsupported statement While"),
    (("def mapping_registry(self)", "def registry(self)"), "expected one function"),
    (("return MegatronMappingRegistry(*mappings)", "return None"), "not a list of mappings"),
    (("q=\"model.layers.*.self_attn.q_proj.weight\",", "q=Q_NAME,"), "unknown name 'Q_NAME'"),
    (("hf_i = base + i", "hf_i = base / i"), "unsupported operator Div"),
])
def test_changed_format_is_refused_with_line(change, message):
    old, new = change
    assert old in FAKE_BRIDGE
    with pytest.raises(bs.TableFormatError, match=message):
        bs.read_mapping_table(FAKE_BRIDGE.replace(old, new, 1), CFG, filename="b.py")


def test_missing_config_attribute_is_table_error():
    with pytest.raises(bs.TableFormatError, match="no attribute 'num_hidden_layers'"):
        bs.read_mapping_table(FAKE_BRIDGE, {"num_nextn_predict_layers": 1})


def test_pattern_regex_is_megatron_bridge_rule():
    rx = bs.pattern_regex("model.layers.*.mlp.experts.*.up_proj.weight")
    assert rx.match("model.layers.12.mlp.experts.191.up_proj.weight").groups() == ("12", "191")
    assert not rx.match("model.layers.x.mlp.experts.1.up_proj.weight")
    assert bs.pattern_regex("model.**").match("model.a.b.c")


def test_read_pinned_source_reads_the_commit_not_the_worktree(bridge_repo_factory):
    clone, head, _ = bridge_repo_factory()
    (clone / bs.BRIDGE_RELPATH).write_text("local edit\n")
    assert bs.read_pinned_source(clone, head) == FAKE_BRIDGE
    with pytest.raises(bs.TableFormatError, match="not found at"):
        bs.read_pinned_source(clone, "0" * 40)


def test_compare_tables():
    parsed = bs.read_mapping_table(FAKE_BRIDGE, CFG)
    alias = bs.BridgeMapping("AutoMapping", "decoder.layers.*.input_layernorm.weight",
                             (("param", "model.layers.*.input_layernorm.weight"),))
    assert bs.compare_tables(parsed, [*parsed, alias]) == []  # bridge-added alias is fine
    problems = bs.compare_tables(parsed, parsed[1:])
    assert problems == ["parsed mapping embedding.word_embeddings.weight -> "
                        "('model.embed_tokens.weight',) is not in the imported "
                        "mapping_registry()"]
    odd = bs.BridgeMapping("AutoMapping", "x.*", (("param", "model.odd.*"),))
    assert "HF pattern not in the parsed table" in bs.compare_tables(parsed, [*parsed, odd])[0]


def test_import_blocker_here():
    why = bs.import_blocker()
    if sys.version_info < (3, 12):
        assert why and "Python >= 3.12" in why
    else:
        assert why is None or "Transformer Engine" in why


# ------------------------------------------------------------------------ check_bridge parts


def test_capture_bridge_warnings_all_channels(capsys):
    with br.capture_bridge_warnings() as cap:
        logging.getLogger("megatron.bridge.models.conversion").warning(
            "No mapping found for megatron_param: decoder.layers.1.mlp.router.expert_bias")
        warnings.warn("Can't find model.layers.2.mlp.expert_bias in hf_keys", stacklevel=1)
        print("WARNING: unexpected key model.layers.3.enorm.weight")
        logging.getLogger("x").warning("loading took 3 s")
        logging.getLogger("x").info("No mapping found (info level is ignored)")
    bad = cap.offending()
    assert len(bad) == 3, cap.lines
    assert any("No mapping found" in b for b in bad)
    assert any("Can't find model.layers.2.mlp.expert_bias in hf_keys" in b for b in bad)
    assert "loading took 3 s" in " ".join(cap.lines)
    assert "unexpected key" in capsys.readouterr().out  # still shown in the log


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_compare_state_dicts_on_real_tensors(tiny_hy3_dir: Path):
    before = br.load_state_dict(tiny_hy3_dir)
    after = {k: v.clone() for k, v in before.items()}
    assert br.compare_state_dicts(before, after) == []
    after["model.layers.1.mlp.expert_bias"] = torch.zeros(4)
    after["model.layers.0.mlp.up_proj.weight"] = after["model.layers.0.mlp.up_proj.weight"].float()
    del after["model.layers.3.enorm.weight"]
    problems = br.compare_state_dicts(before, after)
    assert "missing after round trip: model.layers.3.enorm.weight" in problems
    assert any(p.startswith("model.layers.1.mlp.expert_bias: values differ") for p in problems)
    assert any(p.startswith("model.layers.0.mlp.up_proj.weight: torch.bfloat16") for p in problems)


def test_compare_logits():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 8, 50, generator=g)
    ok, msg = br.compare_logits(a, a.clone(), 0.9999)
    assert ok and "top-1 equal at 16/16" in msg
    b = a.clone()
    b[0, 3] = -b[0, 3]  # one position flipped: top-1 differs there
    ok, msg = br.compare_logits(a, b, 0.9999)
    assert not ok and "15/16" in msg
    ok, msg = br.compare_logits(a, a[:, :4], 0.9)
    assert not ok and "shapes differ" in msg


def test_write_report_atomic_and_statuses(tmp_path: Path):
    out = tmp_path / "checks" / "bridge.json"
    results = [ck.CheckResult("a", "pass", "ok"), ck.CheckResult("b", "not run", "why"),
               ck.CheckResult("c", "fail", "bad", [f"p{i}" for i in range(250)])]
    doc = ck.write_report(out, results, {"environment": {"python": "3"}})
    on_disk = json.loads(out.read_text())
    assert on_disk == doc and doc["ok"] is False
    assert doc["counts"] == {"pass": 1, "fail": 1, "not run": 1}
    assert doc["checks"][2]["problem_count"] == 250 and len(doc["checks"][2]["problems"]) == 200
    assert [p.name for p in out.parent.iterdir()] == ["bridge.json"]  # no temp file left
    assert doc["created"].endswith("+00:00")  # hy3rl.timefmt
    with pytest.raises(ValueError, match="bad status"):
        ck.CheckResult("x", "passed", "")


def test_check_bridge_without_gpu_is_not_run(tmp_path: Path):
    out = tmp_path / "bridge.json"
    env = {"python": "3.12.3", "cuda_available": False, "transformer_engine": False}
    doc = br.check_bridge(out, {"seed": 0}, 0.9999, "/models/hy3", 2, env=env)
    assert doc["ok"] is True and doc["counts"]["pass"] == 0
    names = [c["name"] for c in doc["checks"]]
    assert "tiny/roundtrip_tensors" in names and "real_truncated/logits" in names
    assert "mapping_table_agreement" in names
    assert all(c["status"] == "not run" and "no CUDA GPU" in c["details"]
               for c in doc["checks"])


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_check_bridge_where_the_bridge_does_not_import_fails_each_check(tmp_path: Path,
                                                                       monkeypatch):
    """A GPU and Transformer Engine but no importable bridge (here: none installed): the
    tiny Hy3 is built from model.tiny, and every conversion check fails with the error."""
    import dataclasses

    monkeypatch.setattr(br, "import_blocker", lambda: None)
    env = {"python": "3.12.3", "cuda_available": True, "transformer_engine": True}
    tiny = dataclasses.asdict(make_config().model.tiny)
    doc = br.check_bridge(tmp_path / "bridge.json", tiny, 0.9999, None, 0, env=env)
    status = {c["name"]: (c["status"], c["details"]) for c in doc["checks"]}
    assert status["mapping_table_agreement"][0] == "not run"  # no lock given
    assert {s for n, (s, _) in status.items() if n.startswith("tiny/")} == {"fail"}
    assert "conversion raised ModuleNotFoundError" in status["tiny/logits"][1]
    assert doc["ok"] is False and doc["environment"]["bridge_imported"] is True


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_run_in_this_runtime_records_not_run(tmp_path: Path, bridge_repo_factory, capfd):
    """run(): the check runs as `python -m hy3rl.bridge` in the training runtime (here: no
    train.runtime prefix, so this interpreter); without a GPU every check is `not run`."""
    out = tmp_path / "checks" / "bridge.json"
    cfg = make_config()
    br.run(cfg.checks.bridge, cfg.model, cfg.train.runtime, lock=bridge_repo_factory()[2],
           out=out)
    doc = json.loads(out.read_text())
    assert {c["status"] for c in doc["checks"]} == {"not run"}
    assert [c["name"] for c in doc["checks"]][:2] == ["mapping_table_agreement",
                                                     "tiny/roundtrip_tensors"]
    assert not any(c["name"].startswith("real_truncated/") for c in doc["checks"])
    printed = capfd.readouterr().out
    assert "NOT RUN" in printed and "-m hy3rl.bridge --out" in printed
    assert doc["environment"]["python"] and doc["created"].endswith("+00:00")


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")
def test_run_in_another_runtime_through_prefix_and_pythonpath(tmp_path: Path,
                                                              bridge_repo_factory):
    """train.runtime with a prefix and another interpreter (the system python3: no hy3rl,
    no torch): the check runs there, importing this checkout's package via PYTHONPATH."""
    probe = subprocess.run(["/usr/bin/python3", "-c", "import platform, sys; "
                            "print(platform.python_version(), sys.version_info >= (3, 11)); "
                            "import hy3rl"], capture_output=True, text=True)
    version, new_enough = (probe.stdout.split() + ["", ""])[:2]
    if new_enough != "True" or probe.returncode == 0:
        pytest.skip("the system python3 is older than 3.11, or has hy3rl installed")
    out = tmp_path / "bridge.json"
    cfg = make_config(train={"runtime": {"prefix": "env HY3RL_IN_RUNTIME=1",
                                         "python": "/usr/bin/python3"}},
                      checks={"bridge": {"real_layers": 2}},
                      model={"source": str(tmp_path / "hy3")})
    br.run(cfg.checks.bridge, cfg.model, cfg.train.runtime, lock=bridge_repo_factory()[2],
           out=out)
    doc = json.loads(out.read_text())
    env = doc["environment"]
    assert env["python"] == version, env  # ran in that interpreter
    assert "real_truncated/logits" in {c["name"] for c in doc["checks"]}
    assert doc["ok"] and {c["status"] for c in doc["checks"]} == {"not run"}


def test_run_errors_name_the_runtime(tmp_path: Path, bridge_repo_factory):
    """A runtime that does not start, or a check that exits non-zero without a report of
    failed checks, is a BridgeCheckFailed (a StageError: message, exit 1) naming it."""
    from hy3rl.errors import StageError

    lock = bridge_repo_factory()[2]
    cfg = make_config(train={"runtime": {"prefix": "/nonexistent/apptainer exec x"}})
    with pytest.raises(StageError, match="cannot start the training runtime.*/nonexistent"):
        br.run(cfg.checks.bridge, cfg.model, cfg.train.runtime, lock=lock,
               out=tmp_path / "a.json")
    cfg = make_config(train={"runtime": {"prefix": "env", "python": "false"}})
    with pytest.raises(br.BridgeCheckFailed, match="exited 1 in the training runtime"):
        br.run(cfg.checks.bridge, cfg.model, cfg.train.runtime, lock=lock,
               out=tmp_path / "b.json")
    cfg = make_config(train={"runtime": {"prefix": "env 'unclosed"}})
    with pytest.raises(br.BridgeCheckFailed, match="train.runtime.prefix"):
        br.run(cfg.checks.bridge, cfg.model, cfg.train.runtime, lock=lock,
               out=tmp_path / "c.json")


def test_run_fails_on_a_failed_check(tmp_path: Path, bridge_repo_factory, monkeypatch):
    """The check in the runtime writes a report with a failed check and exits 1: run()
    raises naming the failed checks (the report stays for the log and the user)."""
    out = tmp_path / "bridge.json"
    script = tmp_path / "fake_runtime.py"
    script.write_text(
        "import sys\n"
        "from hy3rl.checkpoint import CheckResult, write_report\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "write_report(__import__('pathlib').Path(out), [CheckResult('tiny/logits', 'fail', "
        "'cosine 0.5')], {})\n"
        "sys.exit(1)\n")
    # the runtime's python is a wrapper that runs the fake check instead of hy3rl.bridge
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {script} \"$@\"\n")
    wrapper.chmod(0o755)
    cfg = make_config(train={"runtime": {"prefix": "", "python": str(wrapper)}})
    with pytest.raises(br.BridgeCheckFailed, match=r"1 check\(s\) failed \(tiny/logits\)"):
        br.run(cfg.checks.bridge, cfg.model, cfg.train.runtime,
               lock=bridge_repo_factory()[2], out=out)
    assert json.loads(out.read_text())["ok"] is False


def _stand_in(damage: str | None = None):
    """CPU stand-in for the Megatron conversion (test double): writes the HF files back
    (optionally damaged), returns HF logits as 'Megatron' logits and the loaded biases."""

    def convert(model_dir: Path, out_dir: Path, tokens):
        from transformers import AutoModelForCausalLM

        shutil.copytree(model_dir, out_dir)
        state = br.load_state_dict(model_dir)
        n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        biases = {}
        for k, v in state.items():
            if k.endswith("mlp.expert_bias"):
                layer = int(k.split(".")[2])
                mg = ("mtp.layers.0.mtp_model_layer.mlp.router.expert_bias" if layer == n
                      else f"decoder.layers.{layer}.mlp.router.expert_bias")
                biases[mg] = v.float()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float()
        if damage == "bias":
            biases["decoder.layers.2.mlp.router.expert_bias"] = torch.zeros(4)
            logging.getLogger("megatron.bridge").warning(
                "No mapping found for megatron_param: decoder.layers.2.mlp.router.expert_bias")
        if damage == "tensor":
            rewrite_checkpoint(out_dir, lambda t: {
                **t, "model.layers.1.self_attn.o_proj.weight":
                t["model.layers.1.self_attn.o_proj.weight"] * 2})
        if damage == "logits":
            logits = torch.flip(logits, dims=[-1])
        return {"megatron_logits": logits, "expert_bias": biases}

    return convert


def test_check_one_model_with_cpu_stand_in(tiny_hy3_dir: Path, tmp_path: Path):
    res = {r.name: r for r in br.check_one_model("tiny", tiny_hy3_dir, tmp_path / "a", 0.9999,
                                                 convert=_stand_in())}
    assert {r.status for r in res.values()} == {"pass"}, res
    assert "3 expert biases equal" in res["tiny/expert_bias"].details

    res = {r.name: r for r in br.check_one_model("tiny", tiny_hy3_dir, tmp_path / "b", 0.9999,
                                                 convert=_stand_in("bias"))}
    assert res["tiny/expert_bias"].status == "fail"
    assert "model.layers.2.mlp.expert_bias: Megatron value differs (zeros: True)" in \
        res["tiny/expert_bias"].problems
    assert res["tiny/bridge_warnings"].status == "fail"
    assert res["tiny/roundtrip_tensors"].status == "pass"

    res = {r.name: r for r in br.check_one_model("tiny", tiny_hy3_dir, tmp_path / "c", 0.9999,
                                                 convert=_stand_in("tensor"))}
    assert res["tiny/roundtrip_tensors"].status == "fail"
    assert res["tiny/roundtrip_tensors"].problems[0].startswith(
        "model.layers.1.self_attn.o_proj.weight: values differ")

    res = {r.name: r for r in br.check_one_model("tiny", tiny_hy3_dir, tmp_path / "d", 0.9999,
                                                 convert=_stand_in("logits"))}
    assert res["tiny/logits"].status == "fail"

    def boom(*_a):
        raise RuntimeError("TE kernel missing")

    res = br.check_one_model("tiny", tiny_hy3_dir, tmp_path / "e", 0.9999, convert=boom)
    assert {r.status for r in res} == {"fail"}
    assert "RuntimeError: TE kernel missing" in res[0].details


def test_truncate_checkpoint(tiny_hy3_dir: Path, tmp_path: Path):
    out = br.truncate_checkpoint(tiny_hy3_dir, tmp_path / "t", 2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["num_nextn_predict_layers"] == 0
    assert cfg["mlp_layer_types"] == ["dense", "sparse"]
    names = set(br.load_state_dict(out))
    assert "model.layers.1.mlp.expert_bias" in names
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.")) for n in names)
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= names


# A stand-in for the Megatron-Bridge package (test double: the real one needs Transformer
# Engine and Python 3.12): just enough of megatron.bridge.models.conversion for a
# bridge module to import, so the `dump-registry` child process and the agreement check run.
STUB_MODULES = {
    "megatron/__init__.py": "",
    "megatron/bridge/__init__.py": "",
    "megatron/bridge/models/__init__.py": "",
    "megatron/bridge/models/hy_v3/__init__.py": "",
    "megatron/bridge/models/conversion/__init__.py": "",
    "megatron/bridge/models/conversion/mapping_registry.py": (
        "class MegatronMappingRegistry:\n"
        "    def __init__(self, *mappings):\n"
        "        self.mappings = list(mappings)\n"
    ),
    "megatron/bridge/models/conversion/model_bridge.py": (
        "class MegatronModelBridge:\n    hf_config = None\n"
    ),
    "megatron/bridge/models/conversion/param_mapping.py": (
        "class AutoMapping:\n"
        "    def __init__(self, megatron_param, hf_param):\n"
        "        self.megatron_param, self.hf_param = megatron_param, hf_param\n"
        "class QKVMapping:\n"
        "    def __init__(self, megatron_param, q, k, v):\n"
        "        self.megatron_param, self.hf_param = megatron_param, {'q': q, 'k': k, 'v': v}\n"
        "class GatedMLPMapping:\n"
        "    def __init__(self, megatron_param, gate, up):\n"
        "        self.megatron_param, self.hf_param = megatron_param, {'gate': gate, 'up': up}\n"
    ),
}


@pytest.mark.parametrize("extra, status", [
    ("", "pass"),
    # the imported bridge prints while building its table: the JSON line is still found
    ('        print("[megatron] building HYV3 mappings {not json")\n', "pass"),
    ('        mappings.append(AutoMapping(megatron_param="x.*", hf_param="model.odd.*"))\n',
     "fail"),
])
@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_import_agreement_with_stand_in_package(tiny_hy3_dir, bridge_repo_factory,
                                                monkeypatch, extra, status):
    """The parsed table comes from the pinned commit; the import reads the clone's files.
    A clone edited after the pin (extra mapping in the working tree) must disagree."""
    clone, head, lock = bridge_repo_factory(name=f"stub-{status}")
    for rel, content in STUB_MODULES.items():
        path = clone / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(content)
    edited = FAKE_BRIDGE.replace("        return MegatronMappingRegistry(*mappings)\n",
                                 extra + "        return MegatronMappingRegistry(*mappings)\n")
    (clone / bs.BRIDGE_RELPATH).write_text(edited)
    monkeypatch.setattr(bs, "import_blocker", lambda: None)
    source, why = bs.bridge_source_from_lock(lock)
    results, _ = ck.check_checkpoint(tiny_hy3_dir, source, why, try_import=True)
    r = {x.name: x for x in results}["bridge_mapping_import"]
    assert r.status == status, r
    if status == "fail":
        assert r.problems == ["imported mapping x.* -> model.odd.*: HF pattern not in the "
                              "parsed table"]
    else:
        assert "agrees with the parsed table (41 mappings)" in r.details


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_import_failure_is_not_run_with_the_error(tiny_hy3_dir, bridge_repo_factory,
                                                  monkeypatch):
    _, _, lock = bridge_repo_factory(name="no-package")  # the bridge file only, no package
    monkeypatch.setattr(bs, "import_blocker", lambda: None)
    source, why = bs.bridge_source_from_lock(lock)
    results, _ = ck.check_checkpoint(tiny_hy3_dir, source, why, try_import=True)
    r = {x.name: x for x in results}["bridge_mapping_import"]
    assert r.status == "not run"
    assert "the pinned bridge did not import" in r.details and "megatron" in r.details


@pytest.mark.parametrize("extra, status", [
    ("", "pass"),
    ('        mappings.append(AutoMapping(megatron_param="x.*", hf_param="model.odd.*"))\n',
     "fail"),
])
@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_check_bridge_table_agreement_with_stand_in_package(tiny_hy3_dir, bridge_repo_factory,
                                                            monkeypatch, extra, status):
    """check_bridge's own agreement check (the GPU job is where the pinned bridge imports):
    the table parsed from the pinned commit against the imported mapping_registry()."""
    clone, _, lock = bridge_repo_factory(name=f"agree-{status}")
    for rel, content in STUB_MODULES.items():
        path = clone / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(content)
    (clone / bs.BRIDGE_RELPATH).write_text(FAKE_BRIDGE.replace(
        "        return MegatronMappingRegistry(*mappings)\n",
        extra + "        return MegatronMappingRegistry(*mappings)\n"))
    monkeypatch.setattr(bs, "import_blocker", lambda: None)
    r = br.check_table_agreement(lock, tiny_hy3_dir / "config.json")
    assert r.name == "mapping_table_agreement" and r.status == status, r
    if status == "fail":
        assert r.problems == ["imported mapping x.* -> model.odd.*: HF pattern not in the "
                              "parsed table"]
    assert br.check_table_agreement(None, tiny_hy3_dir / "config.json").status == "not run"
    _, _, moved = bridge_repo_factory(text=None, name=f"moved-{status}")
    r = br.check_table_agreement(moved, tiny_hy3_dir / "config.json")
    assert r.status == "not run" and "not found at" in r.details
