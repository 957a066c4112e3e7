"""DSpark's static config (docs/dspark.md, "What a release holds"): the block drafter shipped in V4 checkpoints
since June 2026 (`mtp.0/1/2.*` beside the target). Frozen and hashable: a static jit argument."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.core.checks import is_int, positive_int
from jaxspec.core.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """block_size: query slots per pass, [anchor, noise x (block_size - 1)] (V4: 5); noise_token_id:
    the vocabulary id that fills the noise slots (V4: 128799); target_layers: target layers whose
    output streams, averaged over hc, are the context rows (V4-Flash: 40, 41, 42), strictly
    increasing (V4.1: the layers whose *inputs* are tapped, 37, 38, 39); markov_rank: rank r of the
    Markov head (V4-Flash: 256); num_stages: draft blocks; n_routed_experts / num_experts_per_tok: the
    stages' MoE (V4.1-Flash: 128, top-3), None: the target's."""

    block_size: int
    noise_token_id: int
    target_layers: tuple[int, ...]
    markov_rank: int
    num_stages: int = 3
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None

    def __post_init__(self):
        positive_int("block_size", self.block_size)
        positive_int("markov_rank", self.markov_rank)
        positive_int("num_stages", self.num_stages)
        for name in ("n_routed_experts", "num_experts_per_tok"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if (self.n_routed_experts is not None and self.num_experts_per_tok is not None
                and self.num_experts_per_tok > self.n_routed_experts):
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be <= n_routed_experts="
                             f"{self.n_routed_experts}")
        if not is_int(self.noise_token_id) or self.noise_token_id < 0:
            raise ValueError(f"noise_token_id must be an int >= 0, got {self.noise_token_id!r}")
        layers = self.target_layers
        if (not isinstance(layers, tuple) or not layers or not all(is_int(i) and i >= 0 for i in layers)
                or list(layers) != sorted(set(layers))):
            raise ValueError(f"target_layers must be a non-empty tuple of increasing layer ids >= 0, got {layers!r}")

    def stage_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config a stage's block runs under: the target's, with the stages' own MoE size."""
        return cfg.replace(n_routed_experts=self.n_routed_experts or cfg.n_routed_experts,
                           num_experts_per_tok=self.num_experts_per_tok or cfg.num_experts_per_tok)

    def validate_for(self, cfg: ModelConfig) -> None:
        """ValueError unless this draft fits the target `cfg` (its layers and vocabulary)."""
        if self.target_layers[-1] >= cfg.num_layers:
            raise ValueError(f"target_layers {self.target_layers} must be < the target's num_layers={cfg.num_layers}")
        if self.noise_token_id >= cfg.vocab_size:
            raise ValueError(f"noise_token_id={self.noise_token_id} must be < vocab_size={cfg.vocab_size}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], num_stages: int, markov_rank: int | None = None) -> DSparkConfig:
        """From config.json's flat `dspark_*` keys; `markov_rank` (from the weights) when the config has none."""
        missing = [k for k in ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids")
                   if config.get(k) is None]
        if missing:
            raise ValueError(f"config.json of a DSpark checkpoint is missing {missing}")
        rank = config.get("dspark_markov_rank", markov_rank)
        layers = config["dspark_target_layer_ids"]
        return cls(
            block_size=config["dspark_block_size"],
            noise_token_id=config["dspark_noise_token_id"],
            target_layers=tuple(layers) if isinstance(layers, (list, tuple)) else layers,
            markov_rank=rank,
            num_stages=num_stages,
            n_routed_experts=config.get("dspark_n_routed_experts"),
            num_experts_per_tok=config.get("dspark_num_experts_per_tok"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The flat `dspark_*` keys of config.json (the stage count lives in the weights)."""
        return {"dspark_block_size": self.block_size, "dspark_noise_token_id": self.noise_token_id,
                "dspark_target_layer_ids": list(self.target_layers), "dspark_markov_rank": self.markov_rank,
                **({"dspark_n_routed_experts": self.n_routed_experts} if self.n_routed_experts else {}),
                **({"dspark_num_experts_per_tok": self.num_experts_per_tok} if self.num_experts_per_tok else {})}
