"""What the subcommands share: argument checks, flag groups (model source, mesh, data) and the one
model loader. jax and the model are imported when a command runs, so `--help` and argument errors
answer at once."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

from rich.console import Console

DEFAULT_PRESET = "tiny"
MAX_RANDOM_INIT_BYTES = 16 * 2**30
NO_COMPILE_CACHE_ENV = "JAXSPEC_NO_COMPILE_CACHE"
NO_PIN_ENV = "JAXSPEC_NO_PIN"  # as --no-pin, for every command (the test suite sets it: one process, many commands)


# ---- the persistent compilation cache ---------------------------------------------------------


def default_compile_cache_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR if set, else jaxspec/xla under the user's cache folder
    ($XDG_CACHE_HOME, else ~/.cache)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxspec", "xla")


def add_compile_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep XLA's compiled programs here across runs (default $JAX_COMPILATION_CACHE_DIR, else "
                   "~/.cache/jaxspec/xla)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help=f"compile every program afresh (also: {NO_COMPILE_CACHE_ENV}=1)")


def compile_cache_dir(args: argparse.Namespace) -> str | None:
    """The persistent compilation cache folder the flags and environment ask for; None when off."""
    if getattr(args, "no_compile_cache", False) or os.environ.get(NO_COMPILE_CACHE_ENV, "") not in ("", "0"):
        return None
    return os.path.expanduser(getattr(args, "compile_cache", None) or default_compile_cache_dir())


def enable_compile_cache(args: argparse.Namespace) -> str | None:
    """Turn jax's persistent compilation cache on in `compile_cache_dir(args)` (or off) before the
    first compile: a second run of the same command reads its programs instead of compiling them
    (tens of seconds each for the shipped checkpoint on a CPU). -> the folder, None when off."""
    import jax

    folder = compile_cache_dir(args)
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # jax keeps only compiles over 1 s
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


def compile_cache_note(args: argparse.Namespace) -> str:
    """One line for the log: where compiled programs are kept (or that they are not)."""
    folder = getattr(args, "compile_cache_dir", None)
    if folder is None:
        return "compile cache: off (compiles every program)"
    return f"compile cache: {folder} (a second run loads its programs instead of compiling; --no-compile-cache)"


def step_progress(console: Console, description: str):
    """A rich progress bar (with ETA) for a step loop, and the `on_step(done, total)` that drives it;
    the loop's log lines print above the bar."""
    from rich.progress import Progress, TimeElapsedColumn

    bar = Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console)
    task = bar.add_task(description, total=None)
    return bar, lambda done, total: bar.update(task, completed=done, total=total)


def positive(name: str, value: int) -> int:
    """ValueError unless value >= 1 (`name` is the flag, without dashes)."""
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")
    return value


def csv(kind):
    """argparse type: a comma-separated list of `kind`."""

    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return tuple(kind(x) for x in items)

    return parse


# ---- flag groups ------------------------------------------------------------------------------


def add_weights_args(p: argparse.ArgumentParser, *, checkpoint: bool = False, default: str = "plain") -> None:
    """--weights plain | fp8, and for plan / cost (abstract shapes, no file) --experts fp4 | fp8;
    `checkpoint`: the command loads --checkpoint, whose files say how the experts are stored;
    `default`: the --weights default of plan / cost."""
    if checkpoint:
        p.add_argument("--weights", choices=("plain", "fp8"), default="plain",
                       help="plain: dequantize a DeepSeek-V4 release's FP8 / FP4 weights on load; fp8: keep them "
                       "resident with their scales, dequantized per block inside the matmuls (default plain)")
        return
    p.add_argument("--weights", choices=("plain", "fp8"), default=default,
                   help="plain: every weight in the preset's dtype; fp8: the weights DeepSeek's release stores "
                   f"quantized stay FP8 / FP4 with their scales, as released (default {default})")
    p.add_argument("--experts", choices=("fp4", "fp8"), default="fp4",
                   help="with --weights fp8: routed experts FP4 1x32 (instruct release) or FP8 128x128 (Base release)")


def weights_label(cfg: Any, args: argparse.Namespace) -> str:
    if args.weights == "plain":
        return cfg.dtype
    if cfg.v41 is not None:
        return f"{cfg.dtype}, weights FP8 32x32 + routed experts {args.experts.upper()} + Engram tables FP8 as released"
    return f"{cfg.dtype}, weights FP8 128x128 + routed experts {args.experts.upper()} as released"


def add_model_arguments(p: argparse.ArgumentParser, *, text: bool = False) -> None:
    """--checkpoint, plus --preset for commands that also run on random weights (text=False)."""
    if text:
        p.add_argument("--checkpoint", required=True, metavar="PATH",
                       help="checkpoint folder with a tokenizer (written by save_checkpoint / jaxspec train)")
        return
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="folder written by save_checkpoint, or a DeepSeek-V4 safetensors folder (config.json + "
                   "*.safetensors + tokenizer.json, e.g. a download of deepseek-ai/DeepSeek-V4-Flash)")
    p.add_argument("--preset", default=None, help=f"model preset when no --checkpoint (default {DEFAULT_PRESET})")


