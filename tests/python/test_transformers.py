"""megamoe.patch_moe on small transformers models of the four families, built here from each
family's own configuration class and modeling code (3 decoder layers: one dense, two MoE;
random weights; the CPU backend), and one real-shape MoE block on the GPU.

The unpatched model is the reference. Its MoE weights are first rounded through block FP8
(quantize, dequantize) so that both models use the same weights: what is left between them
is megamoe's FP8 activations (x and the SwiGLU output quantized per token per 128 columns,
docs/numerics.md §4), about 4 % relative L2 on one block's output, and the BF16 hand-over.
"""
import copy
import importlib
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import bench_moe as bench  # noqa: E402  (bench/python: conftest puts it on the path)
import megamoe  # noqa: E402
from megamoe import hf  # noqa: E402

# A block's output against the HF block on the same (BF16) input: FP8 activations.
BLOCK_REL_L2 = 0.06
# The logits after two patched MoE layers of these models: measured 0.007-0.022 over the
# four families and three seeds (docs/python-transformers.md).
LOGITS_REL_L2 = 0.04
EMBED_STD = 0.3
NEW_TOKENS = 16
# Greedy generation: a divergence before the criterion (>= 12 of 16 tokens, or the first 8)
# is accepted only at a near-tie: the reference's margin between its token and the patched
# model's below this many times the logits' RMS difference.
TIE_MARGIN = 4.0

# vocab, H, dense I, expert I, heads, E, K, S: small, with E and K as in a real layer's ratio.
SMALL = dict(vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
             n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=64,
             q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=1, topk_group=1,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DSA = dict(index_topk=16, index_head_dim=32, index_n_heads=2)
LAYERS = ["dense", "sparse", "sparse"]


def _module(family):
    try:
        return importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError as e:
        pytest.skip(f"transformers {transformers.__version__} has no {family} ({e})")


def build(family, seed=0):
    """(model, number of MoE blocks): a small random causal LM of the family, float32, eval."""
    mod = _module(family)
    torch.manual_seed(seed)
    if family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**{**SMALL, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1})
        model = mod.DeepseekV3ForCausalLM(cfg)
    elif family == "glm4_moe_lite":
        cfg = transformers.Glm4MoeLiteConfig(**SMALL, mlp_layer_types=LAYERS)
        model = mod.Glm4MoeLiteForCausalLM(cfg)
    elif family == "glm_moe_dsa":
        cfg = transformers.GlmMoeDsaConfig(**SMALL, **DSA, mlp_layer_types=LAYERS)
        model = mod.GlmMoeDsaForCausalLM(cfg)
    elif family == "glm5_next":
        # NoPE DSA attention, linear-attention heads, hyper-connections: the text model's
        # own constraints; a one-block vision tower (unused by text inputs).
        text = {**SMALL, **DSA, "mlp_layer_types": LAYERS, "qk_rope_head_dim": 0, "linear_head_dim": 32,
                "linear_num_heads": 4, "hc_mult": 2,
                "layer_types": ["linear_attention", "linear_attention", "full_attention"]}
        vision = dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=64, out_hidden_size=256)
        cfg = transformers.Glm5NextConfig(text_config=text, vision_config=vision)
        model = mod.Glm5NextForConditionalGeneration(cfg)
    else:
        raise AssertionError(family)
    model = model.eval()
    blocks = hf.find_moe_blocks(model)
    with torch.no_grad():
        # A residual stream of a trained model's scale against its blocks' outputs: with the
        # default init (std 0.02) the embeddings are far smaller than one MoE block's output,
        # and the logits would be the MoE blocks' alone.
        model.get_input_embeddings().weight.normal_(0, EMBED_STD)
        for _, b, _ in blocks:
            # A router whose scores spread (the default init, std 0.02, makes every sigmoid
            # score ~0.5: ties everywhere) and a non-zero correction bias.
            b.gate.weight.normal_(0, 1.0 / 16)
            b.gate.e_score_correction_bias.normal_(0, 0.05)
    fp8_roundtrip_(model)
    return model, len(blocks)


def _roundtrip(w):
    q, s = megamoe.quantize_block_fp8(w)
    return bench.dequant(q, s).to(w.dtype)


