"""Lint in the suite: ruff over the Python, snakefmt and `snakemake --lint` over the
workflow (one test per Snakefile / rules file, so a failure names the file and its owner
knows), and the README's two front-door commands against install.sh, the profile and
.ci/run."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKFLOW_FILES = ["Snakefile", *sorted(p.relative_to(REPO).as_posix()
                                       for p in (REPO / "rules").glob("*.smk"))]


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (./install.sh --test installs it)")
    return found


def test_ruff_clean():
    dirs = [d for d in ("scripts", "tests", "benchmarks") if (REPO / d).is_dir()]
    proc = subprocess.run([tool("ruff"), "check", "--output-format", "concise", *dirs],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff check {' '.join(dirs)}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("path", WORKFLOW_FILES)
def test_snakefmt_clean(path: str):
    proc = subprocess.run([tool("snakefmt"), "--diff", path], cwd=REPO, capture_output=True,
                          text=True)
    diff = [ln for ln in proc.stdout.splitlines() if ln[:1] in "+-" and ln[:3] not in "+++---"]
    assert proc.returncode == 0 and not diff, (
        f"snakefmt would reformat {path} (run `.venv/bin/snakefmt {path}`):\n"
        + proc.stdout + proc.stderr
    )


_HEADER = re.compile(
    r"^Lints for (?:snakefile (?P<file>\S+)|rule (?P<rule>\S+) \(line \d+, (?P<rfile>\S+)\)):$"
)


def parse_lints(text: str) -> dict[str, list[str]]:
    """`snakemake --lint` text output -> {repo-relative file: ["rule X: title", ...]}.
    (Snakemake 9.27's CLI ignores `--lint json`; the text format is stable.)"""
    found: dict[str, list[str]] = {}
    where, what = None, ""
    for line in text.splitlines():
        m = _HEADER.match(line.strip())
        if m:
            path = Path(m["file"] or m["rfile"])
            where = (path.relative_to(REPO) if path.is_absolute() else path).as_posix()
            what = f"rule {m['rule']}: " if m["rule"] else ""
            found.setdefault(where, [])
        elif line.startswith("    * ") and where is not None:
            found[where].append(what + line[6:].rstrip(":"))
    return found


@pytest.fixture(scope="module")
def snakemake_lints(tmp_path_factory) -> dict[str, list[str]]:
    work = tmp_path_factory.mktemp("lint")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint", "--snakefile", str(REPO / "Snakefile"),
         "--directory", str(work), "--configfile", str(REPO / "config/config.yaml")],
        capture_output=True, text=True, timeout=300,
    )
    text = proc.stdout + proc.stderr
    lints = parse_lints(text)
    if proc.returncode != 0 and not lints:
        pytest.fail(f"snakemake --lint failed without lints (workflow does not load?):\n{text}")
    if proc.returncode == 0:
        assert "good condition" in text or not lints, text
    return lints


def test_lint_parser_reads_snakemake_text():
    text = (
        f"Lints for snakefile {REPO}/rules/common.smk:\n"
        "    * Mixed rules and functions in same snakefile.:\n      body\n"
        f"Lints for rule deps (line 5, {REPO}/rules/deps.smk):\n"
        "    * Shell command directly uses variable PY from outside of the rule:\n"
        "      body\n"
    )
    assert parse_lints(text) == {
        "rules/common.smk": ["Mixed rules and functions in same snakefile."],
        "rules/deps.smk": ["rule deps: Shell command directly uses variable PY from outside "
                           "of the rule"],
    }


@pytest.mark.parametrize("path", WORKFLOW_FILES)
def test_snakemake_lint_clean(snakemake_lints: dict[str, list[str]], path: str):
    unknown = sorted(set(snakemake_lints) - set(WORKFLOW_FILES))
    assert not unknown or path != "Snakefile", f"lints in files outside the workflow: {unknown}"
    found = snakemake_lints.get(path, [])
    assert not found, (
        f"`snakemake --lint` flags {path}:\n  - " + "\n  - ".join(found)
        + "\n(details: .venv/bin/snakemake --lint --configfile config/config.yaml)"
    )


# ----------------------------------------------------------------------- README front door


def readme_commands() -> list[str]:
    readme = REPO / "README.md"
    assert readme.is_file(), "README.md is missing"
    text = readme.read_text()
    m = re.match(r"\s*(?:#[^\n]*\n\s*)?```[a-z]*\n(?P<body>.*?)\n```", text, re.S)
    assert m, "README.md must start with a fenced block holding the two commands"
    cmds = [ln.strip() for ln in m["body"].splitlines()
            if ln.strip() and not ln.strip().startswith("#")]
    assert len(cmds) == 2, f"README.md's first block must hold exactly two commands: {cmds}"
    return cmds


def check_command_exists(cmd: str) -> None:
    """Every program of an `a && b` chain exists: ./x in the repository (executable),
    .venv/bin/x installed by install.sh (present once it ran); options that name paths exist."""
    for part in cmd.split("&&"):
        argv = shlex.split(part)
        prog = argv[0]
        if prog.startswith("./"):
            assert (REPO / prog).is_file() and (REPO / prog).stat().st_mode & 0o111, (
                f"{prog} (README command {cmd!r}) is missing or not executable")
            for flag in argv[1:]:
                if flag.startswith("--"):
                    assert f'"{flag}"' in (REPO / prog).read_text(), (
                        f"{prog} does not handle {flag} (README command {cmd!r})")
        elif prog.startswith(".venv/bin/"):
            assert (REPO / prog).exists() or (BIN / Path(prog).name).exists(), (
                f"{prog} (README command {cmd!r}) is not installed by ./install.sh")
        else:
            pytest.fail(f"README command {cmd!r} runs {prog!r}: use ./ or .venv/bin/ programs")
        if "--profile" in argv:
            profile = REPO / argv[argv.index("--profile") + 1]
            assert (profile / "config.yaml").is_file(), f"profile {profile} has no config.yaml"


def test_readme_starts_with_two_working_commands():
    run_main, run_tests = readme_commands()
    for cmd in (run_main, run_tests):
        check_command_exists(cmd)
    assert "snakemake" in run_main and "--test" not in run_main, run_main
    assert "pytest" in run_tests and "--test" in run_tests, run_tests


def test_ci_runs_exactly_the_second_command():
    ci = REPO / ".ci/run"
    assert ci.is_file() and ci.stat().st_mode & 0o111, ".ci/run is missing or not executable"
    lines = [ln.strip() for ln in ci.read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    setup = re.compile(r"^(set -[euxo pipefail]+|cd .+)$")
    commands = [ln for ln in lines if not setup.match(ln)]
    assert commands == [readme_commands()[1]], (
        f".ci/run must run exactly README's second command; it runs {commands}")


@pytest.mark.parametrize("cmd, error", [
    ("./no-such-install.sh && .venv/bin/pytest", "missing or not executable"),
    ("./install.sh --no-such-flag && .venv/bin/pytest", "does not handle --no-such-flag"),
    ("./install.sh && .venv/bin/no-such-tool", "not installed"),
    ("./install.sh && .venv/bin/snakemake --profile profiles/nowhere", "has no config.yaml"),
    ("pip install . && pytest", "use ./ or .venv/bin/"),
])
def test_readme_command_check_catches_broken_commands(cmd: str, error: str):
    with pytest.raises((AssertionError, pytest.fail.Exception), match=error):
        check_command_exists(cmd)
