"""Hardware and model catalogs: every file loads, passes range checks, and derived counts match published ones."""

import pytest
import yaml

from simengine.config.dtypes import WEIGHT_FORMATS, kv_bytes
from simengine.config.hardware import HARDWARE_DIR, hardware_files, load_hardware
from simengine.config.model import MODELS_DIR, load_model, model_names
from simengine.errors import InputError

REQUIRED_DEVICES = """
a100_40g_sxm a100_80g_sxm a100_pcie h100_sxm h100_pcie h100_nvl h200_sxm h20 b200 gb200 l40s l4 a10g rtx_4090 rtx_3090
rtx_pro_6000_blackwell dgx_spark_gb10 jetson_agx_orin_64g jetson_orin_nano mi250x mi300x mi325x mi355x ascend_910b2
ascend_910b3 ascend_910b4 ascend_910c ascend_310p apple_m1 apple_m1_ultra apple_m2_ultra apple_m3_max apple_m3_ultra
apple_m4_max apple_m4_pro gaudi2 gaudi3 arc_pro_b60 snapdragon_8_gen3 snapdragon_8_elite
gh200 gh200_144g h800_sxm a800_80g_sxm rtx_5090 rtx_6000_ada rtx_a6000 apple_m1_pro apple_m1_max apple_m2 apple_m2_pro
apple_m2_max apple_m3 apple_m3_pro apple_m4""".split()
REQUIRED_MODELS = """
llama-2-7b llama-2-70b llama-3.1-8b llama-3.1-70b llama-3.3-70b llama-3.1-405b qwen2.5-7b qwen2.5-72b qwen3-235b-a22b
mixtral-8x7b deepseek-v3 internlm2-7b gpt-oss-20b gpt-oss-120b qwen2.5-coder-7b bloom-176b
llama-3-8b llama-3-70b llama-4-scout-17b-16e llama-4-maverick-17b-128e mixtral-8x22b qwen3-8b qwen3-14b qwen3-32b
qwen3-30b-a3b deepseek-r1 mistral-nemo-12b gemma-2-9b gemma-2-27b gemma-3-12b gemma-3-27b codellama-34b yi-34b
phi-4 qwen2.5-14b qwen2.5-3b qwen2.5-1.5b qwen3-4b qwen3-1.7b qwen3-0.6b mistral-small-24b gemma-3-4b
deepseek-r1-distill-qwen-7b deepseek-r1-distill-qwen-1.5b""".split()


def test_every_required_device_is_in_the_catalog():
    assert set(REQUIRED_DEVICES) <= set(hardware_files())


@pytest.mark.parametrize("name", sorted(hardware_files()))
def test_hardware_yaml_loads_and_is_in_range(name):
    hw = load_hardware(name)
    assert 1 <= hw.memory_bytes / 2**30 <= 1024
    assert 30e9 <= hw.memory_bandwidth_bytes_s <= 20e12
    assert ("fp16" in hw.peak_flops) or ("bf16" in hw.peak_flops)
    for v in hw.peak_flops.values():
        assert 1e12 <= v <= 2e16
    assert "default" in hw.gemm_fractions and all(0 < v <= 1 for v in hw.gemm_fractions.values())
    assert set(hw.gemm_fractions) - {"default"} <= set(hw.peak_flops)   # a fraction only for a dtype it computes
    assert 0 < hw.memory_bandwidth_fraction <= 1 and 0 < hw.link_bandwidth_fraction <= 1
    assert 0 <= hw.kernel_floor_s <= 50e-6
    assert hw.custom_allreduce_latency_s is None or hw.custom_allreduce_latency_s <= hw.link_latency_s
    assert hw.node_size >= 1
    assert hw.vendor in {"nvidia", "amd", "huawei", "apple", "intel", "qualcomm"}
    # every number carries a source comment: each numeric line of the file has a trailing comment
    path = hardware_files()[name]
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        value = rest.split("#")[0].strip()
        if value and value.replace(".", "", 1).isdigit():
            assert "#" in rest, f"{path.name}: '{line.strip()}' has no source comment"


def test_every_required_model_loads():
    names = model_names()
    for m in REQUIRED_MODELS:
        assert m in names, m
        load_model(m)


