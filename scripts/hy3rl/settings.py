"""Typed configuration sections, built from the validated config.

The schema (``config/schema/``) is the single source of defaults: these dataclasses declare
names and types only, never a default. ``Config.from_dict`` validates (filling the schema's
defaults in), then builds one frozen dataclass per section, so stage code reads
``cfg.train.checkpoint_keep`` instead of ``config["train"].get("checkpoint_keep", 2)``.
``tests/test_config.py`` checks that every schema key has exactly one field here and back.

Free-form mappings (``train.env``, ``train.verl_overrides``) stay plain ``dict``s.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hy3rl.config import ConfigError, config_hash, load, validate


@dataclass(frozen=True)
class Run:
    name: str
    results_root: str


@dataclass(frozen=True)
class Repo:
    url: str
    commit: str


@dataclass(frozen=True)
class Repos:
    verl: Repo
    megatron_bridge: Repo
    transfer_queue: Repo

    def items(self) -> list[tuple[str, Repo]]:
        """(name, repo) in the schema's order: verl, megatron_bridge, transfer_queue."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


@dataclass(frozen=True)
class Deps:
    dir: str
    repos: Repos
    allow_local_changes: bool


@dataclass(frozen=True)
class Convert:
    question: str
    answer: str
    id: str | None
    data_source: str
    ability: str
    style: str
    template: str


@dataclass(frozen=True)
class DataSource:
    source: str
    revision: str | None
    dedup: bool
    limit: int | None
    seed: int
    convert: Convert | None


@dataclass(frozen=True)
class ValSource(DataSource):
    n: int | None


@dataclass(frozen=True)
class HeldoutSource:
    name: str
    source: str | None
    revision: str | None
    dedup: bool
    limit: int | None
    seed: int
    convert: Convert | None
    from_train: bool
    n: int | None

    def __post_init__(self) -> None:
        if self.from_train and self.source is not None:
            raise ConfigError("data.heldout: from_train carves the set out of data.train; "
                              f"source must be null (is {self.source!r})")
        if self.from_train and self.limit is None:
            raise ConfigError("data.heldout.limit: from_train needs the number of prompts "
                              "to carve out of data.train")
        if not self.from_train and self.source is None:
            raise ConfigError("data.heldout.source: set a source, or from_train: true")


@dataclass(frozen=True)
class Data:
    max_prompt_length: int
    train: DataSource
    val: ValSource
    heldout: HeldoutSource | None


@dataclass(frozen=True)
class TinyModel:
    seed: int
    num_hidden_layers: int
    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_shards: int


@dataclass(frozen=True)
class Model:
    source: str
    revision: str | None
    dir: str
    tiny: TinyModel

    def __post_init__(self) -> None:
        if self.is_local:
            return
        where = f"model.source {self.source!r} is a hub repository id"
        if not self.dir or not Path(self.dir).is_absolute():
            raise ConfigError(f"model.dir: {self.dir!r} must be an absolute directory on shared "
                              f"storage ({where}: it is downloaded there); or set "
                              "model.source to a local checkpoint directory")
        from hy3rl.config import PLACEHOLDER
        from hy3rl.hub import revision_problem

        # A CHANGE_ME placeholder is refused by key, with the others, by refuse_placeholders.
        if PLACEHOLDER not in (self.revision or "") and (
                problem := revision_problem(self.revision)):
            raise ConfigError(f"model.revision: {problem} ({where})")

    @property
    def is_local(self) -> bool:
        """``source`` is a local directory (hy3rl.hub.is_local_source), not a hub repo id."""
        from hy3rl.hub import is_local_source

        return is_local_source(self.source)

    @property
    def path(self) -> str:
        """The checkpoint directory every stage reads: ``source`` itself for a local
        directory (as written, ``~`` expanded), ``dir`` for a hub repository (where rule
        ``model`` downloads it). Not a config key."""
        return os.path.expanduser(self.source) if self.is_local else self.dir


@dataclass(frozen=True)
class CheckpointCheck:
    sha256: bool
    threads: int
    runtime_min: int


@dataclass(frozen=True)
class BridgeCheck:
    real_layers: int
    logits_cosine_min: float
    cpus: int
    mem_mb: int
    runtime_min: int


