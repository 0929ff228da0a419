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


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
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


# `snakemake --lint` advice the workflow declines on purpose: title -> why.
DECLINED_LINTS = {
    "Specify a conda environment or container for each rule.":
        "jobs run in ./.venv, installed from the hashed lock (install.sh, envs/); a directive "
        "that no test proves is refused by test_no_environment_directive_without_a_test",
}


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("path", WORKFLOW_FILES)
def test_snakemake_lint_clean(snakemake_lints: dict[str, list[str]], path: str):
    unknown = sorted(set(snakemake_lints) - set(WORKFLOW_FILES))
    assert not unknown or path != "Snakefile", f"lints in files outside the workflow: {unknown}"
    found = [lint for lint in snakemake_lints.get(path, [])
             if re.sub(r"^rule \w+: ", "", lint) not in DECLINED_LINTS]
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


# ----------------------------------------------------------------------- rules' shape

# Rules that only collect targets: no job runs, so no log, threads, resources or script.
TARGET_RULES = {"all", "release"}
# rule -> why it may run something other than its `scripts/adapters/<rule>.py` adapter.
NOT_ADAPTED: dict[str, str] = {}
# rule -> "tests/test_x.py::test_name" that proves its `conda:`/`container:` takes effect.
# A directive that no test exercises is decoration (shared/docs/style.md, item 4).
PROVEN_ENVIRONMENTS: dict[str, str] = {}

_RULE = re.compile(r"^(?P<indent>[ \t]*)(?:rule|checkpoint)\s+(?P<name>\w+)\s*:\s*(?:#.*)?$")
_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]+)(?P<key>\w+)\s*:(?P<rest>.*)$")