@pytest.mark.parametrize("name", sorted(n for n in yaml.safe_load((MODELS_DIR / "catalog.yaml").read_text())))
def test_derived_parameter_counts_within_2_percent_of_published(name):
    entry = yaml.safe_load((MODELS_DIR / "catalog.yaml").read_text())[name]
    m = load_model(name)
    assert m.total_params / 1e9 == pytest.approx(entry["published_params_b"], rel=0.02)
    if entry.get("published_active_params_b"):
        active = m.active_params
        if m.model_type == "gpt_oss":  # OpenAI's model card counts active params without the embedding
            active -= m.embedding_params
        assert active / 1e9 == pytest.approx(entry["published_active_params_b"], rel=0.02)


def test_kv_bytes_per_token_by_hand():
    # GQA: Llama-3.1-70B, 80 layers x 2 (K,V) x 8 kv heads x 128 dims x 2 bytes
    assert load_model("llama-3.1-70b").kv_bytes_per_token(2) == 80 * 2 * 8 * 128 * 2
    # MLA: DeepSeek-V3 stores the 512-dim latent + 64-dim rope key per layer: 61 x 576 x 2 bytes
    assert load_model("deepseek-v3").kv_bytes_per_token(2) == 61 * (512 + 64) * 2
    # MoE with GQA: Mixtral-8x7B, 32 layers x 2 x 8 x 128 x 2 (experts do not touch the KV)
    assert load_model("mixtral-8x7b").kv_bytes_per_token(2) == 32 * 2 * 8 * 128 * 2
    # int8 KV halves it
    assert load_model("llama-3.1-8b").kv_bytes_per_token(kv_bytes("int8")) == 32 * 2 * 8 * 128


def test_moe_active_versus_total():
    m = load_model("qwen3-235b-a22b")
    assert m.is_moe and m.num_experts == 128 and m.experts_per_token == 8
    assert m.active_params < m.total_params / 8


def test_alias_and_config_json_path(tmp_path):
    assert load_model("llama-3.3-70b").total_params == load_model("llama-3.1-70b").total_params
    cfg = tmp_path / "config.json"
    cfg.write_text((MODELS_DIR / "llama-3.1-8b.json").read_text())
    assert load_model(str(cfg)).total_params == load_model("llama-3.1-8b").total_params


def test_w4a16_has_group_scale_overhead():
    assert WEIGHT_FORMATS["int4"].bytes_per_param == pytest.approx(0.5 + 2 / 128)


def test_unknown_names_list_valid_ones():
    with pytest.raises(InputError, match="did you mean 'h100_sxm'"):
        load_hardware("h100_sxn")
    with pytest.raises(InputError, match="unknown model 'llama-9b'.*valid: "):
        load_model("llama-9b")
    with pytest.raises(InputError, match="unknown model 'llama-9-8b' \\(did you mean 'llama-3-8b'"):
        load_model("llama-9-8b")


def test_hardware_dir_has_vendor_subfolders():
    assert {p.name for p in HARDWARE_DIR.iterdir() if p.is_dir()} >= {"nvidia", "amd", "huawei", "apple"}


def test_a_catalog_file_in_another_vendors_folder_is_refused(tmp_path, monkeypatch):
    import simengine.config.hardware as hardware
    (tmp_path / "amd").mkdir()
    misplaced = tmp_path / "amd" / "h100_sxm.yaml"
    misplaced.write_text((HARDWARE_DIR / "nvidia" / "h100_sxm.yaml").read_text())
    monkeypatch.setattr(hardware, "HARDWARE_DIR", tmp_path)
    with pytest.raises(InputError, match="vendor 'nvidia' must equal the catalog folder 'amd'") as e:
        hardware.load_hardware_file(misplaced)
    assert e.value.field == "vendor"


# ---- the most-served open architectures: shapes the loader derives from their published config.json ----------------

def test_llama_3_is_llama_3_1_shaped_with_an_8k_context():
    for old, new in (("llama-3-8b", "llama-3.1-8b"), ("llama-3-70b", "llama-3.1-70b")):
        m, m31 = load_model(old), load_model(new)
        assert m.total_params == m31.total_params and m.kv_bytes_per_token(2) == m31.kv_bytes_per_token(2)
        assert (m.max_model_len, m31.max_model_len) == (8192, 131072)
    assert load_model("llama-3-8b").total_params == 8_030_261_248
    assert load_model("llama-3-70b").total_params == 70_553_706_496