@dataclass(frozen=True)
class Checks:
    checkpoint: CheckpointCheck
    bridge: BridgeCheck


@dataclass(frozen=True)
class Cluster:
    gpu: bool
    nodes: int
    gpus_per_node: int
    gpu_type: str
    gpu_memory_gb: float
    cpus_per_node: int
    mem_mb_per_node: int
    constraint: str
    train_time_min: int


@dataclass(frozen=True)
class Estimate:
    active_params_b: float
    gpu_tflops: float
    train_mfu: float
    rollout_mfu: float
    mean_response_fraction: float
    starts: int


@dataclass(frozen=True)
class Preflight:
    waive: list[str]
    model_bytes: int
    estimate: Estimate


@dataclass(frozen=True)
class Algorithm:
    adv_estimator: str
    loss_mode: str


@dataclass(frozen=True)
class RewardFunction:
    path: str
    name: str


@dataclass(frozen=True)
class Runtime:
    prefix: str
    python: str


@dataclass(frozen=True)
class TrainCpu:
    enable: bool
    ranks: int
    ray_cpus: int


@dataclass(frozen=True)
class Ray:
    port_base: int
    port_span: int
    worker_ports: int
    head_timeout_s: float
    register_timeout_s: float
    worker_start_retries: int
    stop_grace_s: float
    temp_root: str
    node_setup: str
    dashboard_timeout_s: float
    dashboard_outage_s: float


@dataclass(frozen=True)
class Watchdog:
    stall_min: float | None
    stall_factor: float
    stall_floor_min: float
    stall_cap_min: float
    startup_min: float
    startup_floor_min: float
    first_step_min: float
    validation_min: float | None
    save_min: float | None
    storage_mb_s: float
    first_byte_min: float
    load_quiet_min: float
    node_report_s: float
    shutdown_min: float
    poll_s: float
    silence_min: float


@dataclass(frozen=True)
class HealthNonfinite:
    action: str
    when: str  # at_once | next_save: when a stop ends the trainer
    metrics: list[str]


@dataclass(frozen=True)
class HealthAbove:
    """A metric above ``max`` for ``steps`` consecutive logged steps (drift, clip ratio)."""

    action: str
    when: str  # at_once | next_save: when a stop ends the trainer
    metric: str
    max: float
    steps: int


@dataclass(frozen=True)
class HealthEntropy:
    action: str
    when: str  # at_once | next_save: when a stop ends the trainer
    metric: str
    floor: float | None
    steps: int
    max_fall: float | None
    window: int
    max_rise: float | None

    def __post_init__(self) -> None:
        if self.action != "ignore" and self.floor is None and self.max_fall is None \
                and self.max_rise is None:
            raise ConfigError("train.health.entropy: floor, max_fall and max_rise are all "
                              f"null, so the rule ({self.action}) would watch nothing: set "
                              "one, or action: ignore")


@dataclass(frozen=True)
class HealthLength:
    action: str
    when: str  # at_once | next_save: when a stop ends the trainer
    metric: str
    baseline_steps: int
    min_ratio: float
    max_ratio: float
    steps: int
    max_cap_fraction: float | None


@dataclass(frozen=True)
class HealthRewardFloor:
    action: str
    when: str  # at_once | next_save: when a stop ends the trainer
    metric: str
    minimum: float
    steps: int


@dataclass(frozen=True)
class HealthRewardFall:
    """The mean of the latest ``window`` values more than ``max_drop`` below the best mean
    of ``window`` consecutive values so far."""

    action: str
    when: str  # at_once | next_save: when a stop ends the trainer
    metric: str
    window: int
    max_drop: float


@dataclass(frozen=True)
class HealthValidation:
    action: str
    when: str  # at_once | next_save: when a stop ends the trainer
    metric: str
    k: float
    responses: int
    validations: int  # in a row below the line before the rule fires


