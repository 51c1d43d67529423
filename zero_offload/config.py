"""What the user asked for: one frozen, validated configuration.

Every field is checked when the object is built, so a bad value fails before any memory is
allocated or any file written, with one line that names the field, the value and what is
allowed. Every combination of stage and tiers is either supported or refused with its reason
(`_check_combination`).

Build it from keyword arguments, a dict (`Config.from_dict`), a JSON file (`Config.from_file`)
or a DeepSpeed config (`Config.from_deepspeed`, see deepspeed_compat.py). Nested sections may
be given as dicts: `Config(tiers={"optimizer": "cpu"})`. An unknown keyword is the same one-line
error as an unknown key in a dict (`_unknown_key`: the closest valid name, or for a DeepSpeed
name, ours), not Python's TypeError.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from zero_offload.tiers import TIERS, tier

from zero_offload.optim.registry import SPECS
from zero_offload.optim.spec import Bound
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = tuple(SPECS)  # the names optim/registry.py knows ("adamw", "adam")
IO_BACKENDS = ("auto", "native", "aiofiles")  # "auto": native when the library loaded, else aiofiles
ALIGN_BYTES = 4096  # O_DIRECT needs buffer address, file offset and length on this boundary
MiB = 1 << 20
GiB = 1 << 30
# The most CPU threads a setting may ask for: far above any workstation's cores, and far below
# the counts (around 100,000) at which torch.set_num_threads crashes the process.
MAX_THREADS = 4096
# Upper bounds where a larger value cannot be meant (an accumulation of 10**30 micro-batches never
# steps): far above any real setting, so they refuse only slips and overflows.
MAX_ACCUMULATION = 1 << 20  # micro-batches per optimizer step
MAX_COUNT = (1 << 31) - 1  # steps (scale_window, hysteresis)
MAX_BYTES = 1 << 50  # any size in bytes: 1 PiB
MAX_PATH_BYTES = 4095  # one nvme path: Linux's PATH_MAX less the terminating NUL
MAX_PATHS = 256
MAX_NAME = 256  # one module class name
MAX_NAMES = 4096
SHOWN = 200  # the most characters of a value an error message quotes


def user_stacklevel() -> int:
    """For the function calling warnings.warn (level 1), the stacklevel of the first frame outside
    the zero_offload package, so the warning shows the user's line (initialize, from_file,
    ZeroOffloadTrainer(...)), whichever of our entry points it came through."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        level, frame = level + 1, frame.f_back
    return level


