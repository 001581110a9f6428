"""A model's shape from its config.json (``kvscope simulate --model-config``): parameters,
active parameters and KV bytes counted as the checkpoints are laid out, on real configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.emulator import capacity, model_config, physics
from kvscope.emulator.simulator import SimulationSettings

CONFIGS = Path(__file__).parent / "data" / "model_configs"


@pytest.mark.parametrize(("name", "total", "active", "kv_bytes"), [
    # Published totals: Qwen3-32B 32.8 B; Llama-3.1-70B 70.6 B; Qwen3-30B-A3B 30.5 B, 3.3 B
    # active; DeepSeek-V3 671 B, 37 B active; GLM-5.1 (GLM-5's architecture) 744 B, 40 B.
    ("qwen3-32b", 32.8e9, 32.8e9, 64 * 8 * 128 * 2 * 2),
    ("llama-3.1-70b-instruct", 70.6e9, 70.6e9, 80 * 8 * 128 * 2 * 2),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 48 * 4 * 128 * 2 * 2),
    ("deepseek-v3", 671e9, 37e9, 61 * (512 + 64) * 2),
    ("glm-5.1", 744e9, 40e9, 78 * (512 + 64) * 2),
])
def test_parameters_and_kv_bytes_match_the_published_models(
        name: str, total: float, active: float, kv_bytes: int) -> None:
    shape = model_config.load(CONFIGS / f"{name}.json")
    assert shape.name == name
    assert shape.parameters == pytest.approx(total, rel=0.03)
    assert shape.active_parameters == pytest.approx(active, rel=0.04)
    assert shape.kv_bytes_per_token == kv_bytes


def test_the_built_in_models_are_what_their_configs_say() -> None:
    qwen = model_config.load(CONFIGS / "qwen3-32b.json")
    built = capacity.QWEN3_32B
    for field in ("layers", "kv_heads", "head_dim", "kv_bytes_per_token", "attention_dim",
                  "kv_block_tokens", "nixl_regions", "family"):
        assert getattr(qwen, field) == getattr(built, field), field
    glm = model_config.load(CONFIGS / "glm-5.1.json")
    built = capacity.GLM5_FP8
    # MLA: one latent a token on FlashMLA's 64-token blocks, and a DSA indexer region a layer.
    for field in ("layers", "kv_heads", "head_dim", "kv_bytes_per_token", "attention_dim",
                  "kv_block_tokens", "nixl_regions", "family"):
        assert getattr(glm, field) == getattr(built, field), field
    deepseek = model_config.load(CONFIGS / "deepseek-v3.json")
    assert deepseek.fp8_weights and deepseek.weight_bytes == 1.0  # quant_method fp8
    assert deepseek.nixl_regions == 61  # no indexer before V3.2
    assert model_config.load(CONFIGS / "llama-3.1-70b-instruct.json").family == "qwen3-32b"
    assert model_config.load(CONFIGS / "qwen3-30b-a3b.json").family == "glm-5-fp8"


def test_a_config_is_priced_by_the_physics_with_its_familys_efficiency() -> None:
    llama = model_config.load(CONFIGS / "llama-3.1-70b-instruct.json")
    qwen = physics.cost_profile("qwen3-32b")
    profile = physics.cost_profile(llama)
    # The same efficiency on twice the active parameters: about twice the per-token price.
    assert profile.prefill_ms_per_token == pytest.approx(
        qwen.prefill_ms_per_token * llama.active_parameters / 32.8e9)
    assert profile.kv_bytes_per_token == 327_680
    # A config as the built-in prices exactly as the built-in.
    same = physics.cost_profile(model_config.load(CONFIGS / "qwen3-32b.json"))
    assert same.prefill_ms_per_token_context == pytest.approx(qwen.prefill_ms_per_token_context)


@pytest.mark.parametrize(("text", "message"), [
    ("", "not a JSON model config"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10}),
     "hidden_size is missing"),
    (json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "vocab_size": 10, "intermediate_size": 16, "torch_dtype": "int4"}),
     "torch_dtype 'int4'"),
    (json.dumps({"hidden_size": 8, "num_hidden_layers": "2", "num_attention_heads": 2,
                 "vocab_size": 10, "intermediate_size": 16}),
     "num_hidden_layers is '2'"),
    (json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "vocab_size": 10}), "no intermediate_size"),
])
def test_a_bad_config_is_an_error_naming_the_file_and_the_field(
        tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(capacity.CapacityError, match=message) as caught:
        model_config.load(path)
    assert str(path) in str(caught.value)
    with pytest.raises(capacity.CapacityError, match="cannot read the model config"):
        model_config.load(tmp_path / "missing.json")


def test_kvscope_simulate_sizes_and_times_the_configs_model(tmp_path: Path) -> None:
    def simulate(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvscope.cli", "simulate", "--db", str(tmp_path / "s.duckdb"),
             "--conversations", "4", *extra], capture_output=True, text=True, timeout=300,
            cwd=tmp_path)

    deepseek = str(CONFIGS / "deepseek-v3.json")
    done = simulate("--model-config", deepseek, "--cost-model", "physics", "--gpu", "h200-141gb",
                    "--tensor-parallel-size", "8", "--run-label", "deepseek")
    assert done.returncode == 0, done.stderr
    settings = SimulationSettings(model_config=deepseek, cost_model="physics", gpu="h200-141gb",
                                  tensor_parallel_size=8)
    # 671 B fp8 weights over 8 GPUs, a replicated 70,272-byte latent a token.
    assert settings.decode_kv_blocks(16) == int((0.9 * 141e9 - 671.03e9 / 8)
                                                // (16 * 70_272))
    assert "deepseek" in done.stdout
    assert ("model deepseek-v3 (" in done.stderr and "671.0 B parameters, 37.6 B active, "
            "70,272 KV bytes a token" in done.stderr and "glm-5-fp8's fitted efficiency"
            in done.stderr)
    refused = simulate("--model-config", deepseek)
    assert refused.returncode == 2
    assert "model_config needs cost_model physics" in refused.stderr
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    refused = simulate("--model-config", str(bad), "--cost-model", "physics")
    assert refused.returncode == 2
    assert f"{bad}: num_hidden_layers is missing" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