def test_llama_4_scout_every_layer_moe_with_a_shared_expert():
    m = load_model("llama-4-scout-17b-16e")
    assert m.model_type == "llama4_text" and m.num_layers == 48
    assert (m.num_experts, m.experts_per_token, m.num_moe_layers, m.num_dense_mlp_layers) == (16, 1, 48, 0)
    assert m.expert_params == 3 * 5120 * 8192  # experts are intermediate_size wide
    assert m.shared_expert_params_per_moe_layer == 3 * 5120 * 8192  # one shared expert, the same width
    assert m.router_params_per_moe_layer == 5120 * 16
    # chunked attention (8192-token chunks) on the RoPE layers; every 4th layer is a global NoPE layer
    assert (m.num_sliding_layers, m.sliding_window, m.num_full_attention_layers) == (36, 8192, 12)
    assert m.kv_bytes_per_token(2) == 12 * 2 * 8 * 128 * 2
    assert not m.tie_word_embeddings and m.vocab_size == 202048 and m.max_model_len == 10485760
    assert m.total_params == 107_769_861_120 and m.active_params == 17_172_894_720


def test_llama_4_maverick_interleaves_moe_and_dense_layers():
    m = load_model("llama-4-maverick-17b-128e")
    assert (m.num_experts, m.num_moe_layers, m.num_dense_mlp_layers) == (128, 24, 24)  # interleave_moe_layer_step 2
    assert m.intermediate_size == 16384  # dense layers use intermediate_size_mlp
    assert m.dense_mlp_params == 3 * 5120 * 16384 and m.expert_params == 3 * 5120 * 8192
    assert m.shared_expert_params_per_moe_layer == 3 * 5120 * 8192
    assert (m.num_sliding_layers, m.sliding_window) == (36, 8192)
    assert m.total_params == 400_711_848_960 and m.active_params == 17_184_691_200