def shown(value: Any) -> str:
    """repr(value) for an error message, cut to SHOWN characters (a 50 MB path used to become a
    50-million-character message)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def int_range(low: int, high: int) -> str:
    """The one wording of an integer range, for every reader of a config (ours, DeepSpeed's)."""
    return f"expected an integer in [{low}, {high}]"


def float_range(low: float, high: float | None, *, open_low: bool = False, open_high: bool = False) -> str:
    """The one wording of a number range: brackets say whether each end is allowed (optim/spec.py's
    Bound words it, so an optimizer's kernels refuse a hyperparameter in the same words)."""
    return Bound(low, high, open_low=open_low, open_high=open_high).wording()


@dataclass(frozen=True)
class ForeignFormat:
    """Another project's config format that `Config.from_dict` reads: whether a dict is one, how
    it maps onto a Config, and the hint an unknown key of ours gets when it is that format's
    name. Registered by the module that reads it (deepspeed_compat.py, imported with the
    package), so this module never imports a format's reader."""

    name: str
    recognises: Callable[[Mapping[str, Any]], bool]
    build: Callable[[Mapping[str, Any]], "Config"]
    key_hint: Callable[[str], "str | None"]


_FORMATS: dict[str, ForeignFormat] = {}


def register_format(fmt: ForeignFormat) -> None:
    """Make `Config.from_dict` (and `from_file`) read `fmt` too."""
    _FORMATS[fmt.name] = fmt


def _format(name: str) -> ForeignFormat:
    if name not in _FORMATS:  # the package's __init__ imports every reader: only a broken install lacks one
        raise ConfigError(f"no reader for {name} configs is registered (import zero_offload, which registers it)")
    return _FORMATS[name]


class ConfigError(ValueError):
    """A configuration value or combination that zero_offload refuses; the message is one line.

    `field` and `allowed` are set for a bad field value (see _fail), so a reader of another
    format (deepspeed_compat) can say the same under its own key and the value as written."""

    def __init__(self, message: str, field: str | None = None, allowed: str | None = None) -> None:
        super().__init__(message)
        self.field, self.allowed = field, allowed


def _fail(path: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config field '{path}' = {shown(value)} is invalid: {allowed}", field=path, allowed=allowed)


def _check_type(path: str, value: Any, kind: type | tuple[type, ...]) -> None:
    # bool is an int subclass; a True where a count is expected is almost always a slip.
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
    if not ok:
        names = " or ".join(k.__name__ for k in _as_tuple(kind))
        _fail(path, value, f"expected {names}, got {type(value).__name__}")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _check_int(path: str, value: Any, low: int, high: int) -> None:
    _check_type(path, value, int)
    if value < low or value > high:
        _fail(path, value, int_range(low, high))


def _check_float(path: str, value: Any, low: float, high: float | None = None, *, open_low: bool = False,
                 open_high: bool = False) -> None:
    _check_type(path, value, (int, float))
    outside = value < low or (open_low and value == low) or (high is not None and (
        value > high or (open_high and value == high)))
    if not math.isfinite(value) or outside:
        _fail(path, value, float_range(low, high, open_low=open_low, open_high=open_high))


def _check_names(path: str, value: Any) -> tuple[str, ...]:
    """A list of module class names, each non-empty and of at most MAX_NAME characters."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) for m in value):
        _fail(path, value, "expected a list of module class names")
    if len(value) > MAX_NAMES or not all(0 < len(m) <= MAX_NAME for m in value):
        _fail(path, value, f"expected at most {MAX_NAMES} module class names of 1 to {MAX_NAME} characters each")
    return tuple(value)


def _check_choice(path: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(path, value, f"expected one of {', '.join(choices)}")


class _Fields:
    """Base of the config dataclasses: a keyword that is not a field is the ConfigError from_dict
    gives for the key (closest valid name; for Config, our name for a DeepSpeed one), not the
    generated __init__'s bare TypeError. Checked in __new__, so the dataclass's own __init__,
    positional arguments and dataclasses.replace are as they were."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                raise _unknown_key(cls, key)
        return super().__new__(cls)


@dataclass(frozen=True)
class Tiers(_Fields):
    """Where each state group lives: 'device', 'cpu' (pinned host RAM) or 'nvme'.

    params: the compute copy's home between uses (off the device only at stage 3).
    grads: gradient accumulation buffers / reduced grad shards.
    optimizer: the master shard and the moments (fp32).
    """

    params: str = "device"
    grads: str = "device"
    optimizer: str = "device"

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_choice(f"tiers.{f.name}", getattr(self, f.name), TIERS)


@dataclass(frozen=True)
class PrecisionConfig(_Fields):
    """Compute dtype and, for fp16, the dynamic loss scale (ignored for fp32/bf16)."""

    dtype: str = "fp32"
    initial_scale_power: int = 16
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    static_scale: float = 0.0  # > 0 fixes the loss scale; 0 means dynamic

    def __post_init__(self) -> None:
        _check_choice("precision.dtype", self.dtype, PRECISIONS)
        _check_int("precision.initial_scale_power", self.initial_scale_power, 0, 64)
        _check_int("precision.scale_window", self.scale_window, 1, MAX_COUNT)
        _check_float("precision.min_scale", self.min_scale, 0.0, open_low=True)
        _check_int("precision.hysteresis", self.hysteresis, 1, MAX_COUNT)
        _check_float("precision.static_scale", self.static_scale, 0.0)


@dataclass(frozen=True)
class OptimizerConfig(_Fields):
    """The optimizer (a name of optim/registry.py: Adam with L2, AdamW with decoupled decay, ...)
    and its hyperparameters; a field the optimizer has not (Lion's eps) is not used."""

    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    threads: int = 0  # CPU Adam threads; 0 = all cores this process may use

    def __post_init__(self) -> None:
        _check_choice("optimizer.name", self.name, OPTIMIZERS)
        # The spec of `name` checks the hyperparameters it has (Lion has no eps), in its own ranges.
        SPECS[self.name].check({f.name: getattr(self, f.name) for f in fields(self)}, _fail_optimizer,
                               number=_config_number, config=True)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check_int("optimizer.threads", self.threads, 0, MAX_THREADS)


def _fail_optimizer(name: str, value: Any, allowed: str) -> None:
    _fail(f"optimizer.{name}", value, allowed)


def _config_number(name: str, value: Any) -> float:
    """A config's number is an int or a float as written (never a bool or a string)."""
    _check_type(f"optimizer.{name}", value, (int, float))
    return value


@dataclass(frozen=True)
class IOConfig(_Fields):
    """How the NVMe tier talks to the drive (`zero-offload bench-io --write-config` fills it)."""

    block_size: int = 8 * MiB
    queue_depth: int = 8
    threads: int = 4
    backend: str = "auto"
    direct: bool = True

    def __post_init__(self) -> None:
        _check_int("io.block_size", self.block_size, ALIGN_BYTES, GiB)
        if self.block_size % ALIGN_BYTES:
            _fail("io.block_size", self.block_size, f"expected a multiple of {ALIGN_BYTES} (O_DIRECT alignment)")
        _check_int("io.queue_depth", self.queue_depth, 1, 1024)
        _check_int("io.threads", self.threads, 1, 256)
        _check_choice("io.backend", self.backend, IO_BACKENDS)
        _check_type("io.direct", self.direct, bool)


@dataclass(frozen=True)
class Stage3Config(_Fields):
    """Stage 3: how parameters are grouped into units and how far ahead they are fetched.

    live_budget_bytes caps the gathered compute copies alive at once (prefetched ones included).
    unit_modules names module classes that each form a unit (e.g. "Block"); with none, each item
    of a repeated stack of blocks is a unit, and other modules are grouped up to unit_bytes
    (engine/stage3/policy.py). leaf_modules names classes whose whole subtree is one unit (an MoE
    layer, whose router picks different experts on different ranks), with or without
    unit_modules. Parameters of units smaller than resident_bytes stay on the device, gathered once.
    With tiers.params = 'nvme', the first units (in model order) whose compute-copy shards hold at
    most max_in_cpu elements of this rank stay in host RAM instead (DeepSpeed's offload_param.max_in_cpu).
    """

    live_budget_bytes: int = 1 * GiB
    prefetch_depth: int = 2
    unit_modules: tuple[str, ...] = ()
    unit_bytes: int = 64 * MiB
    resident_bytes: int = 0
    leaf_modules: tuple[str, ...] = ()
    max_in_cpu: int = 0

    def __post_init__(self) -> None:
        _check_int("stage3.live_budget_bytes", self.live_budget_bytes, 1, MAX_BYTES)
        _check_int("stage3.max_in_cpu", self.max_in_cpu, 0, MAX_BYTES)
        _check_int("stage3.prefetch_depth", self.prefetch_depth, 0, 64)
        for name in ("unit_modules", "leaf_modules"):
            object.__setattr__(self, name, _check_names(f"stage3.{name}", getattr(self, name)))
        _check_int("stage3.unit_bytes", self.unit_bytes, 1, MAX_BYTES)
        _check_int("stage3.resident_bytes", self.resident_bytes, 0, MAX_BYTES)


@dataclass(frozen=True)
class PreemptionConfig(_Fields):
    """Saving on pre-emption (docs/faults.md): with handle_signals, a SIGTERM or SIGUSR1 makes
    engine.step() save a checkpoint in checkpoint_dir at the next accumulation boundary, close
    the engine and raise zero_offload.Preempted (a SystemExit: exit code 128 + the signal)."""

    handle_signals: bool = False
    checkpoint_dir: str = ""

    def __post_init__(self) -> None:
        _check_type("preemption.handle_signals", self.handle_signals, bool)
        _check_type("preemption.checkpoint_dir", self.checkpoint_dir, str)
        if len(os.fsencode(self.checkpoint_dir)) > MAX_PATH_BYTES or "\0" in self.checkpoint_dir:
            _fail("preemption.checkpoint_dir", self.checkpoint_dir,
                  f"expected a directory path of at most {MAX_PATH_BYTES} bytes, without NUL")
        if self.handle_signals and not self.checkpoint_dir:
            _fail("preemption.checkpoint_dir", self.checkpoint_dir,
                  "preemption.handle_signals needs a directory to save the checkpoint in")


_SECTIONS: dict[str, type] = {
    "tiers": Tiers,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "io": IOConfig,
    "stage3": Stage3Config,
    "preemption": PreemptionConfig,
}


@dataclass(frozen=True)
class Config(_Fields):
    """The whole configuration surface. See the module docstring for how to build one."""

    stage: int = 0
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    tiers: Tiers = field(default_factory=Tiers)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    nvme_paths: tuple[str, ...] = ()
    pin_memory: bool = True
    pinned_budget_bytes: int = 2 * GiB
    io: IOConfig = field(default_factory=IOConfig)
    stage3: Stage3Config = field(default_factory=Stage3Config)
    gradient_accumulation_steps: int = 1
    clip_grad_norm: float = 0.0  # 0 disables clipping
    bucket_bytes: int = 32 * MiB
    overlap_step: bool = True
    track_grad_norm: bool = False
    speculative_step_bytes: int = 0
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)

    def __post_init__(self) -> None:
        if isinstance(self.stage, Mapping):  # Config({...}): the whole dict landed in the first field
            raise ConfigError("Config takes its fields as keywords (Config(stage=3, ...)); for a dict use "
                              "Config.from_dict(d), or pass the dict to zero_offload.initialize")
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, _build(cls, value, name))
            elif not isinstance(value, cls):
                example = f"{name}={{'{fields(cls)[0].name}': ...}}"
                _fail(name, value, f"expected a {cls.__name__} or a dict, e.g. {example}")
        _check_int("stage", self.stage, 0, 3)
        self._normalize_paths()
        _check_type("pin_memory", self.pin_memory, bool)
        _check_int("pinned_budget_bytes", self.pinned_budget_bytes, 1, MAX_BYTES)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1, MAX_ACCUMULATION)
        _check_float("clip_grad_norm", self.clip_grad_norm, 0.0)
        _check_int("bucket_bytes", self.bucket_bytes, 1, MAX_BYTES)
        _check_type("overlap_step", self.overlap_step, bool)
        _check_type("track_grad_norm", self.track_grad_norm, bool)
        _check_int("speculative_step_bytes", self.speculative_step_bytes, 0, MAX_BYTES)
        _check_combination(self)

    def _normalize_paths(self) -> None:
        paths = self.nvme_paths
        if isinstance(paths, str):
            paths = (paths,)
        if not isinstance(paths, (tuple, list)) or not all(isinstance(p, str) and p for p in paths):
            _fail("nvme_paths", self.nvme_paths, "expected a directory path or a list of them")
        if len(paths) > MAX_PATHS or not all(len(os.fsencode(p)) <= MAX_PATH_BYTES and "\0" not in p for p in paths):
            _fail("nvme_paths", self.nvme_paths,
                  f"expected at most {MAX_PATHS} directory paths of at most {MAX_PATH_BYTES} bytes each, without NUL")
        object.__setattr__(self, "nvme_paths", tuple(os.path.expanduser(p) for p in paths))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        """Build from a plain dict (as read from JSON); unknown keys are errors. A DeepSpeed config
        is recognised by any key only DeepSpeed has, as it may leave out zero_optimization."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        for fmt in _FORMATS.values():
            if fmt.recognises(data):
                return fmt.build(data)
        return _build(cls, data, "")

    @classmethod
    def from_file(cls, path: str) -> "Config":
        """Build from a JSON file (ours or DeepSpeed's)."""
        try:
            with open(path, "rb") as f:  # decoded whole, so a bad byte's offset is the file's
                data = parse_json(f.read().decode("utf-8"), f"config file {path}")  # JSON is UTF-8 (RFC 8259)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text: byte {exc.start} is invalid") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        except RecursionError:  # json's parser recurses once per nesting level
            raise ConfigError(f"config file {path} is nested too deeply") from None
        return cls.from_dict(data)

    @classmethod
    def from_deepspeed(cls, data: Mapping[str, Any]) -> "Config":
        """Map a DeepSpeed config (whole, or just its zero_optimization dict) onto ours."""
        return _format("deepspeed").build(data)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that `from_dict` turns back into an equal Config."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def parse_json(text: str, what: str) -> Any:
    """json.loads, refusing a key given twice in one object (json keeps the last one silently,
    so the first value, maybe the one the user edited, would do nothing); `what` names the file."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"{what} gives the key {shown(key)} twice in one object: JSON would keep only the "
                                  f"last ({shown(value)}, not {shown(out[key])}); give it once")
            out[key] = value
        return out

    return json.loads(text, object_pairs_hook=unique)


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    """Construct a config dataclass from a dict, naming unknown keys and their closest match."""
    if not isinstance(data, Mapping):
        _fail(prefix or "config", data, "expected a JSON object")
    known = [f.name for f in fields(cls)]
    for key in data:
        if key not in known:
            raise _unknown_key(cls, key)
    kwargs = dict(data)
    for key, value in kwargs.items():
        if cls is Config and key in _SECTIONS and isinstance(value, Mapping):  # sections are top-level only
            kwargs[key] = _build(_SECTIONS[key], value, key)
        elif isinstance(value, list):
            kwargs[key] = tuple(value)
    return cls(**kwargs)


def _unknown_key(cls: type, key: Any) -> ConfigError:
    """'unknown config key' naming the closest valid one (else every valid one); at the top level,
    a DeepSpeed key is pointed to ours, as the closest spelling would mislead (gradient_clipping
    is not a slip for anything we have)."""
    section = next((name for name, c in _SECTIONS.items() if c is cls), "")
    key = str(key) if len(str(key)) <= SHOWN else shown(key)  # no closest match is that long
    where = f"{section}.{key}" if section else key
    if cls is Config:
        for fmt in _FORMATS.values():
            hint = fmt.key_hint(str(key))
            if hint:
                return ConfigError(f"unknown config key '{where}'{hint}")
    known = [f.name for f in fields(cls)]
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(known)}"
    return ConfigError(f"unknown config key '{where}'{hint}")


def _check_combination(c: Config) -> None:
    """Refuse the stage/tier/precision combinations that cannot work, saying why."""
    t = c.tiers
    params, grads, optimizer = tier(t.params), tier(t.grads), tier(t.optimizer)
    if params.off_device and c.stage < 3:
        raise ConfigError(
            f"tiers.params = '{t.params}' needs stage 3 (stage is {c.stage}): below stage 3 every rank "
            "keeps its full compute copy on the device, so there is nothing to offload")
    if params.off_device and optimizer.on_device:
        raise ConfigError(
            f"tiers.params = '{t.params}' with tiers.optimizer = '{t.optimizer}' is refused: the master shard "
            "would stay on the device while only the smaller compute copy moves off it")
    if grads.off_device and optimizer.on_device:
        raise ConfigError(
            f"tiers.grads = '{t.grads}' with tiers.optimizer = '{t.optimizer}' is refused: the device optimizer "
            "would have to copy every gradient back to the device to step it")
    drive = [f.name for f in fields(t) if tier(getattr(t, f.name)).needs_nvme_paths]
    if drive and not c.nvme_paths:
        raise ConfigError(f"tiers.{drive[0]} = '{getattr(t, drive[0])}' needs nvme_paths (one or more directories "
                          "on the drive)")
    if c.stage3 != Stage3Config() and c.stage != 3:
        raise ConfigError(f"stage3 settings are given but stage is {c.stage}: they apply only to stage 3")
