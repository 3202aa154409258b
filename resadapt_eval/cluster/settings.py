"""SLURM settings of a sweep's jobs: a card's `slurm:` section, overridden by `--slurm-*` flags,
checked before anything is submitted, and turned into submitit's executor parameters."""

from __future__ import annotations

import difflib
import tempfile
from dataclasses import dataclass, field, fields

import yaml


class BadSlurmSetting(ValueError):
    """A SLURM setting that would stop or mislead the jobs; the message names the flag and card key."""


@dataclass
class SlurmSettings:
    """partition / account / qos: sbatch's; gpus_per_node: GPUs of each cell's job (lmms-eval's
    --launcher spreads the cell over them); nodes: 1 (one lmms-eval run spans one node); cpus_per_task;
    mem_gb: memory per job in GB; timeout_min: the job's time limit in minutes; options: further
    submitit SLURM parameters (constraint, exclude, gres, setup, ...); additional: raw sbatch flags
    submitit passes on unchecked (reservation, requeue, ...)."""

    partition: str | None = None
    gpus_per_node: int = 1
    nodes: int = 1
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    timeout_min: int = 720
    account: str | None = None
    qos: str | None = None
    options: dict = field(default_factory=dict)
    additional: dict = field(default_factory=dict)


CARD_KEYS = tuple(f.name for f in fields(SlurmSettings))
SCALAR_KEYS = tuple(k for k in CARD_KEYS if k not in ("options", "additional"))  # one flag, one value each
FLAGS = {key: "--slurm-" + key.replace("_", "-") for key in CARD_KEYS}
FLAGS.update(options="--slurm-option", additional="--slurm-additional")
# submitit SLURM parameters a --slurm-option may not set: a dedicated flag sets them, or they would
# break one job per cell
RESERVED_OPTIONS = {
    "partition": "--slurm-partition",
    "account": "--slurm-account",
    "qos": "--slurm-qos",
    "gpus_per_node": "--slurm-gpus-per-node",
    "nodes": "--slurm-nodes",
    "cpus_per_task": "--slurm-cpus-per-task",
    "mem": "--slurm-mem-gb",
    "mem_gb": "--slurm-mem-gb",
    "time": "--slurm-timeout-min",
    "timeout_min": "--slurm-timeout-min",
    "array_parallelism": "--max-parallel",
    "job_name": "nothing (each job is named after its cell)",
    "name": "nothing (each job is named after its cell)",
    "ntasks_per_node": "nothing (a cell is one task; --launcher spreads it over the job's GPUs)",
    "tasks_per_node": "nothing (a cell is one task; --launcher spreads it over the job's GPUs)",
    "additional_parameters": "--slurm-additional",
}


def where(key: str) -> str:
    return f"{FLAGS[key]} (card slurm.{key})"


