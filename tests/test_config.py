"""The config schema: defaults filled, every error named by its key path, both shipped
configs valid, and several config files merging like Snakemake's --configfile."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hy3rl import config as cfgmod

REPO = Path(__file__).resolve().parents[1]


def test_default_and_paper_configs_validate():
    default = cfgmod.load(REPO / "config/config.yaml")
    repos = default["deps"]["repos"]
    assert repos["verl"]["commit"] == "220e9039902c6db56860e2afd659803dc34ec005"
    assert repos["megatron_bridge"]["commit"] == "df0852cf94c674de07f9f7ef933c484de8aca505"
    assert repos["transfer_queue"]["commit"] == "35bcf198ac087f0a0e41a69a897f48929c313d22"
    assert repos["transfer_queue"]["url"].endswith("Ascend/TransferQueue.git")  # tag v0.1.8
    assert default["model"]["path"] == "resources/tiny-hy3" and default["cluster"]["gpu"] is False
    paper = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
    assert paper["cluster"]["nodes"] == 16 and paper["cluster"]["gpus_per_node"] == 8


def test_errors_name_every_key_path(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "run": {"nme": "x"},
        "deps": {"repos": {"verl": {"url": "u", "commit": "220e903"}}},
    }))
    with pytest.raises(cfgmod.ConfigError) as err:
        cfgmod.load(REPO / "config/config.yaml", bad)
    msg = str(err.value)
    assert "run.nme" in msg
    assert "deps.repos.verl.commit" in msg and "220e903" in msg


def test_every_schema_key_has_description_and_default():
    def walk(node, path):
        if isinstance(node, dict):
            for name, sub in (node.get("properties") or {}).items():
                if "$ref" in sub:
                    sub = {**_ref(sub), **sub}
                assert "description" in sub, f"{path}.{name} has no description"
                # A required key inside a $defs type gets its default from its parent's default.
                if name not in node.get("required", []):
                    assert "default" in sub, f"{path}.{name} has no default"
                walk(sub, f"{path}.{name}")
            for sub in (node.get("$defs") or {}).values():
                walk(sub, path)

    def _ref(sub):
        target = sub["$ref"]
        if target.startswith("#"):
            return {}
        return yaml.safe_load((REPO / "config/schema" / target).read_text())

    for f in sorted((REPO / "config/schema").glob("*.schema.yaml")):
        walk(yaml.safe_load(f.read_text()), f.stem.split(".")[0])


def test_snakemake_stops_before_any_job_naming_the_key(tmp_path: Path):
    """A misspelled key and a bad value in a second --configfile: the real Snakemake run
    (not a dry run) stops at startup, names both key paths, and runs no job."""
    from fixtures.common import run_snakemake

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"run": {"name": "my run!"},
                                   "data": {"train": {"dedupe": True}}}))
    work = tmp_path / "work"
    work.mkdir()
    proc = run_snakemake(["--configfile", str(REPO / "config/config.yaml"), str(bad),
                          "--cores", "1"], work, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "run.name" in out and "my run!" in out, out
    assert "data.train" in out and "dedupe" in out, out
    assert not (work / "results").exists() and not (work / "resources").exists()
    assert "deps" not in {p.name for p in work.iterdir()}