def add_draft_argument(p: argparse.ArgumentParser, every: bool = True) -> None:
    """--draft NAME: a draft of the checkpoint's drafts/ folder instead of its own (`checkpoint/drafts.py`);
    `every`: 'all' takes every draft (a DraftSet)."""
    more = (("; 'all': every draft, --spec naming one (dspark/s5_k1_d6) or auto choosing the draft too by "
             "drafts/tune.json") if every else "")
    p.add_argument("--draft", default=None, metavar="NAME",
                   help=f"use drafts/NAME/ of the checkpoint (e.g. one-step) instead of its own MTP draft{more}")


def add_data_arguments(p: argparse.ArgumentParser, num_prompts: int, what: str) -> None:
    """--datasets, --num-prompts, --max-prompt-tokens, --data-root."""
    p.add_argument("--datasets", type=csv(str), default=("gsm8k", "mbpp", "sharegpt"), help="comma-separated")
    p.add_argument("--num-prompts", type=int, default=num_prompts, help=f"{what} per dataset (default {num_prompts})")
    p.add_argument("--max-prompt-tokens", type=int, default=192, help="longer prompts keep their last tokens")
    p.add_argument("--data-root", default=None, metavar="DIR",
                   help="folder with gsm8k/ and mbpp/ (default $JAXSPEC_DATA, else ../shared/data)")


def train_prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """The first --num-prompts train-split prompts of each of --datasets, tokenized (held-out
    prompts are the sweep's, never calibration's or training's); with `args.prompts == "unseen"`
    (distill-data) the first of `data.unseen_examples` instead: held-out prompts no figure reads."""
    from jaxspec.harness.eval import encode_prompts
    from jaxspec.training.data import TRAIN_SPLITS, load_dataset, unseen_examples

    prompts = []
    for name in args.datasets:
        if getattr(args, "prompts", "train") == "unseen":
            examples = unseen_examples(name, root=args.data_root)[: args.num_prompts]
        else:
            examples = load_dataset(name, TRAIN_SPLITS[name], root=args.data_root)[: args.num_prompts]
        prompts += encode_prompts(tokenizer, examples, args.max_prompt_tokens)
    return prompts


def add_measure_arguments(p: argparse.ArgumentParser, repeats: int = 3) -> None:
    """The measurement discipline's flags (`jaxspec.core.measure`): pinning, repeats, loaded runs."""
    p.add_argument("--repeats", type=int, default=repeats, help=f"timed rounds, every method round-robin (default "
                   f"{repeats})")
    p.add_argument("--core", type=int, default=None,
                   help="the core to pin to, single-threaded XLA (default: the last allowed; not on a GPU machine)")
    p.add_argument("--no-pin", action="store_true",
                   help=f"run on every allowed core (also: {NO_PIN_ENV}=1); the verdict will say so")
    p.add_argument("--allow-loaded", action="store_true",
                   help="keep figures measured on a loaded machine (they are marked LOADED) instead of refusing")


def pin_from_args(args: argparse.Namespace, console: Console | None = None) -> None:
    """Pin before the first computation, as the flags say (call it before loading the model)."""
    from jaxspec.core import measure

    positive("repeats", args.repeats)
    if args.no_pin or os.environ.get(NO_PIN_ENV, "") not in ("", "0"):
        return
    done = measure.pin_unless_gpu(args.core)
    if console is not None and done:
        console.print(f"measuring on core {done.get('core')}, single-threaded XLA (jaxspec.core.measure.pin)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """--temperature / --top-p / --accept / --seed: measure sampled decoding instead of greedy."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy, the default); AR and every spec alike")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (with --temperature)")
    p.add_argument("--accept", choices=("block", "residual", "target"), default=None,
                   help="the exact acceptance rule at temperature > 0 (default: block)")
    p.add_argument("--seed", type=int, default=0, help="rng seed of every sampled run")


def sampling_from_args(args: argparse.Namespace) -> Any:
    """-> `harness.eval.Sampled`, or None for greedy (--top-p / --accept without --temperature are errors)."""
    from jaxspec.harness.eval import Sampled

    if args.temperature == 0:
        if args.top_p is not None or args.accept is not None:
            raise ValueError("--top-p and --accept need --temperature > 0")
        return None
    return Sampled(args.temperature, args.top_p, args.accept, args.seed)


def add_mesh_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, metavar="D,T,E",
                   help="shard over a data,tensor,expert mesh, e.g. 1,8,1 (default: one device)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-host: process 0's address; run the same command on every host (jax.distributed)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of hosts")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this host's index")


def mesh_from_args(args: argparse.Namespace) -> Any:
    """Join the cluster (multi-host) and build the --mesh; None without --mesh."""
    from jaxspec import sharding

    if args.coordinator is not None or args.num_processes is not None or args.process_id is not None:
        sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return None if args.mesh is None else sharding.make_mesh(*sharding.parse_mesh(args.mesh))


# ---- the model loader -------------------------------------------------------------------------