def rule_directives(text: str) -> dict[str, dict[str, str]]:
    """A rules file -> {rule: {directive: its text}}, for every `rule NAME:` at any
    indentation (rules under `if ...:` included). A directive is a `key:` line at the rule
    body's first indentation; its text is the rest of that line and the lines under it."""
    rules: dict[str, dict[str, str]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _RULE.match(lines[i])
        i += 1
        if not m:
            continue
        outer, body_indent = len(m["indent"].expandtabs()), None
        directives: dict[str, str] = {}
        key = None
        while i < len(lines):
            line = lines[i]
            width = len(line) - len(line.lstrip())
            if line.strip() and width <= outer:
                break
            i += 1
            if not line.strip() or line.strip().startswith("#"):
                continue
            body_indent = width if body_indent is None else body_indent
            d = _DIRECTIVE.match(line)
            if d and width == body_indent:
                key = d["key"]
                directives[key] = d["rest"].strip()
            elif key is not None:
                directives[key] = (directives[key] + " " + line.strip()).strip()
        rules[m["name"]] = directives
    return rules


def workflow_rules() -> dict[str, tuple[str, dict[str, str]]]:
    found: dict[str, tuple[str, dict[str, str]]] = {}
    for path in WORKFLOW_FILES:
        for name, directives in rule_directives((REPO / path).read_text()).items():
            assert name not in found, f"rule {name} is defined in {found[name][0]} and {path}"
            found[name] = (path, directives)
    return found


def test_rule_parser_reads_nested_rules():
    text = (
        "localrules:\n    deps,\n\n\nrule deps:\n    output:\n        lock=LAYOUT.deps_lock,\n"
        "    log:\n        LAYOUT.log('deps'),\n    threads: 1\n    resources:\n"
        "        mem_mb=1000,\n    # a comment\n    script:\n"
        "        \"../scripts/adapters/deps.py\"\n\n\nif gpu_enabled():\n\n"
        "    rule train:\n        conda:\n            \"../envs/x.yaml\"\n        shell:\n"
        "            \"true\"\n\n\ndef after():\n    return 1\n"
    )
    assert rule_directives(text) == {
        "deps": {"output": "lock=LAYOUT.deps_lock,", "log": "LAYOUT.log('deps'),",
                 "threads": "1", "resources": "mem_mb=1000,",
                 "script": '"../scripts/adapters/deps.py"'},
        "train": {"conda": '"../envs/x.yaml"', "shell": '"true"'},
    }


def test_every_rule_found():
    rules = workflow_rules()
    assert {"deps", "data", "train", "report", "all"} <= set(rules), sorted(rules)
    stale = (set(NOT_ADAPTED) | set(PROVEN_ENVIRONMENTS)) - set(rules)
    assert not stale, f"exemptions name rules that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize("path", WORKFLOW_FILES)
def test_no_environment_directive_without_a_test(path: str):
    bad = []
    for name, directives in rule_directives((REPO / path).read_text()).items():
        for key in ("conda", "container", "singularity"):
            if key in directives and name not in PROVEN_ENVIRONMENTS:
                bad.append(f"rule {name}: {key}: {directives[key]}")
    assert not bad, (
        f"{path} declares environments that no test proves (remove them, or add a test that "
        "runs the rule in it and name it in PROVEN_ENVIRONMENTS):\n  " + "\n  ".join(bad))
    for name, test in PROVEN_ENVIRONMENTS.items():
        file, _, func = test.partition("::")
        assert f"def {func}(" in (REPO / file).read_text(), f"{name}: {test} does not exist"


@pytest.mark.parametrize("path", WORKFLOW_FILES)
def test_rules_declare_log_threads_resources(path: str):
    bad = []
    for name, directives in rule_directives((REPO / path).read_text()).items():
        if name in TARGET_RULES:
            continue
        missing = [k for k in ("log", "threads", "resources") if k not in directives]
        if missing:
            bad.append(f"rule {name}: no {', '.join(missing)}")
    assert not bad, f"{path}:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("path", WORKFLOW_FILES)
def test_rules_run_their_adapter(path: str):
    """Each rule runs `script: "../scripts/adapters/<rule>.py"` (a thin adapter calling the
    stage's run(...)): no shell command lines, no `run:` blocks, no JSON blobs."""
    bad = []
    for name, directives in rule_directives((REPO / path).read_text()).items():
        if name in TARGET_RULES or name in NOT_ADAPTED:
            continue
        runs = [k for k in ("shell", "run", "wrapper", "notebook", "cwl") if k in directives]
        want = f'"../scripts/adapters/{name}.py"'
        if runs or directives.get("script") != want:
            bad.append(f"rule {name}: has {runs or directives.get('script')}, wants script: "
                       f"{want}")
        elif not (REPO / "scripts/adapters" / f"{name}.py").is_file():
            bad.append(f"rule {name}: scripts/adapters/{name}.py is missing")
    assert not bad, f"{path}:\n  " + "\n  ".join(bad)


# ----------------------------------------------------------------------- environment locks

LOCKS = {  # lock -> the pyproject groups it must pin
    "envs/requirements.lock": ("dependencies",),
    "envs/requirements-test.lock": ("dependencies", "test"),
    "envs/build.lock": ("build-system",),
}
_LOCK_ENTRY = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)(?P<hashes>(?:\s*\\\n"
    r"\s+--hash=sha256:[0-9a-f]{64})*)", re.M)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, tuple[str, int]]:
    """A pip-compile lock -> {normalized name: (version, number of sha256 hashes)}."""
    text = path.read_text()
    entries = {_norm(m["name"]): (m["version"], m["hashes"].count("--hash="))
               for m in _LOCK_ENTRY.finditer(text)}
    reqs = [ln for ln in text.splitlines() if ln and not ln[0].isspace() and ln[0] != "#"]
    assert len(reqs) == len(entries), f"{path}: lines that are not `name==version` pins: " + \
        str([ln for ln in reqs if not _LOCK_ENTRY.match(ln)])
    return entries


