"""The latency model's profiles as data files: the built-in ones load to exactly the numbers the Python literals held,
user folders (LLMD_PERF_PATH, add_profile_dir) add and override them field by field, efficiency.yaml applies last,
and a bad file is a UserError that names the file, the entry and the field."""

from __future__ import annotations

import glob
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd.errors import UserError
from llmd.perf import (
    GPUS,
    MODELS,
    GPUProfile,
    LatencyModel,
    Parallelism,
    add_profile_dir,
    dump_efficiency,
    get_gpu,
    get_model,
    load_efficiency,
    reset_profiles,
)
from llmd.perf.profile_table import DATA_DIR, ENV_VAR
from llmd.perf.units import parse_quantity

ROOT = Path(__file__).resolve().parent.parent
MiB, GB = 2**20, 10**9

# The GPU table as llmd/perf/gpus.py held it in Python before it moved to data/gpus.yaml.
BEFORE_GPUS = [
    GPUProfile("H100-80GB", 989e12, 1979e12, 81559 * MiB, 3.35e12, 450 * GB, 50 * GB, 55 * GB),
    GPUProfile("H200", 989e12, 1979e12, 143771 * MiB, 4.8e12, 450 * GB, 50 * GB, 55 * GB),
    GPUProfile(
        "A100-80GB", 312e12, 312e12, 81920 * MiB, 2.039e12, 300 * GB, 25 * GB, 25 * GB, 0.55, 0.8, 0.8, 0.6e-3, 25e-6
    ),
    GPUProfile("B200", 2250e12, 4500e12, 180 * GB, 7.7e12, 900 * GB, 50 * GB, 55 * GB, 0.55, 0.8, 0.8, 0.4e-3, 15e-6),
    GPUProfile("cpu", 1e11, 1e11, 8 * GB, 2e10, 1e10, 1.25e9, 1e10, 1.0, 1.0, 1.0, 0.5e-3, 0.0, 2e-6, 50e-6),
]


@pytest.fixture(autouse=True)
def clean_profiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts from the built-ins alone and leaves no folder or cached table behind."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    reset_profiles()
    yield
    reset_profiles()


def _folder(root: Path, name: str, **files: str) -> Path:
    folder = root / name
    folder.mkdir()
    for filename, text in files.items():
        (folder / f"{filename}.yaml").write_text(text)
    return folder


# ---- the built-ins are unchanged -----------------------------------------------------------------------------------


def test_builtin_gpus_are_the_python_literals_they_replace() -> None:
    assert list(GPUS.values()) == BEFORE_GPUS
    h100 = GPUS["H100-80GB"]
    assert h100.bf16_flops == 989e12 and h100.hbm_bytes == 81559 * MiB and h100.ib_bw == 50e9
    assert (h100.mfu, h100.step_overhead_s, h100.layer_overhead_s, h100.net_latency_s) == (0.55, 0.5e-3, 20e-6, 20e-6)


def test_builtin_models_keep_their_numbers() -> None:
    assert list(MODELS) == ["tiny", "llama-3.1-8b", "llama-3.1-70b", "deepseek-v3", "glm-5.2"]
    counts = {name: (m.total_params, m.active_params, m.dense_params) for name, m in MODELS.items()}
    assert counts == {
        "tiny": (590464, 590464, 590464),
        "llama-3.1-8b": (8030261248, 8030261248, 8030261248),
        "llama-3.1-70b": (70553706496, 70553706496, 70553706496),
        "deepseek-v3": (682636487424, 37552297472, 17117648384),
        "glm-5.2": (753864139008, 41784728832, 19135487232),
    }
    glm = MODELS["glm-5.2"]
    assert (glm.weight_bytes_per_param, glm.kv_bytes_per_element, glm.kv_bytes_per_token) == (1.0, 1.0, 78 * 704)


