"""What the commands that print a speed share: the `--spec` argument (checked before any model
work, `auto` resolved from the draft's tune.json), the tuner's own measurement of a spec, the clock
that separates compile time from generation time, and the sentence on why a CPU gain is small."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

UNTUNED_SPEC = "s3_k2_d6"  # what `auto` runs when the draft has no (readable) tune.json
NO_SPEC = ("none", "ar")


def check_spec_arg(text: str) -> str:
    """--spec as given, checked at once: "auto", "none" / "ar", or a spec name (ValueError naming the
    allowed forms otherwise), so a typo fails before the model loads."""

    from jaxspec.speculation.auto import split_choice

    name = str(text).strip()
    if name.lower() in ("auto", *NO_SPEC):
        return name.lower()
    try:
        split_choice(name)
    except ValueError as e:
        raise ValueError(f"--spec {text!r}: {e}; or 'auto' (the checkpoint's tune.json) or 'none' (no "
                         "speculation)") from None
    return name


@dataclasses.dataclass
class Choice:
    """The spec a run uses (None: autoregressive only), where it came from, and what `jaxspec tune`
    measured for it on this checkpoint (its tune.json row at the nearest batch bucket, or None)."""

    spec: Any  # SpecConfig | None
    how: str
    tuned: dict[str, Any] | None = None
    best_tuned: dict[str, Any] | None = None  # the tuner's fastest speculative row at that bucket
    draft: Any = None  # the Draft to run the spec with (one of a DraftSet's; None: the model's draft)


def _bucket(tuning: Any, batch: int) -> int:
    return min(tuning.choices, key=lambda b: (abs(math.log2(b) - math.log2(batch)), b))


def tuned_rows(tuning: Any, name: str | None, batch: int) -> tuple[dict | None, dict | None]:
    """(the tune.json measurement of spec `name` at the bucket nearest `batch`, the fastest
    speculative one there); None where the tuning has none."""
    if tuning is None or not getattr(tuning, "measurements", None):
        return None, None
    bucket = _bucket(tuning, batch)
    rows = [m for m in tuning.measurements if int(m.get("batch", -1)) == bucket and m.get("spec") != "ar"
            and "ratio_vs_ar" in m]
    row = next((m for m in rows if m.get("spec") == name), None)
    best = max(rows, key=lambda m: m["ratio_vs_ar"], default=None)
    return row, best


def choose_spec(arg: str, draft: Any, batch: int) -> Choice:
    """The spec of `--spec arg` (checked by `check_spec_arg`) for `batch` prompts with `draft`."""
    from jaxspec.core.spec import SpecConfig
    from jaxspec.speculation.drafter import DraftSet, Unreadable

    if arg in NO_SPEC:
        return Choice(None, "--spec none: autoregressive only")
    if isinstance(draft, DraftSet):
        return _choose_among(arg, draft, batch)
    if draft is None:
        if arg == "auto":
            return Choice(None, "no draft (no MTP block): autoregressive only")
        raise ValueError(f"--spec {arg}: this model has no draft (no MTP block) to speculate with; pass --spec none")
    tuning = draft.tuning
    if isinstance(tuning, Unreadable):
        tuning = None
    if "/" in arg:
        raise ValueError(f"--spec {arg} names a draft: pass --draft all to choose among drafts, or --draft NAME and "
                         f"--spec {arg.rpartition('/')[2]}")
    if arg != "auto":
        spec = SpecConfig.parse(arg)
        return Choice(spec, f"--spec {spec.name}", *tuned_rows(tuning, spec.name, batch))
    if draft.tuning is None or isinstance(draft.tuning, Unreadable):
        why = ("has no tune.json" if draft.tuning is None
               else f"has an unreadable tune.json ({draft.tuning.path}: {draft.tuning.error})")
        return Choice(SpecConfig.parse(UNTUNED_SPEC),
                      f"--spec auto: the draft {why}; running the untuned {UNTUNED_SPEC} (`jaxspec tune` chooses "
                      "per batch size)")
    bucket = _bucket(tuning, batch)
    spec = tuning.spec_for(batch)
    if spec is None:
        return Choice(None, f"--spec auto: tune.json chose no speculation for batch {batch} (bucket {bucket}): "
                      "autoregressive measured fastest there", *tuned_rows(tuning, None, batch))
    return Choice(spec, f"--spec auto: tune.json chose {spec.name} for batch {batch} (its bucket {bucket})",
                  *tuned_rows(tuning, spec.name, batch))


def _choose_among(arg: str, drafts: Any, batch: int) -> Choice:
    """The draft and spec of --draft all: --spec names both, or auto takes drafts/tune.json's choice."""
    from jaxspec.speculation.auto import split_choice
    from jaxspec.speculation.drafter import Unreadable

    tuning = None if isinstance(drafts.tuning, Unreadable) else drafts.tuning
    if arg != "auto":
        name, spec = split_choice(arg)
        if name is None:
            raise ValueError(f"--draft all holds drafts {', '.join(drafts.names)}: --spec names the one to run "
                             f"({drafts.names[-1]}/{spec.name}), or auto")
        return Choice(spec, f"--spec {arg}", *tuned_rows(tuning, arg, batch), draft=drafts[name])
    if tuning is None:
        why = ("has no drafts/tune.json" if drafts.tuning is None
               else f"has an unreadable drafts/tune.json ({drafts.tuning.path}: {drafts.tuning.error})")
        raise ValueError(f"--spec auto with --draft all: the checkpoint {why}; run `jaxspec tune --draft all` or "
                         "name a draft and spec (--spec dspark/s5_k1_d6)")
    bucket, chosen = _bucket(tuning, batch), tuning.name_for(batch)
    name, spec = split_choice(chosen)
    if spec is None:
        return Choice(None, f"--spec auto: drafts/tune.json chose no speculation for batch {batch} (bucket "
                      f"{bucket}): autoregressive measured fastest there", *tuned_rows(tuning, None, batch))
    if name is None:
        raise ValueError("drafts/tune.json chose among one draft's specs; rerun `jaxspec tune --draft all`")
    return Choice(spec, f"--spec auto: drafts/tune.json chose {chosen} for batch {batch} (its bucket {bucket})",
                  *tuned_rows(tuning, chosen, batch), draft=drafts[name])