@dataclass(frozen=True)
class Health:
    """``train.health``: the guard's rules (hy3rl.health), one field a rule, in this order."""

    nonfinite: HealthNonfinite
    drift: HealthAbove
    entropy: HealthEntropy
    response_length: HealthLength
    clip_ratio: HealthAbove
    reward_floor: HealthRewardFloor
    reward_fall: HealthRewardFall
    validation: HealthValidation
    blind_lines: int  # logged lines in a row without a rule's metric: a blind warn

    def rules(self) -> list[tuple[str, Any]]:
        """(name, rule section) of every rule not ``ignore``, in the schema's order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if dataclasses.is_dataclass(getattr(self, f.name))
                and getattr(self, f.name).action != "ignore"]

    def watched(self) -> list[tuple[str, str]]:
        """(rule name, metric key) of every metric a rule not ``ignore`` reads."""
        return [(name, key) for name, rule in self.rules()
                for key in (rule.metrics if isinstance(rule, HealthNonfinite) else [rule.metric])]


@dataclass(frozen=True)
class Train:
    reward_mode: str
    total_training_steps: int
    env: dict[str, Any]
    loggers: list[str]
    algorithm: Algorithm
    reward_function: RewardFunction
    launch_script: str
    verl_overrides: dict[str, Any]
    checkpoint_root: str
    checkpoint_keep: int
    keep_eval_checkpoints: str
    on_config_change: str
    segment_steps: int
    prune_interval_s: float
    max_submissions: int
    restarts_per_job: int
    watchdog: Watchdog
    time_limit_margin_min: float
    node_logs_mb: float
    notify_command: str
    ray_env_passthrough: list[str]
    cpu: TrainCpu
    runtime: Runtime
    ray: Ray
    health: Health


@dataclass(frozen=True)
class TransformersBackend:
    device: str
    dtype: str


@dataclass(frozen=True)
class VllmBackend:
    tensor_parallel_size: int
    data_parallel_size: int
    nodes: int
    gpus_per_node: int
    gpu_memory_utilization: float
    max_model_len: int | None
    enforce_eager: bool
    time_min: int


@dataclass(frozen=True)
class Graders:
    timeout_s: float
    workers: int


@dataclass(frozen=True)
class Bootstrap:
    resamples: int
    level: float
    seed: int


@dataclass(frozen=True)
class Select:
    set: str
    grader: str
    metric: str
    k: int | None


@dataclass(frozen=True)
class Eval:
    backend: str
    preset: str
    temperature: float | None
    top_p: float | None
    n_samples: int | None
    max_tokens: int | None
    num_problems: int | None
    seed: int
    steps: list[int]
    final: bool
    select: Select | None
    wait_poll_s: float
    wait_unproven_polls: int
    batch_size: int
    transformers: TransformersBackend
    vllm: VllmBackend
    graders: Graders
    bootstrap: Bootstrap


@dataclass(frozen=True)
class RehearsalModel(TinyModel):
    """The tiny model's sizes plus the shapes the tiny model fixes (hy3rl.model.TinySpec)."""

    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    moe_intermediate_size: int


@dataclass(frozen=True)
class RehearsalEval:
    num_problems: int
    n_samples: int
    max_tokens: int


@dataclass(frozen=True)
class Rehearsal:
    model: RehearsalModel
    shape: str  # small | stage (hy3rl.rehearsal.SHAPE_ENV, hy3rl.stage)
    env: dict[str, Any]
    verl_overrides: dict[str, Any]
    eval: RehearsalEval
    runtime_min: int
    memory_headroom: float


@dataclass(frozen=True)
class Report:
    reference_curves: bool
    drift_threshold: float
    env_prefixes: list[str]
    packages: list[str]
    redact_env: list[str]
    dpi: int


@dataclass(frozen=True)
class ReleaseHub:
    """``release.hub``: where a release is pushed (hy3rl.release.upload); ``{tag}`` in
    ``repo`` or ``revision`` is the release tag."""

    repo: str
    private: bool
    revision: str
    overwrite: bool

    def __post_init__(self) -> None:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        for key, value in (("repo", self.repo), ("revision", self.revision)):
            if set(value.replace("{tag}", "")) & set("{}"):
                raise ConfigError(f"release.hub.{key}: {value!r} has a brace that is not "
                                  "part of {tag}")
        try:
            validate_repo_id(self.repo.replace("{tag}", "selected"))
        except HFValidationError as exc:
            raise ConfigError(f"release.hub.repo: {self.repo!r} is not a hub repository id "
                              f"\"owner/name\" ({exc})") from None
        if ".." in self.revision or self.revision.endswith(("/", ".lock")):
            raise ConfigError(f"release.hub.revision: {self.revision!r} is not a branch name")

    def at(self, tag: str) -> tuple[str, str]:
        """(repository, revision) of release ``tag``."""
        return self.repo.replace("{tag}", tag), self.revision.replace("{tag}", tag)

    @property
    def per_tag(self) -> bool:
        """Each tag has its own repository or branch (``{tag}`` in one of them)."""
        return "{tag}" in self.repo + self.revision