def fp8_roundtrip_(model):
    """Every MoE weight (routed and shared) -> dequantize(quantize_block_fp8(w)) in place."""
    with torch.no_grad():
        for _, b, _ in hf.find_moe_blocks(model):
            ex = b.experts
            I = ex.down_proj.shape[-1]
            for p in (ex.gate_up_proj, ex.down_proj):
                for e in range(p.shape[0]):
                    if p is ex.gate_up_proj:  # gate and up quantized apart, as patch_moe does
                        p[e, :I] = _roundtrip(p[e, :I])
                        p[e, I:] = _roundtrip(p[e, I:])
                    else:
                        p[e] = _roundtrip(p[e])
            for lin in (b.shared_experts.gate_proj, b.shared_experts.up_proj, b.shared_experts.down_proj):
                lin.weight.copy_(_roundtrip(lin.weight))


def rel_l2(a, b):
    a, b = a.double(), b.double()
    assert bool(torch.isfinite(a).all()), "non-finite values"
    return float((a - b).norm() / b.norm())


def patched_copy(model, **kw):
    p = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = megamoe.patch_moe(p, device="cpu", **kw)
    said = [w for w in caught if "quantized to block FP8" in str(w.message)]
    return p, n, said


FAMILIES = ["glm5_next", "glm_moe_dsa", "deepseek_v3", "glm4_moe_lite"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request):
    model, nblocks = build(request.param)
    patched, n, said = patched_copy(model)
    return request.param, model, patched, n, nblocks, said


def test_patch_replaces_every_block(family_models):
    family, model, patched, n, nblocks, said = family_models
    assert n == nblocks == 2
    assert len(said) == 1, [str(w.message) for w in said]  # float weights: said once per model
    assert not hf.find_moe_blocks(patched)
    got = [m for m in patched.modules() if isinstance(m, hf.MegaMoEBlock)]
    assert len(got) == 2 and all(m.family == family for m in got)
    c = got[0].layer.config
    gate = hf.find_moe_blocks(model)[0][1].gate
    assert (c.experts, c.topk, c.shared_experts, c.n_group, c.topk_group) == (
        8, 2, 1, gate.num_group, gate.topk_group)
    assert c.routed_scaling == pytest.approx(2.5) and c.correction_bias
    assert c.swiglu_limit == (10.0 if family == "glm5_next" else 0.0)
    assert megamoe.patch_moe(patched) == 0  # nothing left to patch


def test_blocks_match_hf(family_models):
    """Each MoE block against its HF original on the inputs the model gives it."""
    family, model, patched, *_ = family_models
    inputs = {}
    hooks = [b.register_forward_pre_hook(lambda m, a, name=name: inputs.__setitem__(name, a[0].detach()))
             for name, b, _ in hf.find_moe_blocks(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(5)))
    finally:
        for h in hooks:
            h.remove()
    assert len(inputs) == 2
    for name, x in inputs.items():
        x = x.bfloat16().float()  # the same BF16 input on both sides
        block = model.get_submodule(name)
        mine = patched.get_submodule(name)
        with torch.no_grad():
            y_ref = block(x)
            _, w_ref, ids_ref = block.gate(x)
            y = mine(x)
        ids = torch.as_tensor(mine.layer.topk_ids).long()
        same = (ids.sort(1)[0] == ids_ref.sort(1)[0]).all(1)
        assert same.float().mean() >= 0.95, f"{name}: routing differs on {int((~same).sum())} of {len(same)} tokens"
        assert y.dtype == x.dtype and y.shape == x.shape
        r = rel_l2(y, y_ref)
        print(f"{family} {name}: rel L2 {r:.4f}, routing equal on {int(same.sum())}/{len(same)} tokens")
        assert r < BLOCK_REL_L2, f"{family} {name}: rel L2 {r:.4f}"
        if family == "glm5_next":
            # Inputs large enough for the SwiGLU clamp (10) to bite on gate and up values.
            xl = (x * 40).bfloat16().float()
            with torch.no_grad():
                h = xl.reshape(-1, x.shape[-1]) @ block.experts.gate_up_proj[0].t()
                assert float(h.abs().max()) > 2 * block.experts.swiglu_limit
                rl = rel_l2(mine(xl), block(xl))
            print(f"{family} {name}: with the clamp active, rel L2 {rl:.4f}")
            assert rl < BLOCK_REL_L2
        # external routing given the HF router's choice reproduces the layer on routed tokens
        y_ext = mine.layer(x.reshape(-1, x.shape[-1]).bfloat16(), topk_ids=ids_ref.int(), topk_weights=w_ref.float())
        assert rel_l2(y_ext.float(), y_ref.reshape(-1, x.shape[-1])) < BLOCK_REL_L2