def parse_pairs(pairs: list[str], flag: str) -> dict:
    """`KEY=VALUE` flags as a dict, each value read as YAML (90 -> int, true -> bool, [a, b] -> list)."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise BadSlurmSetting(f"{flag} takes KEY=VALUE, got {pair!r}")
        parsed[key.strip().replace("-", "_") if flag == "--slurm-option" else key.strip()] = yaml.safe_load(value)
    return parsed


def check_card_section(card_section, card: str) -> None:
    """A card's `slurm:` section is a mapping of SLURM settings (`SlurmSettings`' fields)."""
    if not isinstance(card_section, dict):
        raise BadSlurmSetting(
            f"{card}: slurm takes a mapping of SLURM settings with keys {', '.join(CARD_KEYS)} (docs/cluster.md), "
            f"got {card_section!r}"
        )
    for key in card_section:
        if key not in CARD_KEYS:
            close = difflib.get_close_matches(str(key), CARD_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else "."
            raise BadSlurmSetting(
                f"{card}: slurm.{key} is not a SLURM setting{hint} The card's slurm: keys are "
                f"{', '.join(CARD_KEYS)} (docs/cluster.md); other submitit parameters go under slurm.options"
            )


def slurm_settings(card_section: dict, flags: dict) -> SlurmSettings:
    """The card's `slurm:` section (`check_card_section`) with the flags given (not None) on top,
    every value checked; BadSlurmSetting names the first bad one."""
    values = {**card_section, **{k: v for k, v in flags.items() if v is not None and v != {}}}
    for key in ("options", "additional"):
        if key in values and not isinstance(values[key], dict):
            raise BadSlurmSetting(f"{where(key)} takes KEY=VALUE pairs (a mapping in the card), got {values[key]!r}")
    settings = SlurmSettings(**values)
    check(settings)
    return settings


def check(settings: SlurmSettings) -> None:
    for key in ("gpus_per_node", "nodes", "cpus_per_task", "timeout_min"):
        value = getattr(settings, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadSlurmSetting(f"{where(key)} takes a whole number, got {value!r}")
    if settings.gpus_per_node < 0:
        raise BadSlurmSetting(f"{where('gpus_per_node')} must be at least 0, got {settings.gpus_per_node}")
    if settings.nodes != 1:
        raise BadSlurmSetting(
            f"{where('nodes')} must be 1, got {settings.nodes}: a cell is one lmms-eval run, which spans one node "
            "(lmms-eval's multi-node support is not by design); a sweep spreads its cells over nodes (--max-parallel)"
        )
    if settings.cpus_per_task is not None and settings.cpus_per_task < 1:
        raise BadSlurmSetting(f"{where('cpus_per_task')} must be at least 1, got {settings.cpus_per_task}")
    if settings.timeout_min < 1:
        raise BadSlurmSetting(f"{where('timeout_min')} must be at least 1 minute, got {settings.timeout_min}")
    if settings.mem_gb is not None and not (isinstance(settings.mem_gb, (int, float)) and settings.mem_gb > 0):
        raise BadSlurmSetting(f"{where('mem_gb')} must be a positive number of GB, got {settings.mem_gb!r}")
    for key in ("partition", "account", "qos"):
        value = getattr(settings, key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise BadSlurmSetting(f"{where(key)} takes a name, got {value!r}")
    for option in settings.options:
        if option in RESERVED_OPTIONS:
            raise BadSlurmSetting(f"{where('options')} {option}: set it with {RESERVED_OPTIONS[option]}")
    import submitit

    with tempfile.TemporaryDirectory() as folder:  # submitit's own check of the parameter names
        for option, value in settings.options.items():
            try:
                submitit.AutoExecutor(folder=folder, cluster="debug").update_parameters(**{f"slurm_{option}": value})
            except NameError as exc:  # submitit's message lists its valid names; ours are those less the reserved
                raise BadSlurmSetting(f"{where('options')} {option}: {unknown_option(option, str(exc))}") from None
            except (ValueError, AssertionError) as exc:
                first = str(exc).splitlines()[0]
                raise BadSlurmSetting(f"{where('options')} {option}: {first}") from None


def unknown_option(option: str, submitit_message: str) -> str:
    """`not a SLURM parameter submitit knows; did you mean X? accepted: ...`, from submitit's own
    list of valid names (its NameError's `Valid arguments:`), less those a flag of ours sets."""
    listed = submitit_message.partition("Valid arguments:")[2].split("\n", 1)[0]
    accepted = sorted({name.strip() for name in listed.split(",") if name.strip()} - set(RESERVED_OPTIONS))
    hint = "."
    for close in difflib.get_close_matches(option, [*accepted, *RESERVED_OPTIONS], n=1):
        flag = RESERVED_OPTIONS.get(close)
        hint = f"; did you mean {close}" + (f" (set it with {flag})" if flag else "") + "?"
    names = ", ".join(accepted) or submitit_message.splitlines()[0]
    return f"not a SLURM parameter submitit knows{hint} Accepted: {names}"


def executor_parameters(settings: SlurmSettings, name: str, max_parallel: int | None) -> dict:
    """submitit `update_parameters` arguments: the shared ones (applied by the local executor too)
    and the `slurm_` ones (SLURM only)."""
    params = dict(
        name=name,
        gpus_per_node=settings.gpus_per_node,
        nodes=settings.nodes,
        timeout_min=settings.timeout_min,
        cpus_per_task=settings.cpus_per_task,
        mem_gb=settings.mem_gb,
        slurm_partition=settings.partition,
        slurm_account=settings.account,
        slurm_qos=settings.qos,
        slurm_additional_parameters=dict(settings.additional) or None,
        slurm_array_parallelism=max_parallel,
    )
    params.update({f"slurm_{option}": value for option, value in settings.options.items()})
    return {k: v for k, v in params.items() if v is not None}
