"""The tree speculation shape, `SpecConfig` (`sS_kK_dD`), and the choices it names (SCORES,
VALUE_SOURCES, CHILDREN). Frozen and hashable: a static argument of `jax.jit`."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from jaxspec.core.checks import positive_int

if TYPE_CHECKING:
    from jaxspec.core.config import ModelConfig

SCORES = ("auto", "calibrated", "draft")
VALUE_SOURCES = ("draft", "confidence", "both")
VALUE_SUFFIXES = {"draft": "", "confidence": "_vc", "both": "_vb"}  # the spec name's mark of its value source
# how a sampled draft's K children are drawn: "gumbel", K draws without replacement (Gumbel-top-K); "greedy",
# the greedy draft set: the draft's argmax, then draws without replacement from the rest (spec suffix "_gs")
CHILDREN = ("gumbel", "greedy")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Tree speculation shape, named `sS_kK_dD` as in the DeepSeek-V4 report.

    num_steps S: MTP draft steps (tree depth); topk K: children per expanded node (K = 1 is the
    linear chain); num_draft_tokens D: tokens the target verifies per cycle, root included.
    scores: what drafting and pruning rank candidates by (speculation/values.py): "calibrated" node values,
    "draft" (raw draft log-probs), or "auto" (calibrated where the params have a calibration).
    widths: width chosen per cycle (speculation/cycle.py `choose_width`): the compiled verify widths,
    ascending, the last = D; each cycle verifies the nodes whose path value (P(the walk reaches them)) is
    at least width_threshold, in the smallest width that holds them. () verifies all D every cycle.
    values: a node's value feature, "draft" (its draft probability), "confidence" (a drafter's
    confidence head; name suffix "_vc") or "both" (a calibration over the two together; suffix "_vb");
    speculation/tree.py `Expander`.
    children: how a sampled draft (temperature > 0) draws a node's children (CHILDREN; "greedy" is suffix
    "_gs", trees only): speculation/sampled.py, docs/block_verification.md.
    """

    num_steps: int
    topk: int
    num_draft_tokens: int
    scores: str = "auto"
    widths: tuple[int, ...] = ()
    width_threshold: float = 0.1
    values: str = "draft"
    children: str = "gumbel"

    def __post_init__(self):
        for name in ("num_steps", "topk", "num_draft_tokens"):
            positive_int(name, getattr(self, name))
        s, k, d = self.num_steps, self.topk, self.num_draft_tokens
        if self.scores not in SCORES:
            raise ValueError(f"scores must be one of {', '.join(SCORES)}, got {self.scores!r}")
        widths = tuple(self.widths)
        if widths and (any(not isinstance(w, int) or isinstance(w, bool) or w < 2 for w in widths)
                       or list(widths) != sorted(set(widths)) or widths[-1] != d):
            raise ValueError(f"widths must be ascending integers >= 2 ending at num_draft_tokens={d}, got {widths}")
        object.__setattr__(self, "widths", widths)
        if self.values not in VALUE_SOURCES:
            raise ValueError(f"values must be one of {', '.join(VALUE_SOURCES)}, got {self.values!r}")
        if self.children not in CHILDREN:
            raise ValueError(f"children must be one of {', '.join(CHILDREN)}, got {self.children!r}")
        if self.greedy_set and self.topk < 2:
            raise ValueError("the greedy draft set (children='greedy', suffix '_gs') needs topk >= 2: a chain's one "
                             "child is a draw from the draft, never its argmax")
        if not 0.0 < self.width_threshold < 1.0:
            raise ValueError(f"width_threshold must be in (0, 1), got {self.width_threshold}")
        if d < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (the root plus at least one draft), got {d}")
        if s > d - 1:
            unreached = f"depth {s}" if s == d else f"depths {d}..{s}"
            raise ValueError(
                f"s{s}_k{k}_d{d} drafts {unreached} that no cycle can verify: {d} tokens (the root and {d - 1} "
                f"drafts) reach depth {d - 1} at most; num_steps must be in 1..{d - 1} for num_draft_tokens={d}"
            )
        if k == 1 and d != s + 1:
            raise ValueError(
                f"topk=1 is the linear chain: num_draft_tokens must equal num_steps + 1 = {s + 1}, got {d}"
            )
        if d > self.max_draft_tokens:
            raise ValueError(
                f"num_draft_tokens={d} exceeds what s{s}_k{k} can draft: allowed 2..{self.max_draft_tokens} "
                f"(1 + topk + (num_steps-1)*topk^2)"
            )

    @property
    def greedy_set(self) -> bool:
        """Sampled children drawn as the greedy draft set (`children == "greedy"`)."""
        return self.children == "greedy"

    @property
    def max_draft_tokens(self) -> int:
        return 1 + self.topk + (self.num_steps - 1) * self.topk**2

    @property
    def name(self) -> str:
        base = f"s{self.num_steps}_k{self.topk}_d{self.num_draft_tokens}"
        base += "_w" + ".".join(str(w) for w in self.widths[:-1]) if len(self.widths) > 1 else ""
        return base + VALUE_SUFFIXES[self.values] + ("_gs" if self.greedy_set else "")

    @classmethod
    def parse(cls, name: str) -> SpecConfig:
        """'s15_k2_d16', 's15_k2_d16_w4.8' for widths (4, 8, 16) chosen per cycle, '_vc' valued by confidence,
        '_vb' by both (draft probability and confidence), '_gs' sampled children as the greedy draft set."""
        match = re.fullmatch(r"s(\d+)_k(\d+)_d(\d+)(?:_w(\d+(?:\.\d+)*))?(_vc|_vb)?(_gs)?", str(name).strip())
        if not match:
            raise ValueError(f"spec name must look like 's3_k2_d6' (steps, topk, draft tokens) or 's15_k2_d16_w4.8' "
                             f"(per-cycle widths), got {name!r}")
        s, k, d = (int(g) for g in match.groups()[:3])
        widths = () if match.group(4) is None else (*(int(w) for w in match.group(4).split(".")), d)
        values = {suffix: source for source, suffix in VALUE_SUFFIXES.items()}[match.group(5) or ""]
        return cls(s, k, d, widths=widths, values=values, children="greedy" if match.group(6) else "gumbel")

    def validate_for(self, cfg: ModelConfig) -> None:
        """What the target fixes; what the draft fixes is its drafter's `check`."""
        if self.topk > cfg.vocab_size:
            raise ValueError(f"topk={self.topk} exceeds vocab_size={cfg.vocab_size}")
