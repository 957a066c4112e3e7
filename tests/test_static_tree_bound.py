"""experiments/dspark/static_tree_bound.py: the best fixed-shape tree over per-depth rates, by hand."""

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "experiments" / "dspark" / "static_tree_bound.py"
_spec = importlib.util.spec_from_file_location("static_tree_bound", _path)
bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bound)


def test_without_siblings_the_best_static_tree_is_the_chain():
    rates = [0.8, 0.5, 0.9]
    assert bound.best_static_tau(rates, 4, share=0.0) == pytest.approx(1 + 0.8 + 0.4 + 0.36)


def test_a_sibling_replaces_the_deepest_chain_node_only_when_it_is_worth_more():
    # chain 1 + 0.5 + 0.25; the rank-1 child of the root is worth 1.0 x (1 - 0.5) = 0.5 > 0.25
    assert bound.best_static_tau([0.5, 0.5], 3, share=1.0) == pytest.approx(2.0)
    # a share of 0.4 makes it 0.2 < 0.25: the chain stays
    assert bound.best_static_tau([0.5, 0.5], 3, share=0.4) == pytest.approx(1.75)
    # rank-2 children enter through share2: 0.3 x 0.5 = 0.15 beats nothing here, 0.6 x 0.5 = 0.3 beats 0.25
    assert bound.best_static_tau([0.5, 0.5], 3, share=0.0, share2=0.6) == pytest.approx(1.8)
