"""A reduced Kimi K3 (AttnRes, latent MoE, SiTU, 96 KDA + 96 MLA heads) on the reference
engine: prefill(N) + decode(k), the state moved through a StateManifest into fresh pools, equals
one forward over N + k tokens; the pools and the transfer planner carry its state."""
import pytest
import torch

from pdserve.decode.capacity import weight_bytes
from pdserve.model.config import preset, reduced_kimi_k3
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.model import HybridModel
from pdserve.model.parallel import TPGroup
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout
from test_model_equivalence import full_logits, split_logits


@pytest.fixture(scope="module")
def k3():
    # 7 layers with blocks of 3: AttnRes writes blocks at layers 0, 3, 6 (a KDA and two MLA
    # layers), and layer 0 is the dense (SiTU) MLP
    return build_model(reduced_kimi_k3(num_layers=7, attn_res_block_size=3), seed=7)


def test_reduced_k3_has_the_k3_structure(k3):
    c = k3.config
    assert c.linear_attn_config.num_heads == 96 and c.num_attention_heads == 96
    assert c.mla_layer_ids == [3, 6] and c.hidden_act == "situ"
    names = dict(k3.named_parameters())
    for name in ["model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight",
                 "model.layers.0.self_attention_res_proj.weight",
                 "model.layers.0.mlp_res_norm.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
                 "model.layers.1.block_sparse_moe.routed_expert_norm.weight",
                 "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.15.w2.weight",
                 "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
                 "model.layers.1.self_attn.g_proj.weight",
                 "model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.g_proj.weight"]:
        assert name in names, name
    assert names["model.layers.1.block_sparse_moe.experts.0.w1.weight"].shape == (32, 96)


@pytest.mark.parametrize("n,k", [(1, 3), (13, 4), (40, 3)])
def test_k3_prefill_then_decode_equals_one_forward(k3, n, k):
    layout = StateLayout(page_tokens=16, latent_dtype="float32", conv_dtype="float32")
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, k3.config.vocab_size, (n + k,), generator=g).tolist()
    got = split_logits(k3, tokens[:n], tokens[n:], layout)
    want = full_logits(k3, tokens, layout)[n - 1:]
    scale = want.abs().max()
    assert torch.allclose(got, want, atol=2e-5 * scale, rtol=0), (got - want).abs().max() / scale
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_k3_attn_res_changes_the_logits(k3):
    """The AttnRes mixture is live: other w_q give other logits (a wiring check)."""
    eng = ReferenceEngine(k3, num_pages=16, num_slots=2)
    prompt = list(range(5, 17))
    before = eng.step([eng.admit(Request("a", prompt, SamplingParams()))], [prompt])[0]
    w = k3.model.layers[4].mlp_res_proj.weight
    saved = w.clone()
    with torch.no_grad():
        w.mul_(3.0)
    try:
        eng2 = ReferenceEngine(k3, num_pages=16, num_slots=2)
        after = eng2.step([eng2.admit(Request("b", prompt, SamplingParams()))], [prompt])[0]
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert not torch.allclose(before, after, atol=1e-4)


@pytest.fixture(scope="module")
def full_k3():
    """kimi-k3 as one TP8 rank holds it, on the meta device (shapes, no memory)."""
    with torch.device("meta"):
        return HybridModel(preset("kimi-k3"), TPGroup(rank=7, size=8), torch.bfloat16)


def test_full_k3_builds_at_tp8_rank_shapes(full_k3):
    moe = full_k3.model.layers[1].block_sparse_moe
    assert len(moe.experts) == 896 and moe.experts[0].w1.weight.shape == (3072 // 8, 3584)
    assert moe.experts[0].w2.weight.shape == (3584, 3072 // 8)
    assert moe.routed_expert_down_proj.weight.shape == (3584, 7168)       # replicated
    assert moe.routed_expert_up_proj.weight.shape == (7168, 3584)
    assert moe.shared_experts.gate_proj.weight.shape == (6144 // 8, 7168)
    assert full_k3.model.layers[0].mlp.gate_proj.weight.shape == (33792 // 8, 7168)
    assert full_k3.model.layers[0].self_attn.heads == 12                    # KDA
    assert full_k3.model.layers[3].self_attn.heads == 12                    # MLA


@pytest.mark.parametrize("tp", [1, 2])
def test_reduced_k3_module_tree_matches_the_capacity_count(tp):
    """The built K3 holds the bytes per rank that `capacity` counts from the config alone
    (AttnRes vectors, latent projections and norm, expert shapes)."""
    config = reduced_kimi_k3()
    with torch.device("meta"):
        model = HybridModel(config, TPGroup(rank=tp - 1, size=tp), torch.bfloat16)
    assert sum(weight_bytes(config, tp).values()) == _bytes(model)


def test_full_k3_module_tree_matches_the_capacity_count(full_k3):
    assert sum(weight_bytes(preset("kimi-k3"), 8).values()) == _bytes(full_k3)


def _bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())