def cpu_note(choice: Choice, measured: float | None = None) -> str:
    """One sentence: why speculation gains little on a CPU, with the ratio `jaxspec tune` measured
    for this checkpoint (and, when given, the ratio this run measured)."""
    name = choice.spec.name if choice.spec is not None else "speculation"
    if choice.tuned is not None:
        row = choice.tuned
        tuner = (f"`jaxspec tune` measured {name} at {row['ratio_vs_ar']:.2f}x AR on this checkpoint (batch "
                 f"{row['batch']}, tau {row.get('tau', float('nan')):.2f}, pinned quiet core)")
    elif choice.best_tuned is not None:
        row = choice.best_tuned
        tuner = (f"`jaxspec tune` never measured {name} here; its best at batch {row['batch']} was {row['spec']} at "
                 f"{row['ratio_vs_ar']:.2f}x AR")
    else:
        tuner = "this draft has no tune.json measurements to compare with (`jaxspec tune` makes them)"
    here = "" if measured is None else f"this run measured {measured:.2f}x; "
    return (f"Why the gain is small on a CPU: a cycle of draft steps plus a verify of D tokens costs several AR "
            f"steps here (the verify reads every expert, about twice an AR step's bytes, at CPU matmul speed), so "
            f"only the accepted tokens beyond that cost are gain: {here}{tuner}; on a GPU, where a decode step is "
            f"memory-bound, a D-token verify costs about one AR step (docs/speed.md).")


class CompileClock:
    """`with CompileClock() as clock:` -> `clock.seconds`: wall time jax spent tracing, lowering and
    compiling (or loading from the persistent compilation cache) inside the block, overlapping
    spans counted once; `clock.programs` backend compiles, `clock.cache_hits` of them loaded."""

    SPANS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
             "/jax/core/compile/backend_compile_duration")

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.programs = 0
        self.cache_hits = 0
        self.wall = 0.0

    def _span(self, event: str, start: float, end: float, **_: Any) -> None:
        if event in self.SPANS:
            self.spans.append((start, end))
            self.programs += event == self.SPANS[-1]

    def _event(self, event: str, **_: Any) -> None:
        self.cache_hits += event == "/jax/compilation_cache/cache_hits"

    def __enter__(self) -> CompileClock:
        from jax import monitoring

        monitoring.register_event_time_span_listener(self._span)
        monitoring.register_event_listener(self._event)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        from jax import monitoring

        self.wall += time.perf_counter() - self._start
        monitoring.unregister_event_time_span_listener(self._span)
        monitoring.unregister_event_listener(self._event)

    @property
    def seconds(self) -> float:
        total, end = 0.0, -math.inf
        for a, b in sorted(self.spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    def describe(self) -> str:
        """`12.3 s (4 programs, 3 from the compile cache)`."""
        cached = f", {self.cache_hits} from the compile cache" if self.cache_hits else ""
        return f"{self.seconds:.1f} s ({self.programs} program{'s' if self.programs != 1 else ''}{cached})"
