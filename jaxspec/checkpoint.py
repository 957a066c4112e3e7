"""Checkpoints: our own orbax format, and DeepSeek-V4 safetensors checkpoints (official or HF spelling).

Our format (`save_checkpoint` / `load_checkpoint`) is a folder holding `config.json`
(`dataclasses.asdict(ModelConfig)`), `params/` (an orbax PyTree checkpoint of `ModelParams`) and,
optionally, `tokenizer.json`.

`load_hf_checkpoint` reads a DeepSeek-V4 `config.json` plus `*.safetensors` shards in either
spelling:

* official (DeepSeek's release): `embed.weight`, `layers.{i}.attn.wq_a.weight`, `hc_head_fn`,
  `mtp.0.e_proj.weight`, ...
* HF (`DeepseekV4ForCausalLM.save_pretrained`): the same under `model.` (except `head.weight`),
  with `model.embed_tokens.weight` and `model.hc_head.hc_fn`; no MTP tensors.

Torch Linear weights are [out, in]; ours are [in, out] (x @ W), so matrices are transposed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import checkpoint_errors as errors
from jaxspec.config import DTYPES, ModelConfig
from jaxspec.model import ModelParams, init_params
from jaxspec.sharding.placement import param_shardings, sharded_abstract

_CONFIG = "config.json"
_TOKENIZER = "tokenizer.json"
_PARAMS = "params"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _abstract_params(cfg: ModelConfig) -> ModelParams:
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def _leaves_by_path(tree: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _check_structure(cfg: ModelConfig, params: Any) -> None:
    """ValueError unless `params` has exactly the structure, shapes and dtypes `cfg` implies."""
    expected = _abstract_params(cfg)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(expected):
        raise ValueError("params do not match the pytree structure implied by cfg")
    got = _leaves_by_path(params)
    for path, leaf in _leaves_by_path(expected).items():
        g = got[path]
        if tuple(g.shape) != tuple(leaf.shape) or jnp.dtype(g.dtype) != jnp.dtype(leaf.dtype):
            raise ValueError(
                f"params{path} has shape {tuple(g.shape)} dtype {g.dtype}, cfg implies "
                f"{tuple(leaf.shape)} {leaf.dtype}"
            )


def _place(x: np.ndarray, sharding: Any) -> jax.Array:
    """Host array -> device array (per-device slices under a sharding; default device without)."""
    if sharding is None:
        return jnp.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _cfg_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _cfg_from_json(data: dict[str, Any]) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"config.json has unknown ModelConfig fields {unknown}")
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


# ---------------------------------------------------------------------------------------------
# our orbax format
# ---------------------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: ModelParams, tokenizer: Any = None,
                    overwrite: bool = False) -> None:
    """Write cfg (JSON), params (orbax) and optionally a `tokenizers.Tokenizer` into folder `path`."""
    import orbax.checkpoint as ocp

    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    _check_structure(cfg, params)
    path = os.path.abspath(os.fspath(path))
    params_dir = os.path.join(path, _PARAMS)
    if os.path.exists(params_dir):
        if not overwrite:
            raise ValueError(f"checkpoint {path!r} already exists (pass overwrite=True to replace it)")
        import shutil

        shutil.rmtree(params_dir)
    os.makedirs(path, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(params_dir, params)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    with open(os.path.join(path, _CONFIG), "w") as f:
        json.dump(_cfg_to_json(cfg), f, indent=2)
    tok_path = os.path.join(path, _TOKENIZER)
    if tokenizer is not None:
        tokenizer.save(tok_path)
    elif os.path.exists(tok_path):
        os.remove(tok_path)


def load_checkpoint(
    path: str | os.PathLike, mesh: Any = None, rules: dict[str, Any] | None = None
) -> tuple[ModelConfig, ModelParams, Any]:
    """-> (cfg, params, tokenizer or None) from a folder written by `save_checkpoint`.

    With `mesh` (see `jaxspec.make_mesh`) every leaf is restored straight into its parameter
    sharding (`sharding.placement.param_shardings(cfg, mesh, rules)`): each device reads only its slice.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint folder {path!r} does not exist")
    cfg_path, params_dir = os.path.join(path, _CONFIG), os.path.join(path, _PARAMS)
    if not os.path.isfile(cfg_path) or not os.path.isdir(params_dir):
        raise ValueError(f"{path!r} is not a jaxspec checkpoint (needs {_CONFIG} and {_PARAMS}/)")
    data = errors.read_json(cfg_path)
    try:
        cfg = _cfg_from_json(data)
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{cfg_path} is not a jaxspec ModelConfig: {errors.one_line(e)}") from None
    abstract = _abstract_params(cfg)
    placed = abstract if mesh is None else sharded_abstract(abstract, param_shardings(cfg, mesh, rules))
    errors.check_orbax_metadata(params_dir)
    ckptr = ocp.StandardCheckpointer()
    failure = None
    try:
        _check_stored_arrays(ckptr, params_dir, abstract, path)
        params = ckptr.restore(params_dir, placed)
    except _MismatchError as e:
        failure = ValueError(str(e))
    except Exception as e:  # TensorStore / orbax: the first failed read ends the restore
        errors.quiet_orphaned_reads()
        failure = errors.damaged(params_dir, e)
    finally:
        ckptr.close()
    if failure is not None:
        # Raised out here, so it holds no reference to orbax's exception: the frames of the reads
        # still in flight are released now (finalized quietly), not at interpreter exit.
        errors.quiet_orphaned_reads()
        raise failure
    _check_structure(cfg, params)
    tokenizer = None
    tok_path = os.path.join(path, _TOKENIZER)
    if os.path.isfile(tok_path):
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(tok_path)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{tok_path} is damaged or not a tokenizer: {errors.one_line(e)}") from None
    return cfg, params, tokenizer