def test_step_times_are_the_ones_computed_before_the_move() -> None:
    # Recorded with the Python-literal profiles, before they became data files; equal to the last bit.
    llama = LatencyModel(get_gpu("H100-80GB"), MODELS["llama-3.1-8b"])
    assert llama.step_time(((4096, 1000),), ()) == 0.11829128275854764
    assert llama.decode_step_time([8000] * 64) == 0.03178444102686567
    assert llama.step_time(((2048, 0),), [3000] * 32) == 0.056696862978729654
    assert llama.prefill_time(20000) == 0.7094582732594097
    assert llama.max_kv_tokens() == 448308
    assert llama.kv_transfer_time(1000, same_node=False) == 0.0032968
    assert llama.cpu_restore_time(1000) == 0.0023831272727272727
    wide = Parallelism(tp=1, dp=16, ep=True)
    glm = LatencyModel(get_gpu("H200"), MODELS["glm-5.2"], wide, mtp_draft_tokens=3, mtp_acceptance=0.65)
    assert glm.decode_step_time([60000] * 128) == 0.1546608375539381
    assert glm.decode_step_time([1000] * 8) == 0.026916373471861627
    assert glm.max_kv_tokens() == 1193187
    assert glm.kv_transfer_time(10000, same_node=False) == 0.013748
    glm_prefill = LatencyModel(get_gpu("H200"), MODELS["glm-5.2"], wide, all2all="high_throughput")
    assert glm_prefill.step_time(((8192, 50000),), ()) == 1.4825875172297434
    deepseek = LatencyModel(get_gpu("B200"), MODELS["deepseek-v3"], Parallelism(tp=8))
    assert deepseek.decode_step_time([4000] * 32) == 0.012315195223833732
    tiny = LatencyModel(get_gpu("cpu"), MODELS["tiny"])
    assert tiny.step_time(((1000, 0),), ()) == 0.01219414144


def test_the_data_files_ship_in_the_wheel() -> None:
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {Path(p).name for pattern in package_data["llmd.perf"] for p in glob.glob(str(DATA_DIR.parent / pattern))}
    assert {"gpus.yaml", "models.yaml"} <= shipped


def test_units_read_exactly() -> None:
    assert parse_quantity("3.35 TB/s", "B/s") == 3.35e12
    assert parse_quantity("400 Gb/s", "B/s") == 50e9
    assert parse_quantity("81559 MiB", "B") == 81559 * MiB
    assert parse_quantity("20 us", "s") == 20e-6
    assert parse_quantity("989e12", "FLOP/s") == 989e12  # YAML 1.1 reads this as text; it is still a number


# ---- user folders --------------------------------------------------------------------------------------------------


def test_an_override_changes_one_field_and_inherits_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = GPUS["H100-80GB"]
    h200 = GPUS["H200"]
    folder = _folder(tmp_path, "site", gpus="H100-80GB: {mfu: 0.5}\n", models="glm-5.2: {kv_bytes_per_element: 2}\n")
    monkeypatch.setenv(ENV_VAR, str(folder))
    reset_profiles()
    h100 = get_gpu("H100-80GB")
    assert h100.mfu == 0.5
    assert h100 == GPUProfile(**{**vars(builtin), "mfu": 0.5})
    assert GPUS["H200"] is h200  # untouched profiles stay the very same objects
    assert MODELS["glm-5.2"].kv_bytes_per_token == 2 * 78 * 704
    assert MODELS["glm-5.2"].total_params == 753864139008
    slower = LatencyModel(h100, MODELS["llama-3.1-8b"]).step_time(((4096, 0),), ())
    assert slower > LatencyModel(builtin, MODELS["llama-3.1-8b"]).step_time(((4096, 0),), ())


def test_base_starts_a_new_entry_from_another(tmp_path: Path) -> None:
    gpus = "H100-slow-net:\n  base: H100-80GB\n  ib_bw: 200 Gb/s  # HDR instead of NDR\n"
    models = (
        "llama-3.1-8b-fp8:\n  base: llama-3.1-8b\n  config: {quantization_config: {quant_method: fp8}}\n"
        "  kv_bytes_per_element: 1\n"
    )
    add_profile_dir(_folder(tmp_path, "mine", gpus=gpus, models=models))
    slow = get_gpu("H100-slow-net")
    assert slow.ib_bw == 25e9 and slow.name == "H100-slow-net"
    assert vars(slow) | {"name": "H100-80GB", "ib_bw": 50e9} == vars(GPUS["H100-80GB"])
    fp8, bf16 = get_model("llama-3.1-8b-fp8"), MODELS["llama-3.1-8b"]
    assert (fp8.weight_bytes_per_param, fp8.kv_bytes_per_element) == (1.0, 1.0)
    assert fp8.total_params == bf16.total_params and fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert list(GPUS)[-1] == "H100-slow-net" and list(MODELS)[-1] == "llama-3.1-8b-fp8"