def test_llama_4_explicit_layer_lists(tmp_path):
    import json
    cfg = json.loads((MODELS_DIR / "llama-4-maverick-17b-128e.json").read_text())
    cfg["text_config"]["moe_layers"] = list(range(1, 48, 2))  # what transformers derives from the step
    cfg["text_config"]["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(48)]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path / "config.json"))
    ref = load_model("llama-4-maverick-17b-128e")
    assert (m.num_moe_layers, m.num_sliding_layers, m.total_params) == (24, 36, ref.total_params)
    cfg["text_config"]["no_rope_layers"] = [1] * 47 + [0]  # an explicit list wins over the default interval
    cfg["text_config"]["moe_layers"] = [0, 1, 2]
    (tmp_path / "listed.json").write_text(json.dumps(cfg))
    m2 = load_model(str(tmp_path / "listed.json"))
    assert (m2.num_sliding_layers, m2.num_moe_layers, m2.num_dense_mlp_layers) == (47, 3, 45)


def test_qwen3_dense_head_dim_and_moe_layers():
    m = load_model("qwen3-32b")
    assert m.head_dim == 128 and m.num_heads * m.head_dim == 8192 != m.hidden_size  # head_dim given explicitly
    assert m.attn_params_per_layer == 5120 * 8192 * 2 + 2 * 5120 * 8 * 128
    for name, layers in (("qwen3-8b", 36), ("qwen3-14b", 40), ("qwen3-32b", 64)):
        assert load_model(name).num_layers == layers and not load_model(name).is_moe
    moe = load_model("qwen3-30b-a3b")
    assert (moe.num_experts, moe.experts_per_token, moe.num_moe_layers, moe.num_dense_mlp_layers) == (128, 8, 48, 0)
    assert moe.expert_params == 3 * 2048 * 768 and moe.shared_expert_params_per_moe_layer == 0


def test_deepseek_r1_is_the_deepseek_v3_architecture():
    import json
    r1, v3 = load_model("deepseek-r1"), load_model("deepseek-v3")
    assert r1.total_params == v3.total_params and r1.kv_bytes_per_token(2) == v3.kv_bytes_per_token(2)
    assert json.loads((MODELS_DIR / "deepseek-v3.json").read_text())["num_nextn_predict_layers"] == 1


def test_mixtral_8x22b():
    m = load_model("mixtral-8x22b")
    assert (m.num_layers, m.num_experts, m.experts_per_token, m.num_moe_layers) == (56, 8, 2, 56)
    assert m.total_params == 140_620_634_112 and m.active_params == 39_152_031_744


def test_mistral_nemo_explicit_head_dim():
    m = load_model("mistral-nemo-12b")
    assert m.head_dim == 128 != m.hidden_size // m.num_heads  # 5120 / 32 = 160
    assert m.max_model_len == 128000 and m.total_params == 12_247_782_400


@pytest.mark.parametrize("name, layers, sliding, window, head_dim", [
    ("gemma-2-9b", 42, 21, 4096, 256),    # every other layer (0, 2, 4, ...) slides
    ("gemma-2-27b", 46, 23, 4096, 128),
    ("gemma-3-4b", 34, 29, 1024, 256),    # 5 x (5 + 1) + 4 local
    ("gemma-3-12b", 48, 40, 1024, 256),   # 5 local : 1 global; head_dim from Gemma3TextConfig's default
    ("gemma-3-27b", 62, 52, 1024, 128),   # 10 x (5 + 1) + 2 local
])
def test_gemma_sliding_layers_and_head_dim(name, layers, sliding, window, head_dim):
    m = load_model(name)
    assert (m.num_layers, m.num_sliding_layers, m.sliding_window, m.head_dim) == (layers, sliding, window, head_dim)
    assert m.kv_bytes_per_token(2) == (layers - sliding) * 2 * m.num_kv_heads * head_dim * 2
    assert m.tie_word_embeddings and m.gated_mlp  # GeGLU: still 3 matrices


def test_gemma_2_matches_the_report_exactly_but_for_two_extra_norms_per_layer():
    # Gemma 2 report: embedding + non-embedding parameters; Gemma 2 has 4 RMSNorms per layer, the loader counts 2
    report = {"gemma-2-9b": 917_504_000 + 8_324_201_984, "gemma-2-27b": 1_179_648_000 + 26_047_480_320}
    for name, published in report.items():
        m = load_model(name)
        assert m.total_params + 2 * m.num_layers * m.hidden_size == published


def test_gemma_3_text_config_defaults():
    m = load_model("gemma-3-27b")  # text_config omits vocab_size, max_position_embeddings and the tie flag
    assert (m.vocab_size, m.max_model_len, m.model_type) == (262208, 131072, "gemma3_text")
    assert m.total_params == 27_008_663_808 and load_model("gemma-3-12b").total_params == 11_765_640_960
    small = load_model("gemma-3-4b")  # its text_config omits the head counts too (the defaults, 8 and 4)
    assert (small.num_heads, small.num_kv_heads, small.total_params) == (8, 4, 3_880_071_680)


def test_family_defaults_yield_to_the_file(tmp_path):
    import json
    cfg = json.loads((MODELS_DIR / "gemma-3-12b.json").read_text())
    cfg["text_config"].update(head_dim=240, vocab_size=1000, sliding_window_pattern=2)
    cfg["tie_word_embeddings"] = False  # the wrapper's flag applies when the text model sets none
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path / "config.json"))
    assert (m.head_dim, m.vocab_size, m.num_sliding_layers, m.tie_word_embeddings) == (240, 1000, 24, False)


@pytest.mark.parametrize("name, layers, heads, kv_heads, vocab, context", [
    ("codellama-34b", 48, 64, 8, 32000, 16384),
    ("yi-34b", 60, 56, 8, 64000, 4096),
    ("phi-4", 40, 40, 10, 100352, 16384),
    ("qwen2.5-14b", 48, 40, 8, 152064, 131072),
    ("mistral-small-24b", 40, 32, 8, 131072, 32768),      # head_dim 128 explicit: 5120 / 32 would be 160
    ("deepseek-r1-distill-qwen-7b", 28, 28, 4, 152064, 131072),
    ("deepseek-r1-distill-qwen-1.5b", 28, 12, 2, 151936, 131072),  # untied, unlike qwen2.5-1.5b
])
def test_dense_gqa_models(name, layers, heads, kv_heads, vocab, context):
    m = load_model(name)
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.vocab_size, m.max_model_len) == (
        layers, heads, kv_heads, vocab, context)
    assert m.head_dim == 128 and not m.tie_word_embeddings and not m.is_moe