class _MismatchError(Exception):
    """config.json and the stored arrays disagree (raised as a ValueError by load_checkpoint)."""


def _check_stored_arrays(ckptr: Any, params_dir: str, abstract: ModelParams, path: str) -> None:
    """_MismatchError naming the first array whose name or shape config.json gets wrong (checked
    on orbax's metadata before any read; skipped where that metadata holds no shapes)."""
    read = getattr(ckptr, "metadata", None)
    with errors.quiet_absl_warnings():
        stored_tree = getattr(read(params_dir), "item_metadata", None) if callable(read) else None
    flat = jax.tree_util.tree_flatten_with_path(stored_tree)[0] if stored_tree is not None else []
    stored = {errors.dotted(p): tuple(x.shape) for p, x in flat if getattr(x, "shape", None) is not None}
    if not stored:
        return
    expected = {errors.dotted(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problem = errors.mismatch(expected, stored)
    if problem:
        raise _MismatchError(f"checkpoint {path}: config.json does not match its arrays: {problem}")


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 safetensors: key table
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
    ours: str  # keystr path of the leaf in ModelParams
    kind: str  # "T" (transpose), "copy", "wo_a", "int"
    slot: int | None = None  # expert index into a stacked [E, ...] leaf


def _to_ours(kind: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if kind == "T":
        return x.T
    if kind == "wo_a":  # [g*do, in] -> [g, in, do]
        g, _, do = shape
        return x.reshape(g, do, x.shape[-1]).transpose(0, 2, 1)
    return x


def _to_ckpt(kind: str, x: np.ndarray) -> np.ndarray:
    if kind == "T":
        return np.ascontiguousarray(x.T)
    if kind == "wo_a":  # [g, in, do] -> [g*do, in]
        g, i, do = x.shape
        return np.ascontiguousarray(x.transpose(0, 2, 1).reshape(g * do, i))
    if kind == "int":
        return x.astype(np.int64)
    return x


def _ckpt_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "T":
        return tuple(reversed(shape))
    if kind == "wo_a":
        g, i, do = shape
        return (g * do, i)
    return tuple(shape)


def _block_specs(ck: str, ours: str, kind: str, hash_routed: bool, cfg: ModelConfig) -> dict[str, _Spec]:
    s: dict[str, _Spec] = {}

    def add(key: str, path: str, how: str, slot: int | None = None) -> None:
        s[f"{ck}.{key}"] = _Spec(f"{ours}.{path}", how, slot)

    for name in ("wq_a", "wq_b", "wkv", "wo_b"):
        add(f"attn.{name}.weight", f"attn.{name}", "T")
    add("attn.wo_a.weight", "attn.wo_a", "wo_a")
    add("attn.q_norm.weight", "attn.q_norm", "copy")
    add("attn.norm.weight", "attn.kv_norm", "copy")
    add("attn.attn_sink", "attn.sink", "copy")
    comps = []
    if kind != "sliding":
        comps.append(("attn.compressor", "attn.compressor"))
    if kind == "csa":
        comps.append(("attn.indexer.compressor", "attn.indexer.compressor"))
        add("attn.indexer.wq_b.weight", "attn.indexer.wq_b", "T")
        add("attn.indexer.weights_proj.weight", "attn.indexer.weights_proj", "T")
    for c_ck, c_ours in comps:
        add(f"{c_ck}.wkv.weight", f"{c_ours}.wkv", "T")
        add(f"{c_ck}.wgate.weight", f"{c_ours}.wgate", "T")
        add(f"{c_ck}.ape", f"{c_ours}.ape", "copy")
        add(f"{c_ck}.norm.weight", f"{c_ours}.norm", "copy")
    add("attn_norm.weight", "attn_norm", "copy")
    add("ffn_norm.weight", "ffn_norm", "copy")
    for hc in ("attn", "ffn"):
        add(f"hc_{hc}_fn", f"hc_{hc}.fn", "T")
        add(f"hc_{hc}_base", f"hc_{hc}.base", "copy")
        add(f"hc_{hc}_scale", f"hc_{hc}.scale", "copy")
    add("ffn.gate.weight", "ffn.gate", "T")
    if hash_routed:
        add("ffn.gate.tid2eid", "ffn.tid2eid", "int")
    else:
        add("ffn.gate.bias", "ffn.gate_bias", "copy")
    for e in range(cfg.n_routed_experts):
        for w in ("w1", "w2", "w3"):
            add(f"ffn.experts.{e}.{w}.weight", f"ffn.experts.{w}", "T", e)
    if cfg.n_shared_experts:
        for w in ("w1", "w2", "w3"):
            add(f"ffn.shared_experts.{w}.weight", f"ffn.shared.{w}", "T")
    return s


def _key_table(cfg: ModelConfig) -> dict[str, _Spec]:
    """Official-spelling checkpoint key -> where it goes in ModelParams."""
    t: dict[str, _Spec] = {
        "embed.weight": _Spec(".embed", "copy"),
        "head.weight": _Spec(".head", "T"),
        "norm.weight": _Spec(".norm", "copy"),
        "hc_head_fn": _Spec(".hc_head.fn", "T"),
        "hc_head_base": _Spec(".hc_head.base", "copy"),
        "hc_head_scale": _Spec(".hc_head.scale", "copy"),
    }
    for i, kind in enumerate(cfg.layer_types):
        t.update(_block_specs(f"layers.{i}", f".layers[{i}]", kind, i < cfg.num_hash_layers, cfg))
    if cfg.has_mtp:
        t.update({
            "mtp.0.e_proj.weight": _Spec(".mtp.inputs.e_proj", "T"),
            "mtp.0.h_proj.weight": _Spec(".mtp.inputs.h_proj", "T"),
            "mtp.0.enorm.weight": _Spec(".mtp.inputs.enorm", "copy"),
            "mtp.0.hnorm.weight": _Spec(".mtp.inputs.hnorm", "copy"),
            "mtp.0.norm.weight": _Spec(".mtp.norm", "copy"),
            "mtp.0.hc_head_fn": _Spec(".mtp.hc_head.fn", "T"),
            "mtp.0.hc_head_base": _Spec(".mtp.hc_head.base", "copy"),
            "mtp.0.hc_head_scale": _Spec(".mtp.hc_head.scale", "copy"),
        })
        t.update(_block_specs("mtp.0", ".mtp.block", "sliding", False, cfg))
    return t


_HF_RENAMES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
)


def _normalize_key(key: str) -> str:
    """HF save_pretrained spelling -> official spelling (official keys pass through unchanged)."""
    if key.startswith("model."):
        key = key[len("model."):]
        for pattern, repl in _HF_RENAMES:
            key = pattern.sub(repl, key)
    return key


def _hf_key(key: str) -> str:
    """Official spelling -> HF save_pretrained spelling (MTP tensors keep the official form)."""
    if key == "head.weight" or key.startswith("mtp."):
        return key
    if key == "embed.weight":
        return "model.embed_tokens.weight"
    m = re.match(r"^hc_head_(fn|base|scale)$", key)
    if m:
        return f"model.hc_head.hc_{m.group(1)}"
    return "model." + key


# ---------------------------------------------------------------------------------------------
# safetensors reading
# ---------------------------------------------------------------------------------------------
_NUMPY_UNSUPPORTED = {"BF16", "F8_E4M3", "F8_E5M2"}


class _Shard:
    """One `.safetensors` file, opened lazily in numpy (and flax for bf16) mode. A truncated or
    malformed file is a one-line ValueError naming it (safetensors' own error names no file)."""

    def __init__(self, filename: str):
        self.filename = filename
        self._np = self._open("numpy")
        self._flax = None

    def _open(self, framework: str) -> Any:
        from safetensors import safe_open

        return self._read(lambda: safe_open(self.filename, framework=framework))

    def _read(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # safetensors_rust.SafetensorError, OSError, a failed mmap read
            if isinstance(e, MemoryError):
                raise
            raise ValueError(f"{self.filename} is truncated or not a safetensors file: {errors.one_line(e)}") from None

    def keys(self) -> list[str]:
        return self._read(lambda: list(self._np.keys()))

    def shape_dtype(self, key: str) -> tuple[tuple[int, ...], str]:
        sl = self._read(lambda: self._np.get_slice(key))
        return tuple(sl.get_shape()), sl.get_dtype()

    def get(self, key: str) -> np.ndarray:
        _, dtype = self.shape_dtype(key)
        if dtype not in _NUMPY_UNSUPPORTED:
            return self._read(lambda: self._np.get_tensor(key))
        if self._flax is None:
            self._flax = self._open("flax")
        return self._read(lambda: np.asarray(self._flax.get_tensor(key)))


def _open_shards(path: str) -> list[_Shard]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    return [_Shard(os.path.join(path, f)) for f in files]


def _default_dtype(config: dict[str, Any]) -> str:
    for k in ("dtype", "torch_dtype"):
        v = config.get(k)
        if isinstance(v, str) and v in DTYPES:
            return v
    return "float32"


def load_hf_checkpoint(
    path: str | os.PathLike, dtype: str | None = None, mesh: Any = None, rules: dict[str, Any] | None = None
) -> tuple[ModelConfig, ModelParams]:
    """Read a DeepSeek-V4 checkpoint folder (config.json + *.safetensors) -> (cfg, params).

    `dtype` ("float32" / "bfloat16") sets cfg.dtype, the dtype of the matrix weights (default: the
    config's `dtype` / `torch_dtype`, else float32); norms, hyper-connections, sinks, APE, gate
    biases and the compressor / indexer-weight projections stay fp32 as `init_params` lays out.
    A checkpoint without `mtp.*` tensors loads with num_mtp_layers=0 and params.mtp=None.
    Raises ValueError naming the tensor on a missing, unexpected or misshaped tensor.
    With `mesh`, each leaf goes to its devices (`sharding.placement.param_shardings`), each
    device receiving only its slice, as soon as it is complete; its host copy is then dropped.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint folder {path!r} does not exist")
    cfg_path = os.path.join(path, _CONFIG)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"checkpoint folder {path!r} has no {_CONFIG}")
    config = errors.read_json(cfg_path)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")
    shards = _open_shards(path)

    # Pass 1: headers only -> normalized key -> (shard, original key).
    where: dict[str, tuple[_Shard, str]] = {}
    for shard in shards:
        for key in shard.keys():
            norm = _normalize_key(key)
            if norm in where:
                raise ValueError(
                    f"tensor {key!r} ({shard.filename}) duplicates {where[norm][1]!r} ({where[norm][0].filename})"
                )
            where[norm] = (shard, key)
    has_mtp = any(k.startswith("mtp.") for k in where)
    cfg = ModelConfig.from_hf_config(
        config, num_mtp_layers=1 if has_mtp else 0, dtype=dtype or _default_dtype(config)
    )
    table = _key_table(cfg)
    abstract = _abstract_params(cfg)
    leaves = _leaves_by_path(abstract)
    covered = {s.ours for s in table.values()}
    if covered != set(leaves):  # internal consistency of the key table
        raise AssertionError(f"key table mismatch: {sorted(covered ^ set(leaves))}")

    for norm, (shard, key) in sorted(where.items()):
        if norm not in table:
            raise ValueError(f"unexpected tensor {key!r} in {shard.filename} (not part of this model config)")
    missing = sorted(where_key for where_key in table if where_key not in where)
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in {path!r} ({len(missing)} missing in all)")

    # Pass 2: stream tensors one at a time into their (host) leaves.
    out: dict[str, np.ndarray] = {}
    shardings: dict[str, Any] = {}
    if mesh is not None:
        shardings = _leaves_by_path(param_shardings(cfg, mesh, rules))
    remaining = collections.Counter(s.ours for s in table.values())
    placed: dict[str, Any] = {}
    for norm, spec in table.items():
        shard, key = where[norm]
        leaf = leaves[spec.ours]
        shape = tuple(leaf.shape) if spec.slot is None else tuple(leaf.shape[1:])
        want = _ckpt_shape(spec.kind, shape)
        got, st_dtype = shard.shape_dtype(key)
        if got != want:
            raise ValueError(f"tensor {key!r} has shape {list(got)}, expected {list(want)} from config.json "
                             f"({shard.filename})")
        if st_dtype.startswith("F8"):
            raise ValueError(f"tensor {key!r} is {st_dtype}: FP8-quantised checkpoints are not supported")
        x = _to_ours(spec.kind, shard.get(key), shape).astype(leaf.dtype)
        if spec.kind == "int":
            bad = (x < 0) | (x >= cfg.n_routed_experts)
            if bad.any():
                raise ValueError(f"tensor {key!r} holds expert ids outside [0, {cfg.n_routed_experts})")
        if spec.slot is None:
            out[spec.ours] = x
        else:
            if spec.ours not in out:
                out[spec.ours] = np.empty(leaf.shape, leaf.dtype)
            out[spec.ours][spec.slot] = x
        remaining[spec.ours] -= 1
        if not remaining[spec.ours]:
            placed[spec.ours] = _place(out.pop(spec.ours), shardings.get(spec.ours))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    params = jax.tree_util.tree_unflatten(
        treedef, [placed[jax.tree_util.keystr(p)] for p, _ in flat]
    )
    return cfg, params


# ---------------------------------------------------------------------------------------------
# safetensors writing
# ---------------------------------------------------------------------------------------------
_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
}


def _st_dtype(a: np.ndarray) -> str:
    if a.dtype == jnp.bfloat16:
        return "BF16"
    if a.dtype in _ST_DTYPES:
        return _ST_DTYPES[a.dtype]
    raise ValueError(f"unsupported dtype {a.dtype} for safetensors")


def _write_safetensors(filename: str, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (handles bfloat16 via ml_dtypes without torch)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k, a in tensors.items():
        n = a.nbytes
        header[k] = {"dtype": _st_dtype(a), "shape": list(a.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(filename, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def _official_config(cfg: ModelConfig) -> dict[str, Any]:
    c = cfg.to_hf_config()
    del c["layer_types"], c["compress_rates"]
    c["compress_ratios"] = [cfg.ratio(i) for i in range(cfg.num_layers)] + [0] * cfg.num_mtp_layers
    c["compress_rate_csa"] = cfg.csa_ratio
    c["compress_rate_hca"] = cfg.hca_ratio
    return c


def _iter_ckpt_tensors(cfg: ModelConfig, params: ModelParams) -> Iterator[tuple[str, np.ndarray]]:
    leaves = _leaves_by_path(params)
    for key, spec in _key_table(cfg).items():
        x = np.asarray(leaves[spec.ours])
        if spec.slot is not None:
            x = x[spec.slot]
        yield key, _to_ckpt(spec.kind, x)


def save_hf_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: ModelParams, spelling: str = "official",
                       max_shard_bytes: int | None = None) -> None:
    """Inverse of `load_hf_checkpoint`: config.json + model(-0000k-of-0000n).safetensors in `path`.

    spelling "official" writes DeepSeek's names and the `compress_ratios` config; "hf" writes the
    names of `DeepseekV4ForCausalLM.save_pretrained` and the `layer_types` config (MTP tensors, which
    transformers does not model, keep the official `mtp.0.*` names).
    """
    if spelling not in ("official", "hf"):
        raise ValueError(f"spelling must be 'official' or 'hf', got {spelling!r}")
    _check_structure(cfg, params)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    rename: Callable[[str], str] = (lambda k: k) if spelling == "official" else _hf_key
    config = _official_config(cfg) if spelling == "official" else cfg.to_hf_config()
    config["dtype"] = cfg.dtype
    if cfg.bos_id is not None:
        config["bos_token_id"] = cfg.bos_id
    if cfg.eos_id is not None:
        config["eos_token_id"] = cfg.eos_id
    with open(os.path.join(path, _CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, x in _iter_ckpt_tensors(cfg, params):
        if max_shard_bytes is not None and size and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][rename(key)] = x
        size += x.nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, tensors in zip(names, shards, strict=True):
        _write_safetensors(os.path.join(path, name), tensors)
    if n > 1:
        index = {"metadata": {}, "weight_map": {k: name for name, t in zip(names, shards, strict=True) for k in t}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
