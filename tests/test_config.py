import pytest

import jaxspec as js

OFFICIAL_FLASH = {
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
    "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "num_hash_layers": 3, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_official_config_matches_preset():
    cfg = js.ModelConfig.from_hf_config(OFFICIAL_FLASH)
    preset = js.ModelConfig.preset("v4-flash")
    assert cfg.layer_types == preset.layer_types
    assert (cfg.csa_ratio, cfg.hca_ratio) == (4, 128)
    assert cfg.yarn_factor == 16.0 and cfg.num_mtp_layers == 1


def test_hf_form_with_small_hca_ratio():
    c = dict(OFFICIAL_FLASH)
    del c["compress_ratios"]
    c["num_hidden_layers"] = 4
    c["layer_types"] = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"]
    c["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    cfg = js.ModelConfig.from_hf_config(c)
    assert cfg.layer_types == ("sliding", "csa", "hca", "csa")
    assert cfg.hca_ratio == 16 and cfg.ratio(2) == 16 and cfg.ratio(0) == 0


def test_round_trip_through_hf_form():
    cfg = js.ModelConfig.preset("test")
    again = js.ModelConfig.from_hf_config(cfg.to_hf_config())
    assert again.replace(max_position_embeddings=cfg.max_position_embeddings) == cfg.replace(bos_id=None, eos_id=None)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"compress_ratios": [0, -4] + [4, 128] * 20 + [4, 0]}, "compress_ratios entries"),
        ({"compress_ratios": [0, 2.5] + [4, 128] * 20 + [4, 0]}, "compress_ratios entries"),
        ({"compress_ratios": [0, 0, 4]}, "need >= num_hidden_layers"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"index_topk": 0}, "index_topk"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ],
)
def test_bad_hf_config(changes, match):
    with pytest.raises(ValueError, match=match):
        js.ModelConfig.from_hf_config({**OFFICIAL_FLASH, **changes})


def test_missing_layer_pattern():
    c = {k: v for k, v in OFFICIAL_FLASH.items() if k != "compress_ratios"}
    with pytest.raises(ValueError, match="layer_types"):
        js.ModelConfig.from_hf_config(c)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"index_topk": -1}, "index_topk"),
        ({"rope_head_dim": 7}, "rope_head_dim"),
        ({"layer_types": ("sliding", "csa")}, "layer_types"),
        ({"layer_types": ("sliding", "csa", "xyz", "csa")}, "layer_types"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"dtype": "float16"}, "dtype"),
        ({"kernels": "cuda"}, "kernels"),
        ({"o_groups": 3}, "o_groups"),
    ],
)
def test_bad_model_config(changes, match):
    with pytest.raises(ValueError, match=match):
        js.ModelConfig.preset("test", **changes)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        js.ModelConfig.preset("v5")


@pytest.mark.parametrize("name,match", [
    ("s7_k9_d4", r"s7_k9_d4 drafts depths 4\.\.7 that no cycle can verify.*num_steps must be in 1\.\.3"),
    ("s4_k2_d4", r"drafts depth 4 that no cycle can verify"),
    ("s3_k1_d6", "linear chain"),
    ("s2_k2_d12", r"allowed 2\.\.7"),
])
def test_spec_depths_the_verify_cannot_reach(name, match):
    """A tree of D tokens reaches depth D - 1 at most (a chain): deeper draft steps are wasted work."""
    with pytest.raises(ValueError, match=match) as e:
        js.SpecConfig.parse(name)
    assert "\n" not in str(e.value)
    assert js.SpecConfig.parse("s3_k9_d4").num_steps == 3  # every depth reachable, wide or not


def test_spec_names_the_greedy_draft_set():
    """'_gs' draws a sampled tree's children as the greedy draft set; a chain cannot (its one child would be
    the argmax, not a draw)."""
    spec = js.SpecConfig.parse("s7_k2_d8_w4_vb_gs")
    assert (spec.children, spec.values, spec.widths) == ("greedy", "both", (4, 8))
    assert spec.name == "s7_k2_d8_w4_vb_gs" and js.SpecConfig.parse("s7_k2_d8").children == "gumbel"
    with pytest.raises(ValueError, match="needs topk >= 2"):
        js.SpecConfig.parse("s7_k1_d8_gs")
    with pytest.raises(ValueError, match="children must be one of"):
        js.SpecConfig(3, 2, 5, children="argmax")
