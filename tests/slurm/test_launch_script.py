"""The het-job batch script, sweeps and run state without a cluster: what each component asks for, what runs where,
requeue and container lines, and the user mistakes `llmd launch/status/cancel/sweep` must explain."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from launchers.plan import plan_job
from launchers.runstate import read_state, update_state
from launchers.script import SUBMITIT_SIGNAL, render_plain, render_submitit
from llmd.cli import main
from llmd.errors import UserError
from llmd.spec import parse_spec
from sweeps.grid import expand


def _spec(**sections):
    base = {
        "name": "t",
        "prefill": {"nodes": 2, "gpus_per_node": 4, "replicas": 1, "dp_size": 8},
        "decode": {"nodes": 3, "gpus_per_node": 8, "replicas": 3, "dp_size": 8},
        "slurm": {
            "partition": "gpu",
            "account": "proj",
            "qos": "high",
            "time": "02:00:00",
            "constraints": ["h100", "ib"],
            "cpus_per_task": 16,
            "mem": "0",
            "extra_sbatch": ["--exclusive"],
        },
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return parse_spec(base)


def _blocks(script: str) -> list[list[str]]:
    """#SBATCH lines per het component (split at `#SBATCH hetjob`)."""
    blocks: list[list[str]] = [[]]
    for line in script.splitlines():
        if line.startswith("#SBATCH hetjob"):
            blocks.append([])
        elif line.startswith("#SBATCH"):
            blocks[-1].append(line)
    return blocks


def test_het_job_has_one_component_per_role_with_its_resources(tmp_path: Path) -> None:
    plan = plan_job(_spec(), tmp_path / "run", tmp_path, gpus=True)
    script = render_submitit(plan)
    blocks = _blocks(script)
    assert len(blocks) == 3
    main_c, prefill, decode = blocks
    assert "#SBATCH --nodes=1" in main_c and not any("gpus" in ln for ln in main_c)
    assert "#SBATCH --nodes=2" in prefill and "#SBATCH --gpus-per-node=4" in prefill
    assert "#SBATCH --nodes=3" in decode and "#SBATCH --gpus-per-node=8" in decode
    for block in blocks:
        for want in ("--partition=gpu", "--account=proj", "--qos=high", "--time=02:00:00", "--cpus-per-task=16"):
            assert f"#SBATCH {want}" in block
        assert "#SBATCH --mem=0" in block
        assert "#SBATCH --constraint='h100&ib'" in block
        assert "#SBATCH --exclusive" in block
    # submitit's loader runs in component 0, engines start per node in components 1 and 2
    assert re.search(r"^srun --het-group=0 .* -m submitit\.core\._submit ", script, re.M)
    assert re.search(r"srun --het-group=1 --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 ", script)
    assert re.search(r"srun --het-group=2 --nodes=3 --ntasks-per-node=1 --kill-on-bad-exit=1 ", script)
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_2"' in script
    assert "--requeue" not in script and "--signal" not in script and "--container-image" not in script


def test_no_gpus_no_prefill_requeue_and_container(tmp_path: Path) -> None:
    spec = _spec(prefill={"nodes": 0}, slurm={"requeue": True, "container_image": "nvcr.io/nvidia/vllm:25.01"})
    script = render_submitit(plan_job(spec, tmp_path / "run", tmp_path, gpus=False))
    blocks = _blocks(script)
    assert len(blocks) == 2, "prefill.nodes 0: no prefill component"
    assert "#SBATCH --requeue" in blocks[0] and f"#SBATCH --signal={SUBMITIT_SIGNAL}@90" in blocks[0]
    assert not any("gpus-per-node" in ln for b in blocks for ln in b)
    assert "--het-group=1" in script and "--role decode" in script and "--role prefill" not in script
    srun_lines = [ln for ln in script.splitlines() if "srun --het-group" in ln]
    assert len(srun_lines) == 2
    assert all("--container-image=nvcr.io/nvidia/vllm:25.01" in ln for ln in srun_lines)


def test_starter_choice_and_plain_template(tmp_path: Path) -> None:
    fabric = render_submitit(plan_job(_spec(), tmp_path / "run", tmp_path, gpus=True, starter="fabric"))
    assert "--mpi=pmi2" in fabric and "-m llmd.fabric --spec" in fabric
    plain = render_plain(plan_job(_spec(), tmp_path / "run", tmp_path, gpus=True))
    assert "-m launchers.engine_task --spec" in plain and "--mpi" not in plain
    assert "submitit" not in plain.lower().replace("(no submitit)", "")
    assert re.search(r"^srun --het-group=0 .* -m launchers\.main_job --spec \S+/run/spec\.yaml", plain, re.M)
    assert plain.startswith("#!/bin/bash\n") and plain.endswith("exit $rc\n")