def test_a_new_model_from_its_config_or_from_profile_fields(tmp_path: Path) -> None:
    models = """
qwen-like:
  config: {model_type: qwen2, vocab_size: 1000, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 4,
           num_attention_heads: 8, num_key_value_heads: 2}
by-hand:
  total_params: 7.5e9
  active_params: 7.5e9
  num_layers: 32
  hidden_size: 4096
  num_q_heads: 32
  num_kv_heads: 8
  head_dim: 128
  attention: gqa
"""
    add_profile_dir(_folder(tmp_path, "mine", models=models))
    assert get_model("qwen-like").num_kv_heads == 2 and get_model("qwen-like").attention == "gqa"
    by_hand = get_model("by-hand")
    assert by_hand.total_params == 7_500_000_000 and isinstance(by_hand.total_params, int)
    assert by_hand.dense_params == by_hand.total_params  # no experts: every weight is streamed each step


def test_later_folders_win_and_add_profile_dir_comes_after_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _folder(tmp_path, "first", gpus="H100-80GB: {mfu: 0.3, bw_efficiency: 0.7}\n")
    second = _folder(tmp_path, "second", gpus="H100-80GB: {mfu: 0.4}\n")
    monkeypatch.setenv(ENV_VAR, f"{first}{os.pathsep}{second}")
    reset_profiles()
    assert (GPUS["H100-80GB"].mfu, GPUS["H100-80GB"].bw_efficiency) == (0.4, 0.7)
    add_profile_dir(_folder(tmp_path, "third", gpus="H100-80GB: {mfu: 0.45}\n"))
    assert GPUS["H100-80GB"].mfu == 0.45  # add_profile_dir resets the table itself
    reset_profiles()  # forgets the added folder; the environment still applies
    assert GPUS["H100-80GB"].mfu == 0.4


def test_efficiency_yaml_applies_after_every_gpus_yaml(tmp_path: Path) -> None:
    calibrated = _folder(tmp_path, "calibrated", efficiency="H100-80GB: {mfu: 0.42, step_overhead_s: 0.8 ms}\n")
    later = _folder(tmp_path, "later", gpus="H100-80GB: {mfu: 0.6}\nmy-h100: {base: H100-80GB, mfu: 0.5}\n")
    add_profile_dir(calibrated)
    add_profile_dir(later)
    assert (GPUS["H100-80GB"].mfu, GPUS["H100-80GB"].step_overhead_s) == (0.42, 0.8e-3)
    # A profile built on the calibrated GPU inherits its factors, except those it sets itself.
    assert (GPUS["my-h100"].mfu, GPUS["my-h100"].step_overhead_s) == (0.5, 0.8e-3)


def test_unknown_names_list_user_profiles_too(tmp_path: Path) -> None:
    add_profile_dir(_folder(tmp_path, "mine", gpus="H100-slow-net: {base: H100-80GB}\n"))
    with pytest.raises(UserError, match=r"known GPU profiles: .*cpu, H100-slow-net"):
        get_gpu("TPU-v5")
    with pytest.raises(UserError, match=r"known models: tiny"):
        get_model("no-such-model")


# ---- efficiency files a calibration writes -------------------------------------------------------------------------


def test_dump_and_load_efficiency_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "fit" / "efficiency.yaml"
    path.parent.mkdir()
    fitted = {"mfu": 0.4817263544219, "bw_efficiency": 0.73, "step_overhead_s": 1.2345e-3, "layer_overhead_s": 2.1e-5}
    assert dump_efficiency(path, "H100-80GB", fitted) == path
    assert load_efficiency(path) == {"H100-80GB": fitted}
    dump_efficiency(path, "H100-80GB", {"mfu": 0.5})  # a refit of one factor keeps the others
    dump_efficiency(path, "B200", {"link_efficiency": 0.7})
    assert load_efficiency(path) == {"H100-80GB": {**fitted, "mfu": 0.5}, "B200": {"link_efficiency": 0.7}}
    add_profile_dir(path.parent)
    h100 = get_gpu("H100-80GB")
    assert (h100.mfu, h100.bw_efficiency, h100.step_overhead_s, h100.layer_overhead_s) == (0.5, 0.73, 1.2345e-3, 2.1e-5)
    assert get_gpu("B200").link_efficiency == 0.7