@dataclass(frozen=True)
class Release:
    dir: str
    tags: list[str] | None  # None (unset): what the DAG evaluates (hy3rl.release.release_tags)
    mtp: str  # auto | trained | none (hy3rl.release.mtp_policy)
    config_may_differ: list[str]  # config.json keys allowed to differ from the base's
    problems: int
    max_tokens: int
    threads: int
    runtime_min: int
    hub: ReleaseHub | None  # None: no upload


@dataclass(frozen=True)
class Config:
    """The whole validated configuration, one typed section an attribute. ``raw`` is the
    validated dict itself (defaults filled in), for hashing, the report's resolved YAML and
    the verl launch, which need the mapping form."""

    run: Run
    deps: Deps
    data: Data
    model: Model
    checks: Checks
    cluster: Cluster
    preflight: Preflight
    train: Train
    rehearsal: Rehearsal
    eval: Eval
    report: Report
    release: Release
    raw: dict[str, Any] = dataclasses.field(repr=False, compare=False, hash=False)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Config:
        """Validate ``config`` (defaults filled in from the schema) and type it."""
        raw = validate(config)
        hints = typing.get_type_hints(cls)
        sections = {f.name: build(hints[f.name], raw[f.name], f.name)
                    for f in dataclasses.fields(cls) if f.name != "raw"}
        if sections["cluster"].gpu and sections["train"].cpu.enable:
            raise ConfigError(
                "train.cpu.enable: the CPU path (real verl on FSDP2/gloo with a transformers "
                "rollout) is not the paper's stack; it is refused with cluster.gpu true (set "
                "one of them false)")
        return cls(**sections, raw=raw)

    @classmethod
    def load(cls, *paths: str | Path) -> Config:
        """Load and merge config files in order (as Snakemake merges --configfile)."""
        return cls.from_dict(load(*paths))

    @property
    def trains(self) -> bool:
        """Whether the run trains: on GPUs (cluster.gpu) or on the CPU path (train.cpu)."""
        return bool(self.cluster.gpu or self.train.cpu.enable)

    @property
    def hash(self) -> str:
        """sha256 of the canonical JSON of the validated config."""
        return config_hash(self.raw)

    @property
    def eval_keep_steps(self) -> list[int]:
        """Checkpoint steps evaluation needs (``eval.steps``, sorted): retention never
        prunes them and preflight's disk rule counts them."""
        return sorted(self.eval.steps)


def build(tp: Any, value: Any, path: str) -> Any:
    """``value`` (validated JSON-like data) as type ``tp``; nested dataclasses recursively.
    A key the dataclass lacks (or a field the data lacks) is a ConfigError naming the key:
    it means the schema and this module disagree."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return build(args[0], value, path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        extra = sorted(set(value) - set(names))
        # The validator fills no null defaults: an absent optional key is None.
        missing = sorted(n for n in set(names) - set(value) if not _optional(hints[n]))
        if extra or missing:
            raise ConfigError(
                f"{path}: config keys {extra} have no typed field, fields {missing} no value "
                "(hy3rl.settings and config/schema disagree)")
        return tp(**{n: build(hints[n], value.get(n), f"{path}.{n}") for n in names})
    if origin is list:
        return list(value)
    if origin is dict:
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) \
        and type(None) in typing.get_args(tp)


def schema_paths(tp: Any = Config, prefix: str = "") -> set[str]:
    """Every dotted key these dataclasses declare (for the schema agreement test)."""
    out: set[str] = set()
    hints = typing.get_type_hints(tp)
    for f in dataclasses.fields(tp):
        if f.name == "raw":
            continue
        key = f"{prefix}{f.name}"
        out.add(key)
        sub = hints[f.name]
        if typing.get_origin(sub) in (typing.Union, types.UnionType):
            sub = next(a for a in typing.get_args(sub) if a is not type(None))
        if dataclasses.is_dataclass(sub):
            out |= schema_paths(sub, key + ".")
    return out