@pytest.mark.parametrize("name, layers, hidden, heads, kv_heads, ffn, vocab, context, total", [
    # small Qwen checkpoints share the input embedding with the LM head (tie_word_embeddings true)
    ("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, 32768, 3_085_846_528),
    ("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, 131072, 1_543_656_960),
    ("qwen3-4b", 36, 2560, 32, 8, 9728, 151936, 40960, 4_022_458_880),
    ("qwen3-1.7b", 28, 2048, 16, 8, 6144, 151936, 40960, 1_720_567_808),
    ("qwen3-0.6b", 28, 1024, 16, 8, 3072, 151936, 40960, 596_042_752),
])
def test_small_tied_models(name, layers, hidden, heads, kv_heads, ffn, vocab, context, total):
    m = load_model(name)
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size,
            m.max_model_len) == (layers, hidden, heads, kv_heads, ffn, vocab, context)
    assert m.head_dim == 128 and m.tie_word_embeddings and not m.is_moe  # Qwen3: head_dim given explicitly
    assert m.total_params == total
    assert m.kv_bytes_per_token(2) == layers * 2 * kv_heads * 128 * 2


def test_deepseek_r1_distills_alias_only_identical_architectures():
    for distill, base in (("deepseek-r1-distill-llama-8b", "llama-3.1-8b"),
                          ("deepseek-r1-distill-llama-70b", "llama-3.1-70b"),
                          ("deepseek-r1-distill-qwen-14b", "qwen2.5-14b"),
                          ("deepseek-r1-distill-qwen-32b", "qwen2.5-32b")):
        assert model_names()[distill] == model_names()[base]
        assert load_model(distill).total_params == load_model(base).total_params
    # the 1.5B distill is untied (its own lm_head) and the 7B one has rope_theta 1e4: own entries, not aliases
    d15, q15 = load_model("deepseek-r1-distill-qwen-1.5b"), load_model("qwen2.5-1.5b")
    assert not d15.tie_word_embeddings and q15.tie_word_embeddings
    assert d15.total_params - q15.total_params == 151936 * 1536
    assert model_names()["deepseek-r1-distill-qwen-7b"] != model_names()["qwen2.5-7b"]
    assert load_model("deepseek-r1-distill-qwen-7b").total_params == load_model("qwen2.5-7b").total_params


def test_each_part_of_a_quantised_checkpoint_is_held_at_the_bytes_it_is_stored_in():
    """The token embedding and LM head of an FP8 checkpoint stay 16-bit; gpt-oss's MXFP4 release quantises only its
    experts; its llama.cpp GGUF holds everything else in Q8_0, and comes out at the published file's size."""
    llama = load_model("llama-3.1-8b")
    rest, experts = llama.stored_bytes(WEIGHT_FORMATS["fp8"])
    assert experts == 0
    assert rest == pytest.approx((llama.embedding_params + llama.lm_head_params + llama.norm_params) * 2.0
                                 + llama.dense_linear_params * 1.0)
    assert sum(llama.stored_bytes(WEIGHT_FORMATS["bf16"])) == pytest.approx(2.0 * llama.total_params)
    oss = load_model("gpt-oss-20b")
    rest, experts = oss.stored_bytes(WEIGHT_FORMATS["mxfp4"])
    assert experts == pytest.approx(oss.routed_expert_params_total * 17 / 32)   # 32 FP4 values and an E8M0 scale
    assert rest == pytest.approx(2.0 * (oss.total_params - oss.routed_expert_params_total))
    from simengine.engines.llamacpp_config import gguf_tensor_types
    from tests.conftest import make_dep

    gguf = gguf_tensor_types(make_dep("rtx_4090", "gpt-oss-20b", weight_dtype="mxfp4"))
    # lmstudio-community/gpt-oss-20b-GGUF gpt-oss-20b-MXFP4.gguf: 12,109,565,632 bytes
    assert gguf.weight_bytes_per_device == pytest.approx(12_109_565_632, rel=0.02)
