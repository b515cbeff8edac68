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
apple_m4_max apple_m4_pro gaudi2 gaudi3 arc_pro_b60 snapdragon_8_gen3 snapdragon_8_elite""".split()
REQUIRED_MODELS = """
llama-2-7b llama-2-70b llama-3.1-8b llama-3.1-70b llama-3.3-70b llama-3.1-405b qwen2.5-7b qwen2.5-72b qwen3-235b-a22b
mixtral-8x7b deepseek-v3 internlm2-7b gpt-oss-20b gpt-oss-120b qwen2.5-coder-7b bloom-176b""".split()


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
    assert 0 < hw.gemm_fraction <= 1 and 0 < hw.memory_bandwidth_fraction <= 1
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


def test_hardware_dir_has_vendor_subfolders():
    assert {p.name for p in HARDWARE_DIR.iterdir() if p.is_dir()} >= {"nvidia", "amd", "huawei", "apple"}
