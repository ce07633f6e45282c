"""Secrets a spec carries (an HF token in an engine env, --api-key among extra_args) never reach HDF5 metadata, run.json
or the batch script; the run folder's spec.yaml keeps them for the job and is readable by its owner alone."""

from __future__ import annotations

import stat
from pathlib import Path

import h5py
import pytest
import yaml

from launchers.runstate import read_state, update_state
from llmd.cli import main
from llmd.metrics import MetricsWriter, merge_runs, read_meta
from llmd.spec import parse_spec
from llmd.spec.redact import REDACTED, is_secret_name, redact_data, redact_text

TOKEN = "hf_SECRETabcdefghijklmnopqrstuvwxyz"
KEY = "sk-SECRET0123456789abcdefghijkl"
SPEC = {
    "name": "secret",
    "engine": {"env": {"HF_TOKEN": TOKEN, "HF_HOME": "/models"}},
    "decode": {"extra_args": ["--api-key", KEY, "--max-loras", 4], "env": {"WANDB_API_KEY": "plainsecret"}},
    "router": {"api_key_env": "LLMD_API_KEY"},
}
SECRETS = (TOKEN, KEY, "plainsecret")


def _holds_secret(text: str) -> bool:
    return any(s in text for s in SECRETS)


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("OPENAI_API_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("db_password", True),
        ("apiKey", True),
        ("--api-key", True),
        ("Authorization", True),
        ("api_key_env", False),  # the NAME of a variable, which is what the spec should hold
        ("HF_TOKEN_PATH", False),
        ("max_num_batched_tokens", False),
        ("TOKENIZERS_PARALLELISM", False),
        ("HF_HOME", False),
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_values_and_command_lines_are_redacted() -> None:
    line = f"vllm serve m --api-key {KEY} --port 8000 HF_TOKEN={TOKEN} -H 'Authorization: Bearer abcdefgh1234'"
    clean = redact_text(line)
    assert not _holds_secret(clean) and "abcdefgh1234" not in clean
    assert "--port 8000" in clean and "--api-key ***" in clean
    assert redact_text("https://user:pw123@example.com/repo") == "https://user:***@example.com/repo"
    data = redact_data(parse_spec(SPEC).model_dump(mode="json"))
    assert data["engine"]["env"] == {"HF_TOKEN": REDACTED, "HF_HOME": "/models"}
    assert data["decode"]["extra_args"] == ["--api-key", REDACTED, "--max-loras", "4"]
    assert data["router"]["api_key_env"] == "LLMD_API_KEY"


def test_hdf5_metadata_never_holds_the_secrets(tmp_path: Path) -> None:
    spec = parse_spec(SPEC)
    from_object = tmp_path / "router.h5"
    with MetricsWriter(from_object, "router", {"spec": spec}) as w:
        w.append_requests([{"request_id": "r0"}])
    from_text = tmp_path / "client.h5"
    with MetricsWriter(from_text, "client", {"spec": yaml.safe_dump(SPEC)}) as w:
        w.append_requests([{"request_id": "r1"}])
    # A file written before redaction existed: merge and the reader must not pass its secret on.
    old = tmp_path / "old.h5"
    with MetricsWriter(old, "decode-0", {}) as w:
        w.append_requests([{"request_id": "r2"}])
    with h5py.File(old, "r+") as f:
        del f["meta/spec"]
        f["meta"].create_dataset("spec", data=yaml.safe_dump(SPEC), dtype=h5py.string_dtype())
    merged = merge_runs([from_object, from_text, old], tmp_path / "metrics.h5")
    for path in (from_object, from_text, merged):
        assert not _holds_secret(path.read_bytes().decode("latin-1")), path
    meta = read_meta(old)
    assert not _holds_secret(meta["spec"]) and "HF_TOKEN: '***'" in meta["spec"]
    assert yaml.safe_load(read_meta(from_object)["spec"])["engine"]["env"]["HF_HOME"] == "/models"


def test_run_json_stores_causes_without_secrets(tmp_path: Path) -> None:
    update_state(tmp_path, state="FAILED", cause=f"decode exited: vllm ... --api-key {KEY} (HF_TOKEN={TOKEN})")
    assert not _holds_secret((tmp_path / "run.json").read_text())
    assert read_state(tmp_path)["cause"].startswith("decode exited: vllm ... --api-key ***")


def test_render_sbatch_keeps_secrets_out_of_the_script_and_run_json(tmp_path: Path, monkeypatch, capsys) -> None:
    from llmd.models.tiny import make_tiny

    make_tiny(tmp_path / "tiny", weights=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**SPEC, "model": {"path": "tiny"}}))
    assert main(["launch", "spec.yaml", "--render-sbatch", "--gpus", "no", "--starter", "basic"]) == 0
    assert not _holds_secret(capsys.readouterr().out)
    (run,) = (tmp_path / "results").iterdir()
    for name in ("job.sbatch", "run.json"):
        assert not _holds_secret((run / name).read_text()), name
    copy = run / "spec.yaml"
    assert TOKEN in copy.read_text()  # the job's engines need it
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600


def test_a_sweep_points_spec_copy_holding_a_token_is_the_owners_alone(tmp_path: Path) -> None:
    from sweeps.point import prepare

    meta = {"sweep": "grid", "index": 0, "params": {}}
    folder = prepare(tmp_path, 0, f"name: grid-0\nengine:\n  env:\n    HF_TOKEN: {TOKEN}\n", meta, state="PENDING")
    assert stat.S_IMODE((folder / "spec.yaml").stat().st_mode) == 0o600
    plain = prepare(tmp_path, 1, "name: grid-1\n", {**meta, "index": 1}, state="PENDING")
    assert stat.S_IMODE((plain / "spec.yaml").stat().st_mode) != 0o600  # nothing secret: the umask's mode
    assert not _holds_secret((folder / "run.json").read_text())