def test_logits_and_greedy_generation(family_models, record_property):
    family, model, patched, *_ = family_models
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = patched(input_ids=ids).logits
    r = rel_l2(got, ref)
    record_property("logits_rel_l2", r)
    assert r < LOGITS_REL_L2, f"{family}: logits rel L2 {r:.4f}"
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    out = model.generate(ids[:1], output_scores=True, return_dict_in_generate=True, **gen)
    g_ref = out.sequences[0, ids.shape[1]:]
    g = patched.generate(ids[:1], **gen)[0, ids.shape[1]:]
    agree = int((g == g_ref).sum())
    first = next((i for i in range(NEW_TOKENS) if g[i] != g_ref[i]), NEW_TOKENS)
    record_property("tokens_agree", agree)
    record_property("first_difference", first)
    print(f"{family}: logits rel L2 {r:.4f}; greedy {agree}/{NEW_TOKENS} tokens agree, first {first} identical")
    if agree >= 12 or first >= 8:
        return
    rms = float((got - ref).double().pow(2).mean().sqrt())
    s = out.scores[first][0].double()
    margin = float(s[g_ref[first]] - s[g[first]])
    record_property("tie_margin", margin)
    print(f"  {family}: diverged at token {first}: the reference's margin {margin:.4g}, logits RMS difference {rms:.3g}")
    assert margin <= TIE_MARGIN * rms, (
        f"{family}: generation diverged at token {first} where the reference preferred its token by {margin:.4g} "
        f"(logits RMS difference {rms:.3g}): {g.tolist()} vs {g_ref.tolist()}"
    )