def test_dump_efficiency_refuses_what_is_not_an_efficiency_factor(tmp_path: Path) -> None:
    path = tmp_path / "efficiency.yaml"
    with pytest.raises(UserError, match=r"efficiency\.yaml: GPU 'H100-80GB', field 'hbm_bw': unknown field"):
        dump_efficiency(path, "H100-80GB", {"hbm_bw": 3e12})
    with pytest.raises(UserError, match=r"field 'mfu': 1\.2 is out of range"):
        dump_efficiency(path, "H100-80GB", {"mfu": 1.2})
    assert not path.exists()


# ---- bad files -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filename", "text", "expected"),
    [
        ("gpus", "H100-80GB: {mfu: 1.5}\n", r"GPU 'H100-80GB', field 'mfu': 1\.5 is out of range"),
        ("gpus", "H100-80GB: {mfuu: 0.5}\n", r"GPU 'H100-80GB', field 'mfuu': unknown field; did you mean 'mfu'\?"),
        ("gpus", "H100-80GB: {hbm_bw: 3 GB}\n", r"field 'hbm_bw': unknown unit 'GB'.*GB/s"),
        ("gpus", "H100-80GB: {step_overhead_s: -1 ms}\n", r"field 'step_overhead_s': .* must not be negative"),
        ("gpus", "H100-80GB: {mfu: 0.5\n", r"gpus\.yaml is not valid YAML"),
        ("gpus", "H200: {mfu: 0.5}\nH200: {mfu: 0.4}\n", r"'H200' is given twice \(first at line 1\)"),
        ("gpus", "- H100-80GB\n", r"gpus\.yaml: expected a mapping of GPU names"),
        ("gpus", "X1: {mfu: 0.5}\n", r"GPU 'X1' \(from .*gpus\.yaml\): a new GPU needs bf16_flops"),
        (
            "gpus",
            "X1: {base: H100-8OGB}\n",
            r"GPU 'X1', field 'base': no GPU named 'H100-8OGB'.*did you mean 'H100-80GB'",
        ),
        ("gpus", "X1: {base: X2}\nX2: {base: X1}\n", r"field 'base': bases go round in a loop"),
        ("models", "tiny: {num_layers: 2.5}\n", r"model 'tiny', field 'num_layers': expected a whole number"),
        ("models", "tiny: {attention: flash}\n", r"model 'tiny', field 'attention': 'flash' is not one of mha"),
        ("models", "tiny: {config: [1, 2]}\n", r"model 'tiny', field 'config': expected a mapping of config\.json"),
        ("models", "tiny: {config: {hidden_size: wide}}\n", r"model 'tiny' \(from .*\): config field 'hidden_size'"),
        ("models", "m: {config: {model_type: llama}}\n", r"model 'm' \(from .*\): its config lacks 'hidden_size'"),
        ("efficiency", "H100-80GB: {hbm_bw: 1}\n", r"efficiency\.yaml: GPU 'H100-80GB', field 'hbm_bw': unknown field"),
        ("efficiency", "H100-8OGB: {mfu: 0.5}\n", r"efficiency\.yaml: GPU 'H100-8OGB': no such GPU; did you mean"),
    ],
)
def test_a_bad_file_is_a_user_error_naming_file_entry_and_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, filename: str, text: str, expected: str
) -> None:
    folder = _folder(tmp_path, "bad", **{filename: text})
    monkeypatch.setenv(ENV_VAR, str(folder))
    reset_profiles()
    with pytest.raises(UserError, match=expected) as caught:
        _ = get_gpu("H100-80GB"), get_model("tiny")
    assert str(folder) in str(caught.value)


def test_a_folder_without_profile_files_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match=r"add_profile_dir.*holds none of gpus\.yaml"):
        add_profile_dir(_folder(tmp_path, "empty", **{"gpu": "H100-80GB: {mfu: 0.5}\n"}))
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    reset_profiles()
    with pytest.raises(UserError, match=rf"{ENV_VAR} names .*missing, which is not a folder"):
        get_gpu("H100-80GB")