def pyproject_pins(group: str) -> dict[str, str]:
    import tomllib

    from packaging.requirements import Requirement

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = {
        "dependencies": data["project"]["dependencies"],
        "build-system": data["build-system"]["requires"],
    }.get(group) or data["project"]["optional-dependencies"][group]
    return {_norm(r.name): str(r.specifier) for r in map(Requirement, reqs)}


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_lock_matches_pyproject(lock: str):
    """Every pyproject pin appears in the lock at that version (a local label such as
    torch's `+cpu` is the build, not another version), and every lock entry carries sha256
    hashes, so `pip install --require-hashes` installs exactly it. Refresh: envs/lock.sh."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    path = REPO / lock
    assert path.is_file(), f"{lock} is missing (envs/lock.sh makes it)"
    entries = read_lock(path)
    bad = [f"{name}: no hash" for name, (_, n) in entries.items() if n == 0]
    for group in LOCKS[lock]:
        for name, spec in pyproject_pins(group).items():
            if name not in entries:
                bad.append(f"{name}{spec} ({group}) is not in the lock")
                continue
            version = Version(entries[name][0])
            exact = spec.startswith("==") and Version(spec[2:]) == Version(version.public)
            if group != "build-system" and not exact:
                bad.append(f"{name}: pyproject {spec} ({group}), lock =={version}")
            elif version not in SpecifierSet(spec):
                bad.append(f"{name}: lock =={version} does not satisfy pyproject {spec}")
    assert not bad, (f"{lock} is out of sync with pyproject.toml (run envs/lock.sh):\n  "
                     + "\n  ".join(bad))


def test_locks_agree_with_each_other():
    main = read_lock(REPO / "envs/requirements.lock")
    for other in ("envs/requirements-test.lock", "envs/build.lock"):
        entries = read_lock(REPO / other)
        differ = {n: (main[n][0], v) for n, (v, _) in entries.items()
                  if n in main and main[n][0] != v}
        assert not differ, f"{other} pins differently from requirements.lock: {differ}"
        if other.endswith("test.lock"):
            missing = sorted(set(main) - set(entries))
            assert not missing, f"{other} lacks pins of requirements.lock: {missing}"


def test_locks_hold_the_cpu_torch_only():
    """torch is the CPU wheel (its one hash is that file's); no CUDA runtime rides along."""
    for lock in LOCKS:
        entries = read_lock(REPO / lock)
        cuda = sorted(n for n in entries if n.startswith("nvidia-") or n == "triton")
        assert not cuda, f"{lock} pulls CUDA packages: {cuda}"
        if "torch" in entries:
            version, hashes = entries["torch"]
            assert version.endswith("+cpu") and hashes == 1, (lock, version, hashes)


def test_install_uses_the_locks():
    """install.sh installs only hash-checked pins, then the package without dependencies;
    envs/ holds nothing that nothing uses (no decorative environment file)."""
    install = (REPO / "install.sh").read_text()
    for lock in LOCKS:
        assert lock in install, f"install.sh does not install {lock}"
    installs = [ln for ln in install.splitlines() if "pip install" in ln or "PIP[@]" in ln]
    for line in installs:
        assert ("--require-hashes" in line or "PIP[@]" in line
                or "--no-deps" in line and "-e ." in line), f"unhashed install: {line}"
    used = install + (REPO / "envs/lock.sh").read_text()
    unused = [p.name for p in (REPO / "envs").iterdir()
              if p.name != "lock.sh" and f"envs/{p.name}" not in used]
    assert not unused, f"envs/ holds files that install.sh and envs/lock.sh never use: {unused}"


def test_console_script_runs():
    exe = BIN / "hy3rl"
    assert exe.exists(), f"{exe} missing: pyproject's [project.scripts] hy3rl (./install.sh)"
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: hy3rl" in proc.stdout, proc.stdout + proc.stderr


def test_install_brings_what_verl_checks_import():
    """Preflight runs verl's own config validation (hy3rl.verl_checks) with the pinned verl
    on the path: its pure-Python requirements come from the workflow's install (pinned in
    pyproject.toml, hashed in the locks), never a silent `not run`."""
    import importlib.util

    for module in ("tensordict", "codetiming", "hydra", "omegaconf", "huggingface_hub"):
        assert importlib.util.find_spec(module) is not None, f"{module} is not installed"
    pins = (REPO / "pyproject.toml").read_text()
    for pin in ("tensordict==", "codetiming==", "huggingface_hub=="):
        assert pin in pins, pin