def test_the_job_runs_the_source_tree_that_planned_it(tmp_path: Path) -> None:
    # Only python is given on the command lines; which llmd it imports must not depend on what it has installed.
    root = Path(__file__).resolve().parents[2]
    for script in (render_plain(plan_job(_spec(), tmp_path / "run", tmp_path, gpus=False)),
                   render_submitit(plan_job(_spec(), tmp_path / "run", tmp_path, gpus=False))):  # fmt: skip
        lines = script.splitlines()
        export = lines.index(f"export PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}")
        assert export < min(i for i, line in enumerate(lines) if "srun " in line), "before any step starts"


def test_submitit_signal_matches_submitit() -> None:
    slurm = pytest.importorskip("submitit.slurm.slurm")
    assert slurm.SlurmJobEnvironment.USR_SIG == SUBMITIT_SIGNAL


def test_dry_run_cli_prints_the_script_and_writes_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"name": "dry", "engine": {"kind": "vllm"}}))
    assert main(["launch", "spec.yaml", "--dry-run", "--gpus", "no", "--starter", "basic"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and out.count("#SBATCH hetjob") == 2
    assert not (tmp_path / "results").exists()


def test_launch_mistakes_are_user_errors(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"name": "Bad Name", "slurm": {"time": "99:99"}}))
    assert main(["launch", "bad.yaml", "--dry-run", "--gpus", "no"]) == 2
    err = capsys.readouterr().err
    assert "name" in err and "slurm.time" in err
    # no tokenizer for the simulated engines: said before anything is submitted
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump({"name": "ok", "model": {"path": "nowhere"}}))
    assert main(["launch", "ok.yaml", "--dry-run", "--gpus", "no"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    # no Slurm on PATH
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["launch", "ok.yaml"]) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert main(["status", "12345"]) == 2
    assert "no llmd run is known for job 12345" in capsys.readouterr().err
    assert main(["status", str(tmp_path)]) == 2
    assert "not an llmd run folder" in capsys.readouterr().err
    assert main(["cancel", "not-a-run"]) == 2
    assert "neither a run folder nor a Slurm job id" in capsys.readouterr().err


def test_run_state_updates_merge_and_survive(tmp_path: Path) -> None:
    update_state(tmp_path, state="SUBMITTED", logs={"batch": "b"})
    update_state(tmp_path, state="RUNNING", logs={"main": "m"}, progress={"requests": 3})
    s = read_state(tmp_path)
    assert s["state"] == "RUNNING" and s["logs"] == {"batch": "b", "main": "m"} and s["progress"]["requests"] == 3
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_state(tmp_path)


def test_status_prints_cause_and_logs_without_slurm(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    update_state(tmp_path, run_dir=str(tmp_path), job_id="7", state="FAILED", cause="decode component exited")
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "decode component exited" in out
    assert main(["status", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job_id"] == "7"


def test_sweep_grid_expands_in_order_and_validates(tmp_path: Path) -> None:
    doc = {
        "name": "g",
        "base": {"name": "x"},
        "grid": {"router.policy": ["precise", "round-robin"], "workload.seed": [1, 2, 3]},
    }
    sweep = expand(doc, tmp_path / "s.yaml")
    assert [v.index for v in sweep.variants] == list(range(6))
    assert sweep.variants[4].overrides == {"router.policy": "round-robin", "workload.seed": 2}
    assert sweep.variants[4].spec.router.policy == "round-robin" and sweep.variants[4].spec.workload.seed == 2
    assert sweep.variants[4].spec.name == "g-4"
    bad = [
        ({**doc, "extra": 1}, "unknown key"),
        ({**doc, "grid": {}}, "grid must map"),
        ({**doc, "grid": {"router.policy": []}}, "non-empty list"),
        ({**doc, "name": "Bad"}, "name must be"),
        ({**doc, "grid": {"router.policy": ["precise", "bogus"]}}, r"point 1 \(router.policy=bogus\)"),
        ({**doc, "grid": {"router.polcy": ["precise"]}}, "polcy"),
        ({**doc, "base": "missing.yaml"}, "no such file"),
    ]
    for d, msg in bad:
        with pytest.raises(UserError, match=msg):
            expand(d, tmp_path / "s.yaml")


def test_example_sweep_dry_run(capsys, monkeypatch) -> None:
    pytest.importorskip("submitit")
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    assert main(["sweep", "sweeps/examples/policies.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 points" in out and "#SBATCH --array=0-11%4\n" in out


def test_follow_limit_reads_every_slurm_time_format() -> None:
    from launchers.cli import _limit_s

    assert _limit_s("90") == 5400
    assert _limit_s("10:30") == 630
    assert _limit_s("01:00:00") == 3600
    assert _limit_s("1-12") == 86400 + 12 * 3600
    assert _limit_s("2-00:30") == 2 * 86400 + 1800
    assert _limit_s("1-00:00:10") == 86410
    assert _limit_s("infinite") >= 86400
