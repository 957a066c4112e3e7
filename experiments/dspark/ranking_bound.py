"""How much of the whole beam's tau a ranking of its nodes can reach from what the draft knows.

Reads two `beam_dump.py` dumps (train prompts to fit on, held-out prompts to score) of the beam a D = 8
tree prunes from (s7_k2_d27_vb: 26 candidates, every one verified), and prunes each held-out cycle's
beam to 7 nodes + the root by each ranking, counting the accepted path's nodes it keeps (exact for that
cycle: an ancestor-closed subset of the beam accepts exactly the accepted path's nodes it holds):

- chain: the top-1 path (what the DSpark chain s7_k1_d8 verifies, on this beam's cycles);
- vb: the shipped "both" values (the beam's own scores: products of calibrated conditionals);
- recalibrated: a logistic model of P(node right | parent accepted) over the vb value, the number of
  off-chain ancestors, the steps since the last one, the node's rank, depth, q_r, q_0 and sigma(c),
  fitted on the train beam's nodes (the shipped map is fitted on chain nodes only, so a node under a
  sibling branch is extrapolated);
- learned: a 2 x 64 MLP predicting P(node on the accepted path) directly from every ancestor's rank,
  q_r, q_0, q_1 and sigma(c), the node's depth, vb score and off-chain count (+ the sequence's mean
  acceptance so far, "learned + context");
- learned from hidden rows: a 2 x 64 MLP of P(node right | parent accepted) from what the confidence
  head reads (the drafter's hidden row at the slot, W1 of the parent token) and the node's own features
  above, the sequence's context included: a far stronger confidence head than the shipped linear one;
- perfect confidence: knows whether each slot's top child is right, not which sibling is (values the
  siblings of a wrong top child by their measured rate);
- oracle: keep the accepted path (the whole beam's tau).

    python experiments/dspark/ranking_bound.py --train /tmp/beam_train.npz --heldout /tmp/beam_heldout.npz
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

BUDGET = 7  # drafted nodes a D = 8 tree verifies besides the root


def load(path: str) -> dict[str, np.ndarray]:
    """A dump flattened to one row per (sequence, cycle), with each node's path features."""
    z = np.load(path)
    n_seq, cycles, d = z["token"].shape
    f = {k: z[k].reshape(n_seq * cycles, *z[k].shape[2:]) for k in z.files if k != "dataset"}
    f["dataset"] = np.repeat(z["dataset"], cycles)
    f["cycle"] = np.tile(np.arange(cycles), n_seq)
    n = n_seq * cycles
    rows = np.arange(n)
    on = np.zeros((n, d), bool)
    for j in range(f["path"].shape[1]):
        sel = j <= f["num_accepted"]
        on[rows[sel], f["path"][sel, j]] = True
    parent, rank, prob = f["parent"], f["rank"], f["prob"]
    f["on_path"] = on
    f["correct"] = f["token"] == np.take_along_axis(f["argmax"], parent, 1)
    f["parent_on"] = np.take_along_axis(on, parent, 1) & (np.arange(d) > 0)
    q0, q1 = np.ones((n, d)), np.full((n, d), 1e-6)
    for j in range(1, d):  # a node's slot's top two, read off its siblings
        same = parent == parent[:, j:j + 1]
        q0 = np.where(same & (rank[:, j:j + 1] == 0), prob[:, j:j + 1], q0)
        q1 = np.where(same & (rank[:, j:j + 1] == 1), prob[:, j:j + 1], q1)
    off, since = np.zeros((n, d), np.int32), np.zeros((n, d), np.int32)
    for i in range(1, d):
        p = parent[:, i]
        off[:, i] = off[rows, p] + (rank[:, i] > 0)
        since[:, i] = np.where(rank[:, i] > 0, 0, since[rows, p] + 1)
    f.update(q0=q0, q1=q1, off_chain=off, since_branch=since)
    # the sequence's mean acceptance before each cycle (4.5 before its first), as `values.context_bins` reads it
    acc = f["num_accepted"].reshape(n_seq, cycles).astype(np.float64)
    before = np.concatenate([np.zeros((n_seq, 1)), np.cumsum(acc, 1)[:, :-1]], 1)
    f["context"] = ((before + 4.5) / (np.arange(cycles) + 1)).reshape(-1)
    return f