def test_fp8_blocks_go_in_as_they_are():
    """Experts held as transformers holds a loaded FP8 checkpoint (FP8Experts / FP8Linear:
    E4M3 codes + weight_scale_inv) give the layer those bytes: the patched block's output
    equals, bit for bit, the one patched from the float weights those codes came from."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "FP8Experts"):
        pytest.skip(f"transformers {transformers.__version__} has no FP8Experts")
    model, _ = build("deepseek_v3", seed=3)
    floaty = copy.deepcopy(model)
    cfg = model.config
    for name, b, _ in hf.find_moe_blocks(model):
        ex = fp8.FP8Experts(cfg, block_size=(128, 128))
        I = b.experts.down_proj.shape[-1]
        with torch.no_grad():
            for e in range(b.experts.gate_up_proj.shape[0]):
                gq, gs = megamoe.quantize_block_fp8(b.experts.gate_up_proj[e, :I])
                uq, us = megamoe.quantize_block_fp8(b.experts.gate_up_proj[e, I:])
                dq, ds = megamoe.quantize_block_fp8(b.experts.down_proj[e])
                ex.gate_up_proj[e] = torch.cat([gq, uq])
                ex.gate_up_proj_scale_inv[e] = torch.cat([gs, us])
                ex.down_proj[e], ex.down_proj_scale_inv[e] = dq, ds
        b.experts = ex
        for n in ("gate_proj", "up_proj", "down_proj"):
            old = getattr(b.shared_experts, n)
            lin = fp8.FP8Linear(old.in_features, old.out_features, block_size=(128, 128))
            q, s = megamoe.quantize_block_fp8(old.weight.detach())
            with torch.no_grad():
                lin.weight.copy_(q)
                lin.weight_scale_inv.copy_(s)
            setattr(b.shared_experts, n, lin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert megamoe.patch_moe(model, device="cpu") == 2
    assert not [w for w in caught if "quantized" in str(w.message)]  # FP8 in: nothing quantized
    p_float, _, _ = patched_copy(floaty)
    x = torch.randn(1, 16, 256).bfloat16().float()
    for name, _, _ in hf.find_moe_blocks(floaty):
        a = model.get_submodule(name)(x)
        b = p_float.get_submodule(name)(x)
        assert torch.equal(a, b), name


def test_long_inputs_run_in_slices():
    model, _ = build("glm4_moe_lite", seed=1)
    small, _, _ = patched_copy(model, max_tokens=8)
    big, _, _ = patched_copy(model, max_tokens=64)
    x = torch.randn(2, 19, 256).bfloat16().float()
    name = hf.find_moe_blocks(model)[0][0]
    with torch.no_grad():
        a = small.get_submodule(name)(x)
        b = big.get_submodule(name)(x)
    assert torch.equal(a, b)  # rows are independent: slicing changes no byte


def test_errors():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        megamoe.patch_moe("not a model")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"families .* found model_type 'llama'"):
        megamoe.patch_moe(llama)
    model, _ = build("glm4_moe_lite", seed=2)
    name, block, _ = hf.find_moe_blocks(model)[0]
    block.experts.down_proj = torch.nn.Parameter(block.experts.down_proj.detach()[:, :, :128].contiguous())
    with pytest.raises(ValueError, match=rf"{name} .*experts.down_proj: expected \[E=8, H=256, I=256\], found \[8, 256, 128\]"):
        megamoe.patch_moe(model, device="cpu")
    model, _ = build("glm4_moe_lite", seed=2)
    model.config.hidden_act = "gelu"
    for _, b, _ in hf.find_moe_blocks(model):
        b.config = model.config
    with pytest.raises(ValueError, match="hidden_act: expected 'silu'"):
        megamoe.patch_moe(model, device="cpu")


# ---------------------------------------------------------------- GPU: one real-shape layer

REAL = {
    # GLM-4.7-Flash's MoE layer (H 2048, I 1536, 64 experts, top-4) and GLM-5.3-Flash's
    # (H 4096, I 2048, 288 experts, top-8, the SwiGLU clamp).
    "glm4_moe_lite": dict(hidden_size=2048, moe_intermediate_size=1536, n_routed_experts=64, num_experts_per_tok=4,
                          routed_scaling_factor=1.8),
    "glm5_next": dict(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=288, num_experts_per_tok=8,
                      routed_scaling_factor=2.5, swiglu_limit=10.0),
}


@pytest.mark.parametrize("family", list(REAL))
def test_gpu_real_shape_block(family):
    if not (torch.cuda.is_available() and megamoe.cuda_available()):
        pytest.skip("needs a CUDA build of megamoe and a Hopper GPU")
    mod = _module(family)
    shape = {**REAL[family], "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
             "hidden_act": "silu"}
    if family == "glm5_next":
        cfg = transformers.Glm5NextTextConfig(**shape, qk_rope_head_dim=0)
        block_cls = mod.Glm5NextTextMoE
    else:
        cfg = transformers.Glm4MoeLiteConfig(**shape)
        block_cls = mod.Glm4MoeLiteMoE
    cfg._experts_implementation = "eager"  # a block outside a model: the plain expert loop
    torch.manual_seed(0)
    # Built on the meta device and materialized in BF16 (GLM-5.3-Flash's experts are 14.5 GB
    # in BF16, twice that in float32); every parameter and buffer is then drawn here.
    with torch.device("meta"):
        block = block_cls(cfg)
    block = block.to(torch.bfloat16).to_empty(device="cuda")
    block.gate.float()  # transformers keeps the router in float32
    with torch.no_grad():
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p.normal_(0, 0.02)
        for lin in (block.shared_experts.gate_proj, block.shared_experts.up_proj, block.shared_experts.down_proj):
            lin.weight.normal_(0, 0.02)
        block.gate.weight.normal_(0, 1.0 / 64)
        block.gate.e_score_correction_bias.normal_(0, 0.05)
    names = {n for n, _ in block.named_parameters()} | {n for n, _ in block.named_buffers()}
    assert names == {"experts.gate_up_proj", "experts.down_proj", "gate.weight", "gate.e_score_correction_bias",
                     "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                     "shared_experts.down_proj.weight"}, names  # all drawn above

    class Holder(torch.nn.Module):  # patch_moe walks a model; this one holds the block
        def __init__(self):
            super().__init__()
            self.config = cfg
            self.mlp = block

    fp8_roundtrip_(Holder())  # BF16 values of the FP8 weights
    H = cfg.hidden_size
    x = torch.randn(3, 171, H, device="cuda").bfloat16()
    with torch.no_grad():
        y_ref = block(x)
        _, _, ids_ref = block.gate(x)
    patched = Holder()
    patched.mlp = copy.deepcopy(block)
    with pytest.warns(UserWarning, match="quantized to block FP8"):
        assert megamoe.patch_moe(patched) == 1
    mine = patched.mlp
    assert isinstance(mine, hf.MegaMoEBlock) and mine.layer.device.type == "cuda"
    with torch.no_grad():
        y = mine(x)
    torch.cuda.synchronize()
    ids = mine.layer.topk_ids.long()
    same = (ids.sort(1)[0] == ids_ref.sort(1)[0]).all(1)
    assert same.float().mean() >= 0.95, f"routing differs on {int((~same).sum())} of {len(same)} tokens"
    r = rel_l2(y.float(), y_ref.float())
    print(f"{family} real shape H={H}: rel L2 vs the HF block (BF16) {r:.4f}")
    assert y.dtype == torch.bfloat16 and r < BLOCK_REL_L2