@dataclasses.dataclass
class LoadedModel:
    cfg: Any  # ModelConfig
    params: Any  # ModelParams
    tokenizer: Any  # tokenizers.Tokenizer or None
    description: str
    draft: Any = None  # the Draft to speculate with (its calibration and tuning), None without one


def load_model(args: argparse.Namespace, console: Console | None = None, *, need_tokenizer: str | None = None,
               seed: int = 0, mesh: Any = None) -> LoadedModel:
    """The model of --checkpoint (cast to float32 on a CPU), else a random-init --preset.

    --checkpoint is a folder written by `save_checkpoint` (config.json + params/), or a DeepSeek-V4
    safetensors folder as released (config.json + *.safetensors, official or HF spelling, FP8 / FP4
    weights dequantized on load, or kept with --weights fp8; its tokenizer.json is read with HF
    `tokenizers`), loaded straight into `mesh` when one is given. `need_tokenizer` names the command
    for the error when a checkpoint without tokenizer.json (or no checkpoint) is given to a command
    that encodes text.
    """
    import jax

    from jaxspec.checkpoint import load_checkpoint, load_release
    from jaxspec.core.config import ModelConfig
    from jaxspec.model.network import abstract_params, init_params
    from jaxspec.ops.quant import is_quantized
    from jaxspec.speculation.drafter import Draft
    from jaxspec.speculation.mtp import MTPDrafter

    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is not None:
        if getattr(args, "preset", None) is not None:
            raise ValueError(f"--preset {args.preset} and --checkpoint both name the model: the checkpoint's config "
                             "is its own; pass one of them")
        path = os.path.expanduser(checkpoint)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint folder {checkpoint!r} does not exist")
        t0 = time.perf_counter()
        note = ""
        weights = getattr(args, "weights", "plain")
        is_release = any(f.endswith(".safetensors") for f in os.listdir(path))
        if weights == "fp8" and not is_release:
            raise ValueError(f"--weights fp8 keeps the FP8 / FP4 weights of a DeepSeek-V4 safetensors release; "
                             f"{checkpoint!r} is not one (no *.safetensors)")
        draft = getattr(args, "draft", None)
        if draft is not None and not os.path.isdir(os.path.join(path, "params")):
            raise ValueError(f"--draft {draft} selects a draft of a jaxspec checkpoint; {checkpoint!r} is not one")
        if os.path.isdir(os.path.join(path, "params")):
            # bf16 matmuls are slow on a CPU; checkpoints are stored in bf16 only for size
            dtype = "float32" if jax.default_backend() == "cpu" else None
            ckpt = load_checkpoint(path, draft=draft, dtype=dtype, cpu_experts=mesh is None)
            cfg, params, tokenizer, found = ckpt.cfg, ckpt.params, ckpt.tokenizer, ckpt.draft
            if draft is not None:
                note += f", draft {draft!r}"
            if dtype is not None:
                note += ", cast to float32 for the CPU"
        elif is_release:
            dtype = "float32" if jax.default_backend() == "cpu" else None
            release = load_release(path, dtype=dtype, mesh=mesh, weights=weights)
            cfg, params, tokenizer, found = release.cfg, release.params, release.tokenizer, release.draft
            note = f", DeepSeek-V4 safetensors, {cfg.dtype}" + (" on the mesh" if mesh is not None else "")
            if weights == "fp8":
                kept = [x for x in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(x)]
                note += f", {len(kept)} weights kept FP8 / FP4 ({', '.join(sorted({x.fmt for x in kept}))})"
        else:
            raise ValueError(f"checkpoint {checkpoint!r} has neither params/ (a jaxspec checkpoint) nor "
                             "*.safetensors (a DeepSeek-V4 release)")
        if need_tokenizer and tokenizer is None:
            raise ValueError(f"checkpoint {checkpoint!r} has no tokenizer.json; {need_tokenizer} encodes text prompts")
        return LoadedModel(cfg, params, tokenizer,
                           f"checkpoint {path} (loaded in {time.perf_counter() - t0:.1f} s{note})", found)
    if need_tokenizer:
        raise ValueError(f"{need_tokenizer} needs --checkpoint (a folder with tokenizer.json)")
    if getattr(args, "weights", "plain") == "fp8":
        raise ValueError("--weights fp8 keeps the FP8 / FP4 weights of a DeepSeek-V4 safetensors release: "
                         "pass --checkpoint")
    preset = getattr(args, "preset", None) or DEFAULT_PRESET
    cfg = ModelConfig.preset(preset)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(cfg)))
    if nbytes > MAX_RANDOM_INIT_BYTES:
        raise ValueError(
            f"preset {preset!r} needs {nbytes / 2**30:.0f} GiB of weights: too large for a random-init demo; "
            "pass --checkpoint or a smaller preset (test, tiny)"
        )
    params = init_params(cfg, jax.random.key(seed))
    return LoadedModel(cfg, params, None,
                       f"preset {preset!r}, [bold yellow]random init[/] (seed {seed}): output is noise",
                       None if params.mtp is None else Draft("default", MTPDrafter(), params.mtp))