def kept_tau(f: dict[str, np.ndarray], score: np.ndarray) -> np.ndarray:
    """tau per cycle of the tree the BUDGET best nodes by `score` [n, D] make (higher first; made
    ancestor-closed by a running min down each path; ties to the earlier node)."""
    s = score.astype(np.float64).copy()
    s[:, 0] = np.inf
    rows = np.arange(len(s))
    for i in range(1, s.shape[1]):
        s[:, i] = np.minimum(s[:, i], s[rows, f["parent"][:, i]])
    s -= 1e-9 * np.arange(s.shape[1])
    keep = np.argsort(-s, axis=1, kind="stable")[:, : BUDGET + 1]
    kept = np.zeros_like(f["on_path"])
    np.put_along_axis(kept, keep, True, 1)
    return (kept & f["on_path"]).sum(1).astype(np.float64)  # accepted + the bonus (the root counts as 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * x))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


def path_sum(f: dict[str, np.ndarray], log_value: np.ndarray) -> np.ndarray:
    s = np.zeros_like(log_value)
    rows = np.arange(len(s))
    for i in range(1, s.shape[1]):
        s[:, i] = s[rows, f["parent"][:, i]] + log_value[:, i]
    return s


def top_right_of(f: dict[str, np.ndarray]) -> np.ndarray:
    """[n, D] whether the top child of each node's slot is the target's argmax."""
    out = np.zeros_like(f["correct"])
    for j in range(1, f["token"].shape[1]):
        out |= (f["parent"] == f["parent"][:, j:j + 1]) & (f["rank"][:, j:j + 1] == 0) & f["correct"][:, j:j + 1]
    return out


def recalibration_features(f: dict[str, np.ndarray]) -> np.ndarray:
    cond = np.exp(f["score"] - np.take_along_axis(f["score"], f["parent"], 1))
    above = f["off_chain"] - (f["rank"] > 0)  # off-chain ancestors
    since = np.where(above > 0, f["since_branch"], 9)
    cols = [np.ones_like(cond), _logit(cond), (above >= 1) * 1.0, (above >= 2) * 1.0, (above >= 1) * _logit(cond),
            *[(since == k) * 1.0 for k in range(5)], np.log(f["prob"]), np.log(f["q0"]), _logit(f["confidence"]),
            f["rank"] * 1.0, f["depth"] / 8.0]
    return np.stack(cols, -1)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iters: int = 30) -> np.ndarray:
    w = np.zeros(x.shape[1])
    for _ in range(iters):  # Newton
        p = 1 / (1 + np.exp(-x @ w))
        hess = (x * (p * (1 - p))[:, None]).T @ x + l2 * np.eye(len(w))
        w -= np.linalg.solve(hess, x.T @ (p - y) + l2 * w)
    return w


def path_features(f: dict[str, np.ndarray], context: bool) -> np.ndarray:
    n, d = f["token"].shape
    per = np.stack([f["rank"] * 1.0, np.log(f["prob"]), np.log(f["q0"]), np.log(f["q1"]), _logit(f["confidence"])], -1)
    steps = int(f["depth"].max())
    along = np.zeros((n, d, steps, per.shape[-1]))
    rows = np.arange(n)
    for i in range(1, d):
        along[:, i] = along[rows, f["parent"][:, i]]
        along[rows, i, f["depth"][:, i] - 1] = per[:, i]
    cols = [along.reshape(n, d, -1), np.eye(steps + 1)[f["depth"]], f["score"][..., None], f["off_chain"][..., None]]
    if context:
        cols.append(np.broadcast_to(f["context"][:, None, None], (n, d, 1)))
    return np.concatenate(cols, -1).astype(np.float32)


