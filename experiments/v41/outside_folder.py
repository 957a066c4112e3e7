"""A V4.1 folder written by another project, loaded by jaxspec and by mlx-vlm 0.7.10 (the oracle), and their
prefill logits compared (docs/v41.md, "A folder built elsewhere").

The folder is read as it is by `jaxspec.load_release`. Two things are laid beside it, in a scratch folder of
links, and said in the output: `--token-map` (a JSON list, or a dict holding `token_map`) becomes
`engram_token_map.json` when the folder has none (a release derives its Engram classes from tokenizer.json;
a tiny folder's tokenizer need not give the config's class count), and mlx-vlm, which reads only the
release's config names, is given the folder's config.json rewritten in them (`core.v41.v41_text_config`:
names only, no value changes). mlx-vlm loads non-strictly when the folder lacks tensors the text model never
reads (`gate.bias_vl`, image spans only); the missing names are listed. Prompts never hold the config's
`image_token_id` (mlx-vlm reads it as an image span; jaxspec runs text only).

Each variant is the folder's config with `--variant KEY=VALUE,...` changes (none: as built), run with the
activation QAT roundings on (the release's) and off, on both sides alike; beside each, jaxspec's Pallas kernel
paths against its jnp paths on the same folder (the same math in another summation order).

    python experiments/v41/outside_folder.py --folder FOLDER [--token-map FILE] \\
        --variant "" --variant candidate_topk_blocks=3 --seeds 0,1,2 --out results/v41/outside_folder.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _census(folder: str) -> dict:
    from jaxspec.checkpoint.safetensors_io import open_folder

    tensors = open_folder(folder).tensors
    return {"tensors": len(tensors), "dtypes": dict(Counter(str(t.dtype) for t in tensors.values())),
            "index_file": os.path.isfile(os.path.join(folder, "model.safetensors.index.json")),
            "mtp_stages": len({k.split(".")[1] for k in tensors if k.startswith("mtp.")})}


def _views(folder: str, scratch: str, config: dict, token_map: list | None) -> tuple[str, str, list[str]]:
    """Link folders for jaxspec (the folder's config) and mlx-vlm (the release's names) -> paths, notes."""
    from jaxspec.core.v41 import v41_text_config

    ours, theirs = os.path.join(scratch, "jaxspec"), os.path.join(scratch, "mlx")
    notes = []
    for d in (ours, theirs):
        os.makedirs(d)
        for name in os.listdir(folder):
            if name != "config.json":
                os.symlink(os.path.join(folder, name), os.path.join(d, name))
        if token_map is not None:
            with open(os.path.join(d, "engram_token_map.json"), "w") as f:
                json.dump(token_map, f)
    with open(os.path.join(ours, "config.json"), "w") as f:
        json.dump(config, f)
    renamed = dict(config, text_config=v41_text_config(config))
    with open(os.path.join(theirs, "config.json"), "w") as f:
        json.dump(renamed, f)
    added = sorted(set(renamed["text_config"]) - set(config["text_config"]))
    notes.append(f"mlx-vlm's config.json adds the release spellings {added}")
    return ours, theirs, notes


def _compare(got: np.ndarray, want: np.ndarray) -> dict:
    scale = np.max(np.abs(want))
    per_pos = np.max(np.abs(got - want), axis=-1) / scale  # [B, S]
    off = np.nonzero((per_pos > 1e-3).any(axis=0))[0]
    return {"max_rel_err": float(per_pos.max()), "argmax_agree": float(np.mean(got.argmax(-1) == want.argmax(-1))),
            "first_position_over_1e-3": int(off[0]) if len(off) else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--token-map", default=None, help="JSON list or {'token_map': [...]} for engram_token_map.json")
    ap.add_argument("--variant", action="append", default=None, help="KEY=VALUE,... of text_config ('' as built)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seeds", default="0", help="token draws, comma-separated numpy seeds (one program serves all)")
    ap.add_argument("--out", default="results/v41/outside_folder.json")
    args = ap.parse_args()

    import jax.numpy as jnp
    from mlx.utils import tree_flatten
    from mlx_v41_oracle import load_v41, run_v41
    from mlx_vlm.models.deepseek_v41 import fakequant as mlx_fakequant

    import jaxspec as js
    from jaxspec.model import network

    folder = os.path.abspath(args.folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    token_map = None
    if args.token_map and not os.path.exists(os.path.join(folder, "engram_token_map.json")):
        with open(args.token_map) as f:
            token_map = json.load(f)
        token_map = token_map["token_map"] if isinstance(token_map, dict) else token_map
    runs = []
    for variant in args.variant or [""]:
        changes = {k: json.loads(v) for k, v in (item.split("=") for item in variant.split(",") if item)}
        text = dict(config["text_config"], **changes)
        with tempfile.TemporaryDirectory() as scratch:
            ours, theirs, notes = _views(folder, scratch, dict(config, text_config=text), token_map)
            ck = js.load_release(ours, dtype="float32")
            cfg = ck.cfg
            image = config.get("image_token_id", text.get("image_token_id"))
            ids = np.array([i for i in range(cfg.vocab_size) if i != image])
            try:
                model, missing = load_v41(theirs), []
            except ValueError:
                model = load_v41(theirs, strict=False)
                missing = sorted({k.split(".", 3)[-1] for k, _ in tree_flatten(model.parameters()) if "bias_vl" in k})
            for seed, qat in ((s, q) for s in map(int, args.seeds.split(",")) for q in (True, False)):
                tokens = ids[np.random.default_rng(seed).integers(0, len(ids), (2, args.tokens))].astype(np.int32)
                run_cfg = cfg.replace(v41=dataclasses.replace(cfg.v41, qat=qat))
                got = np.asarray(network.one_shot_logits(ck.params, run_cfg, jnp.asarray(tokens)))
                mlx_fakequant.DISABLE = not qat
                want = run_v41(model, tokens)
                # jaxspec against itself, the same math in another order (the Pallas kernels' paths): how far
                # the QAT roundings carry a last-bit difference on these weights
                kernels = np.asarray(network.one_shot_logits(ck.params, run_cfg.replace(kernels="pallas"),
                                                             jnp.asarray(tokens)))
                runs.append({"variant": changes, "seed": seed, "qat": qat, **_compare(got, want),
                             "jaxspec_kernels_vs_jnp": _compare(kernels, got)})
                print(runs[-1])
            mlx_fakequant.DISABLE = False
    out = {
        "folder": os.path.basename(folder),
        "files_sha256": {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
                         for n in sorted(os.listdir(folder))},
        "census": _census(folder),
        "notes": notes + ([f"engram_token_map.json from {os.path.basename(args.token_map)} "
                           f"({max(token_map) + 1} classes)"] if token_map else []),
        "mlx_missing_params": missing, "layer_types": list(cfg.layer_types),
        "engram_layers": list(cfg.v41.engram_layers),
        "draft_stages": None if ck.draft is None else ck.draft.drafter.config.num_stages,
        "tokens": list(tokens.shape), "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