def fit_mlp(x: np.ndarray, y: np.ndarray, seed: int = 0, steps: int = 6000, hidden: int = 64):
    mu, sd = x.mean(0), x.std(0) + 1e-6
    keys = jax.random.split(jax.random.key(seed), 3)
    sizes = (x.shape[1], hidden, hidden, 1)
    params = [(jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
              for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]

    def apply(params, x):
        for w, b in params[:-1]:
            x = jax.nn.gelu(x @ w + b)
        w, b = params[-1]
        return (x @ w + b)[..., 0]

    opt = optax.adamw(1e-3, weight_decay=1e-4)
    state = opt.init(params)
    xs, ys = jnp.asarray((x - mu) / sd), jnp.asarray(y)

    @jax.jit
    def step(params, state, idx):
        loss, g = jax.value_and_grad(
            lambda p: optax.sigmoid_binary_cross_entropy(apply(p, xs[idx]), ys[idx]).mean())(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        params, state, _ = step(params, state, rng.integers(0, len(ys), 512))
    return lambda x: np.asarray(apply(params, jnp.asarray((x - mu) / sd)))


def auc(p: np.ndarray, y: np.ndarray) -> float:
    order = np.argsort(p, kind="stable")
    r = np.empty(len(p))
    r[order] = np.arange(len(p))
    pos = y.astype(bool)
    return float((r[pos].mean() - (pos.sum() - 1) / 2) / (~pos).sum())


def hidden_features(f: dict[str, np.ndarray], w1: np.ndarray) -> np.ndarray:
    n, d = f["token"].shape
    h = f["hidden"][np.arange(n)[:, None], np.maximum(f["depth"] - 1, 0)]  # [n, D, d] the slot's row
    e = w1[np.take_along_axis(f["token"], f["parent"], 1)]  # [n, D, r] W1 of the parent token
    own = np.stack([f["rank"] * 1.0, np.log(f["prob"]), np.log(f["q0"]), np.log(f["q1"]), _logit(f["confidence"]),
                    f["depth"] / 8.0, (f["off_chain"] - (f["rank"] > 0) > 0) * 1.0, f["since_branch"] / 8.0,
                    np.broadcast_to(f["context"][:, None], (n, d))], -1)
    return np.concatenate([h, e, own], -1).astype(np.float32)


def figure(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    curve = out["confidence_of_given_auc"]
    ax.plot([r["auc"] for r in curve], [100 * r["over_chain"] for r in curve], "o-", color="0.6",
            label="an idealised confidence of that AUC (Gaussian reading, calibrated)")
    for name, marker in (("vb", "s"), ("learned from hidden rows", "D")):
        ax.plot(out["top_child_auc"][name], 100 * out["tau"][name]["over_chain"], marker, ms=8,
                label=f"{'shipped _vb values' if name == 'vb' else 'MLP over the drafter hidden rows'}")
    ax.axhline(100 * out["tau"]["oracle"]["over_chain"], color="k", ls=":", label="oracle (whole beam)")
    ax.axhline(10, color="tab:red", ls="--", label="the bar: +10%")
    ax.set_xlabel("AUC: the top child's value against its verdict (held-out)")
    ax.set_ylabel("tau of the pruned D = 8 tree over the chain, %")
    ax.set_title("DSpark beam pruned to D = 8: what ranking can reach")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--out", default="experiments/dspark/ranking_bound.json")
    ap.add_argument("--figure", default="docs/dspark_ranking_bound.png")
    args = ap.parse_args()
    tr, he = load(args.train), load(args.heldout)
    scores = {
        "chain": np.where(he["off_chain"] == 0, -he["depth"], -1e9).astype(np.float64),
        "vb": he["score"],
    }
    x = recalibration_features(tr)
    w = fit_logistic(x[tr["parent_on"]], tr["correct"][tr["parent_on"]].astype(np.float64))
    p = 1 / (1 + np.exp(-recalibration_features(he) @ w))
    scores["recalibrated"] = path_sum(he, np.log(np.clip(p, 1e-6, 1)))
    for name, context in (("learned", False), ("learned + context", True)):
        xt = path_features(tr, context)
        nodes = np.arange(xt.shape[1]) > 0
        labels = tr["on_path"][:, nodes].reshape(-1).astype(np.float32)
        predict = fit_mlp(xt[:, nodes].reshape(-1, xt.shape[-1]), labels)
        xh = path_features(he, context)
        scores[name] = predict(xh.reshape(-1, xh.shape[-1])).reshape(xh.shape[:2])
    # a perfect confidence head: knows whether each slot's top child is right, not which sibling is
    top_right = top_right_of(he)
    sibling = tr["parent_on"] & (tr["rank"] == 1)
    p_second = float(tr["correct"][sibling].sum() / max(1, (sibling & ~top_right_of(tr)).sum()))
    value = np.where(he["rank"] == 0, np.where(he["correct"], 1.0, 1e-6),
                     np.where(top_right, 1e-6, p_second * 0.5 ** (he["rank"] - 1)))
    scores["perfect confidence"] = path_sum(he, np.log(value))
    # between the two: a confidence that separates right from wrong top children with a given AUC
    # (a reading z = +-strength plus unit Gaussian noise, valued by its posterior: the train rate of right top
    # children as the prior, the likelihood ratio exp(2 strength z)), siblings valued (1 - p_top) x their rate
    top_is_right = np.where(he["rank"] == 0, he["correct"], top_right)
    noisy = []
    prior = float(tr["correct"][tr["parent_on"] & (tr["rank"] == 0)].mean())
    rng = np.random.default_rng(0)
    for strength in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0):
        z = strength * np.where(top_is_right, 1.0, -1.0) + rng.standard_normal(top_is_right.shape)
        p_top = _sigmoid(_logit(prior) + 2 * strength * z)
        sel = he["parent_on"] & (he["rank"] == 0)
        v = np.where(he["rank"] == 0, p_top, (1 - p_top) * p_second * 0.5 ** (he["rank"] - 1))
        t = kept_tau(he, path_sum(he, np.log(np.clip(v, 1e-6, 1))))
        noisy.append({"auc": auc(p_top[sel], he["correct"][sel]), "tau": {d: float(t[he["dataset"] == d].mean())
                                                                         for d in sorted(set(he["dataset"].tolist()))}})
    import jaxspec as js

    w1 = np.asarray(js.load_checkpoint(args.checkpoint, draft="dspark", dtype="float32").draft.params.markov_w1)
    xt, xh = hidden_features(tr, w1), hidden_features(he, w1)
    predict = fit_mlp(xt[tr["parent_on"]], tr["correct"][tr["parent_on"]].astype(np.float32), steps=8000)
    p = _sigmoid(predict(xh.reshape(-1, xh.shape[-1])).reshape(xh.shape[:2]))
    scores["learned from hidden rows"] = path_sum(he, np.log(np.clip(p, 1e-6, 1)))
    scores["oracle"] = np.where(he["on_path"], 1.0, 0.0) - 1e-3 * he["depth"]
    # how well each conditional value tells a right top child from a wrong one (held-out, parent accepted)
    top = he["parent_on"] & (he["rank"] == 0)
    cond_vb = np.exp(he["score"] - np.take_along_axis(he["score"], he["parent"], 1))
    out_auc = {"sigma(c)": auc(he["confidence"][top], he["correct"][top]), "vb": auc(cond_vb[top], he["correct"][top]),
               "learned from hidden rows": auc(p[top], he["correct"][top])}
    print("AUC of the top child's value against its verdict:", {k: round(v, 3) for k, v in out_auc.items()})
    datasets = sorted(set(he["dataset"].tolist()))
    out = {"budget": BUDGET + 1, "heldout_cycles": int(len(he["dataset"])), "train_cycles": int(len(tr["dataset"])),
           "tau": {}, "under_branch": [], "top_child_auc": out_auc}
    for name, s in scores.items():
        t = kept_tau(he, s)
        out["tau"][name] = {d: float(t[he["dataset"] == d].mean()) for d in datasets}
    chain = out["tau"]["chain"]
    main3 = [d for d in datasets if d != "humaneval"]
    print(f"{'ranking':26s} " + " ".join(f"{d:>9s}" for d in datasets) + "  over chain (3 datasets)")
    for name, row in out["tau"].items():
        gain = np.mean([row[d] for d in main3]) / np.mean([chain[d] for d in main3]) - 1
        row["over_chain"] = float(gain)
        print(f"{name:26s} " + " ".join(f"{row[d]:9.3f}" for d in datasets) + f"  {100 * gain:+.1f}%")
    # the shipped map (fitted on chain nodes) against nodes under a sibling branch, train beam
    cond = np.exp(tr["score"] - np.take_along_axis(tr["score"], tr["parent"], 1))
    above = tr["off_chain"] - (tr["rank"] > 0)
    for a in (0, 1):
        for r in (0, 1):
            sel = tr["parent_on"] & (np.minimum(above, 1) == a) & (tr["rank"] == r)
            row = {"off_chain_ancestors": a, "rank": r, "nodes": int(sel.sum()),
                   "predicted": float(cond[sel].mean()), "accepted": float(tr["correct"][sel].mean())}
            out["under_branch"].append(row)
            print(row)
    for row in noisy:
        row["over_chain"] = float(np.mean([row["tau"][d] for d in main3]) / np.mean([chain[d] for d in main3]) - 1)
        print(f"a confidence of AUC {row['auc']:.3f}: {100 * row['over_chain']:+.1f}% over the chain")
    out["confidence_of_given_auc"] = noisy
    out["sibling_right_when_top_wrong"] = p_second
    print(f"P(rank-1 sibling right | top child wrong, parent accepted) = {p_second:.3f} (train beam)")
    figure(out, args.figure)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
