"""The deployment spec: defaults, examples, round trips, and the messages a user sees for each kind of mistake."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from llmd.cli import main
from llmd.spec import (
    DeploymentSpec,
    PoolSpec,
    SpecError,
    SpecIssue,
    check_spec,
    dump_spec,
    load_spec,
    parse_size,
    parse_spec,
    parse_spec_text,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def issues_of(tmp_path: Path, text: str) -> dict[str, str]:
    """Load a spec that must fail; return {path: message} of its issues."""
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text))
    return {issue.path: issue.message for issue in info.value.errors}


# ---- valid specs ---------------------------------------------------------------------------------------------------


def test_defaults_are_a_valid_tiny_local_deployment() -> None:
    spec = DeploymentSpec()
    assert spec.name == "tiny-local"
    assert spec.engine.kind == "sim"
    assert spec.disaggregated
    assert spec.total_gpus == 2
    assert spec.model.served_name == "tiny"
    assert spec.model.tokenizer == "models/tiny"
    assert (spec.prefill.port, spec.decode.port) == (8100, 8200)
    assert parse_spec({}) == spec


@pytest.mark.parametrize("name", ["tiny-local.yaml", "glm52-544gpu.yaml"])
def test_examples_are_valid(name: str) -> None:
    assert check_spec(EXAMPLES / name) == []


def test_glm_example_matches_the_published_deployment() -> None:
    spec = load_spec(EXAMPLES / "glm52-544gpu.yaml")
    assert (spec.prefill.gpus, spec.decode.gpus, spec.total_gpus) == (160, 384, 544)
    assert (spec.prefill.gpus_per_replica, spec.decode.gpus_per_replica) == (16, 128)
    assert (spec.prefill.ranks, spec.decode.ranks) == (160, 384)
    assert spec.model.block_size == 64
    assert spec.kv.cpu_bytes == 128 * 2**30
    assert (spec.mtp.draft_tokens, spec.mtp.acceptance_rate) == (3, 0.68)
    assert spec.engine.kind == "vllm" and spec.workload.profile == "agentx"


@pytest.mark.parametrize("spec", [DeploymentSpec(), "tiny-local.yaml", "glm52-544gpu.yaml"])
def test_dump_load_round_trip(spec: DeploymentSpec | str, tmp_path: Path) -> None:
    original = spec if isinstance(spec, DeploymentSpec) else load_spec(EXAMPLES / spec)
    text = dump_spec(original)
    assert load_spec(write(tmp_path, text)) == original
    assert dump_spec(parse_spec_text(text)) == text


def test_dump_quotes_strings_that_look_like_other_types() -> None:
    spec = DeploymentSpec.model_validate(
        {"model": {"hash_algo": "xxhash", "hash_seed": "0755"}, "engine": {"gpu": "1e5"}, "slurm": {"qos": "true"}}
    )
    assert parse_spec_text(dump_spec(spec)) == spec


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100GiB", 100 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 1_500_000_000_000),
        ("64Gi", 64 * 2**30),
        ("2kb", 2000),
        ("1024", 1024),
        ("10 GiB", 10 * 2**30),
    ],
)
def test_human_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    assert parse_spec({"kv": {"cpu_bytes": text}}).kv.cpu_bytes == expected


def test_yaml_is_read_as_written(tmp_path: Path) -> None:
    # YAML 1.1 would read 1:30:00 as 5400 and `0755` as octal; the spec loader keeps what the user meant.
    spec = load_spec(
        write(
            tmp_path,
            """
            slurm: {time: 1:30:00, mem: 64G}
            model: {hash_algo: xxhash, hash_seed: 0755}
            decode: {env: {CUDA_VISIBLE_DEVICES: 0}, extra_args: [--max-loras, 4]}
            workload: {duration_s: 1e3}
            """,
        )
    )
    assert spec.slurm.time == "1:30:00"
    assert spec.model.hash_seed == "755"
    assert spec.decode.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert spec.decode.extra_args == ["--max-loras", "4"]
    assert spec.workload.duration_s == 1000.0


def test_empty_sections_mean_defaults(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "name: x\nslurm:\n  # partition: gpu\n"))
    assert spec.slurm == DeploymentSpec().slurm


def test_no_disaggregation_and_properties() -> None:
    spec = parse_spec(
        {"prefill": {"nodes": 0}, "decode": {"nodes": 4, "replicas": 2, "gpus_per_node": 8, "dp_size": 16}}
    )
    assert not spec.disaggregated
    assert list(spec.pools) == ["decode"]
    assert spec.total_gpus == 32
    assert spec.decode.gpus_per_replica == 16 and spec.decode.ranks == 32


# ---- bad specs: each names the field and says what is allowed ------------------------------------------------------


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "decode:\n  dp_sise: 4\n")
    message = issues["decode.dp_sise"]
    assert 'unknown key "dp_sise"' in message
    assert 'did you mean "dp_size"?' in message
    assert "allowed keys in decode: nodes, replicas" in message


def test_key_in_the_wrong_section_points_at_its_home(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "block_size: 64\n")
    assert "it belongs in model.block_size" in issues["block_size"]


def test_wrong_type(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, 'model:\n  block_size: "sixteen"\n  max_model_len: "4096"\n')
    assert issues["model.block_size"] == '"sixteen" is not an integer'
    assert issues["model.max_model_len"] == '"4096" is not an integer; write 4096 without quotes'


def test_bools_are_true_or_false(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "decode:\n  ep: yes\n")
    assert issues["decode.ep"] == '"yes" is not a boolean; write true or false'


def test_null_value_names_the_default(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "workload:\n  concurrency:\n")
    assert "the key has no value" in issues["workload.concurrency"]
    assert "default (8)" in issues["workload.concurrency"]


def test_bad_enum_lists_allowed_values(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "router:\n  policy: precize\n")
    message = issues["router.policy"]
    assert message.startswith('"precize" is not a valid choice (did you mean "precise"?)')
    assert "use one of: precise, approximate, round-robin, least-loaded, random" in message


def test_dp_size_not_a_multiple_of_gpus_per_node(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "decode: {nodes: 2, gpus_per_node: 8, dp_size: 3}\n")
    assert issues["decode.dp_size"].startswith("3 is not a multiple of decode.gpus_per_node (8)")
    assert issues["decode"].startswith(
        "dp_size (3) x tp_size (1) = 3 GPUs per replica, but nodes/replicas x gpus_per_node = 2 x 8 = 16"
    )
    assert "set dp_size to 16" in issues["decode"]


def test_gpus_per_replica_mismatch_on_one_node(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "prefill: {nodes: 1, gpus_per_node: 8, tp_size: 2, dp_size: 2}\n")
    assert issues["prefill"].startswith(
        "dp_size (2) x tp_size (2) = 4 GPUs per replica, but nodes/replicas x gpus_per_node = 1 x 8 = 8"
    )
    assert "prefill.dp_size" not in issues  # one node: no whole-node rule


def test_nodes_not_divisible_by_replicas(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "decode: {nodes: 47, replicas: 3, gpus_per_node: 8, dp_size: 128}\n")
    message = issues["decode.nodes"]
    assert message.startswith("47 is not a multiple of decode.replicas (3)")
    assert "use nodes 45 or 48" in message


def test_ep_needs_more_than_one_rank(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "decode: {ep: true}\n")
    assert "needs more than one rank per replica" in issues["decode.ep"]


def test_decode_needs_a_node(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "decode: {nodes: 0}\n")
    assert "decode needs at least 1 node" in issues["decode.nodes"]


def test_bad_size_string(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "kv:\n  cpu_bytes: 100 gigs\n")
    assert issues["kv.cpu_bytes"].startswith("\"100 gigs\" has an unknown unit 'gigs'")
    assert '"100GiB", "512MiB", "1.5TB"' in issues["kv.cpu_bytes"]
    ambiguous = issues_of(tmp_path, "kv:\n  cpu_bytes: 100G\n")["kv.cpu_bytes"]
    assert "ambiguous unit 'G'; write 100GiB (powers of 2) or 100GB (powers of 10)" in ambiguous


@pytest.mark.parametrize("time", ["1:2:3:4", "soon", "12:75", "1-25:61:00", "-5"])
def test_bad_slurm_time(tmp_path: Path, time: str) -> None:
    issues = issues_of(tmp_path, f'slurm:\n  time: "{time}"\n')
    assert f'"{time}" is not a Slurm time limit' in issues["slurm.time"]
    assert "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS" in issues["slurm.time"]


@pytest.mark.parametrize("time", ["30", "30:00", "04:00:00", "1-12", "1-12:30", "2-00:00:00", 90])
def test_good_slurm_times(time: str | int) -> None:
    assert parse_spec({"slurm": {"time": time}}).slurm.time == str(time)


def test_bad_slurm_mem_and_sbatch(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "slurm:\n  mem: 64GB\n  extra_sbatch: [--exclusive, exclusive]\n")
    assert "is not a Slurm memory size" in issues["slurm.mem"]
    assert issues["slurm.extra_sbatch.1"].startswith('"exclusive" is not an sbatch option')


def test_xxhash_without_seed(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "model:\n  hash_algo: xxhash\n")
    message = issues["model.hash_seed"]
    assert "random per-process hash seed" in message
    assert "set model.hash_seed" in message and "sha256" in message
    assert parse_spec({"model": {"hash_algo": "xxhash", "hash_seed": "7"}}).model.hash_seed == "7"


def test_bad_hash_seed(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "model:\n  hash_seed: random\n")
    assert "is not a valid PYTHONHASHSEED" in issues["model.hash_seed"]


def test_vllm_without_model_path(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, 'engine: {kind: vllm}\nmodel: {path: ""}\n')
    assert 'engine.kind "vllm" loads real weights' in issues["model.path"]


def test_vllm_on_cpu_needs_blocks_of_32(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "engine: {kind: vllm, gpu: cpu}\nmodel: {block_size: 16}\n")
    assert issues["model.block_size"].startswith("16 does not run on vLLM's CPU build")
    assert "use 32" in issues["model.block_size"]
    # The simulated engine on the CPU profile, and vLLM on GPUs, take any valid block size; 64 is fine on CPU.
    for engine, block in (("{kind: sim, gpu: cpu}", 16), ("{kind: vllm}", 16), ("{kind: vllm, gpu: cpu}", 64)):
        spec = load_spec(write(tmp_path, f"engine: {engine}\nmodel: {{block_size: {block}}}\n"))
        assert spec.model.block_size == block


def test_kv_too_small_for_one_request(tmp_path: Path) -> None:
    text = "model:\n  block_size: 16\n  max_model_len: 4096\nkv:\n  gpu_blocks: 256\n"
    msg = issues_of(tmp_path, text)["kv.gpu_blocks"]
    assert "cannot hold one request of model.max_model_len 4096 (needs 257" in msg and "raise kv.gpu_blocks" in msg
    load_spec(write(tmp_path, text.replace("256", "257")))


def test_bad_block_size(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "model: {block_size: 12}\n")
    assert issues["model.block_size"].startswith("12 is not a valid block size; use 1 or a multiple of 8")


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, "decode:\n  port: 8200\n  nodes: 1\n  port: 8300\n"))
    [issue] = info.value.errors
    assert issue.path == "decode.port"
    assert issue.line == 4
    assert 'duplicate key "port", first given at line 2' in issue.message


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\nmodel:\n  path: [a\n  block_size: 16\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert text.startswith(f"{path}: YAML syntax error at line 4, column")
    assert info.value.errors[0].line == 4


def test_tabs_get_a_hint(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="indents with spaces, not tabs"):
        load_spec(write(tmp_path, "model:\n\tpath: x\n"))


def test_unknown_scorer_weight(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "router:\n  weights: {prefx: 1.0}\n")
    message = issues["router.weights.prefx"]
    assert message.startswith('unknown scorer "prefx" (did you mean "prefix"?)')
    assert "prefix, approximate-prefix, kv-util, queue, load-aware, token-load, no-hit-lru" in message


def test_negative_weight(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "router:\n  weights: {prefix: 2, queue: -1}\n  tier_weights: {cpu: -0.5}\n")
    assert issues["router.weights.queue"].startswith("-1 is negative; weights must be >= 0")
    assert issues["router.tier_weights.cpu"].startswith("-0.5 is negative")


def test_api_key_env_must_be_a_name(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "router:\n  api_key_env: sk-abc123\n")
    assert "never the key itself" in issues["router.api_key_env"]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert f"no such spec file: {path}" in str(info.value)


def test_empty_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"spec is empty; start from examples/tiny-local\.yaml"):
        load_spec(write(tmp_path, "# nothing yet\n"))
    with pytest.raises(SpecError, match="must be a mapping of sections"):
        load_spec(write(tmp_path, "- model\n- decode\n"))
    with pytest.raises(SpecError, match="must be a mapping of sections"):
        parse_spec(["model"])


def test_trace_profile_needs_trace_path(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "workload: {profile: trace}\n")
    assert 'profile "trace" replays a recorded trace' in issues["workload.trace_path"]
    assert parse_spec({"workload": {"profile": "trace", "trace_path": "t.jsonl"}}).workload.trace_path == "t.jsonl"


def test_bad_name(tmp_path: Path) -> None:
    issues = issues_of(tmp_path, "name: My Run\n")
    assert issues["name"].startswith('"My Run" is not a valid name')


def test_many_errors_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: ok-name
        model:
          block_size: sixteen
          hash_algo: xxhash
        decode:
          nodes: 2
          gpus_per_node: 8
          dp_size: 3
        router:
          policy: fastest
        workload:
          profile: trace
        mystery: 1
        """,
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    paths = [issue.path for issue in info.value.errors]
    # Type errors and the semantic checks of the sections that did parse come back together.
    assert set(paths) >= {
        "model.block_size",
        "router.policy",
        "mystery",
        "decode.dp_size",
        "decode",
        "workload.trace_path",
    }
    # model failed to parse, so its semantic check (hash seed) waits until block_size is fixed.
    assert "model.hash_seed" not in paths
    lines = str(info.value).splitlines()
    assert len(lines) == len(paths)
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert f"{path}: decode.dp_size: 3 is not a multiple of decode.gpus_per_node (8)" in str(info.value)


def test_issues_point_at_lines(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, "name: x\ndecode:\n  nodes: 2\n  gpus_per_node: 8\n"))
    lines = {issue.path: issue.line for issue in info.value.errors}
    # dp_size is defaulted (1, not a multiple of 8 nor 16 GPUs), so both issues point at the decode section.
    assert lines == {"decode.dp_size": 2, "decode": 2}


def test_building_an_invalid_spec_in_python_raises_spec_error() -> None:
    with pytest.raises(SpecError) as info:
        DeploymentSpec(decode=PoolSpec(nodes=2, gpus_per_node=8, dp_size=3))
    assert {issue.path for issue in info.value.errors} == {"decode.dp_size", "decode"}


def test_pools_share_one_type_with_role_ports() -> None:
    spec = DeploymentSpec(prefill=PoolSpec(), decode=PoolSpec(nodes=2, dp_size=2))
    assert (spec.prefill.port, spec.decode.port) == (8100, 8200)
    assert DeploymentSpec(decode=PoolSpec(port=9000)).decode.port == 9000
    assert parse_spec({"decode": {"nodes": 1}}).decode.port == 8200


def test_a_pool_whose_port_layout_passes_65535_is_refused_naming_the_highest_base() -> None:
    """The layout reaches base + 5000 + replicas for a DP pool (its DP RPC ports), base + 4000 + ranks without DP: the
    highest base the message offers is accepted, one more is refused."""
    dp = {"nodes": 2, "replicas": 2, "dp_size": 2, "gpus_per_node": 2}  # DP RPC ports: base + 5000, + 5001
    assert parse_spec({"decode": {**dp, "port": 60534}}).decode.port == 60534
    with pytest.raises(SpecError) as info:
        parse_spec({"decode": {**dp, "port": 60535}})
    (issue,) = info.value.errors
    assert issue.path == "decode.port" and "last port at 65536" in issue.message
    assert "at most 60534" in issue.message and "DP RPC" in issue.message
    plain = {"nodes": 3, "replicas": 3, "port": 61533}  # 3 replicas of one rank: per-rank HTTP ports up to base + 4002
    assert parse_spec({"decode": plain}).decode.port == 61533
    with pytest.raises(SpecError, match=r"decode\.port: 61534 .* at most 61533, or \"auto\""):
        parse_spec({"decode": {**plain, "port": 61534}})
    assert parse_spec({"decode": {**dp, "port": "auto"}}).decode.port == "auto"


def test_a_pool_with_more_ranks_than_its_port_bands_hold_is_refused() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"decode": {"nodes": 126, "replicas": 1, "dp_size": 1008, "gpus_per_node": 8}})
    assert [issue.path for issue in info.value.errors] == ["decode"]
    assert "1008 DP ranks" in str(info.value) and "room for 1000" in str(info.value)


def test_spec_issue_str() -> None:
    assert str(SpecIssue("decode.dp_size", "3 is bad", 7)) == "decode.dp_size: 3 is bad (line 7)"
    assert str(SpecIssue("", "spec is empty")) == "spec is empty"


# ---- CLI -------------------------------------------------------------------------------------------------------------


def test_cli_check_ok(capsys: pytest.CaptureFixture[str]) -> None:
    path = EXAMPLES / "glm52-544gpu.yaml"
    assert main(["spec", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == f"{path}: ok (glm52-544gpu: prefill 160 GPUs, decode 384 GPUs, engine vllm, policy precise)\n"


def test_cli_check_reports_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = EXAMPLES / "tiny-local.yaml"
    bad = write(tmp_path, "decode:\n  dp_size: two\nrouter:\n  policy: fastest\n", "bad.yaml")
    missing = tmp_path / "missing.yaml"
    assert main(["spec", "check", str(good), str(bad), str(missing)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{good}: ok (tiny-local: prefill 1 GPUs, decode 1 GPUs, engine sim, policy precise)"
    assert out[1] == f'{bad}: decode.dp_size: "two" is not an integer (line 2)'
    assert out[2].startswith(f'{bad}: router.policy: "fastest" is not a valid choice')
    assert out[3].startswith(f"{missing}: no such spec file")


def test_cli_show_defaults_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "show"]) == 0
    defaults = capsys.readouterr().out
    assert parse_spec_text(defaults) == DeploymentSpec()
    assert main(["spec", "show", str(EXAMPLES / "glm52-544gpu.yaml")]) == 0
    assert "cpu_bytes: 137438953472" in capsys.readouterr().out


def test_cli_show_invalid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write(tmp_path, "name: x\nname: y\n")
    assert main(["spec", "show", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f'{bad}: name: duplicate key "name"' in captured.err


def test_python_tags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="without !! tags"):
        load_spec(write(tmp_path, "name: !!python/object/apply:os.system [ls]\n"))


def test_spec_literals_match_the_registries() -> None:
    # The spec keeps its Literals (pydantic's validation and messages); each registry entry must be one of them and
    # each of them must have an entry, so adding a kind or profile is one registration plus one Literal value.
    from typing import get_args

    from llmd.engines.kinds import ENGINE_KINDS
    from llmd.spec.model import EngineKind, WorkloadProfile
    from llmd.workload.profiles import PROFILE_BUILDERS, REPLAY_PROFILE

    assert set(get_args(EngineKind)) == set(ENGINE_KINDS)
    assert set(get_args(WorkloadProfile)) == {*PROFILE_BUILDERS, REPLAY_PROFILE}


def test_scorer_weights_follow_the_plugin_registry(tmp_path: Path) -> None:
    # RouterSpec.weights keys are validated against the router's scorer registry (no Literal to keep in step): every
    # registered scorer is a valid key, the defaults name registered scorers, and a registered scorer is valid at once.
    from llmd.router.scheduling import ScorerPlugin, register_scorer, scorer_names, unregister_scorer
    from llmd.router.scheduling.load import QueueScorer
    from llmd.spec.model import RouterSpec

    assert set(RouterSpec().weights) <= set(scorer_names())
    assert set(RouterSpec(weights=dict.fromkeys(scorer_names(), 1.0)).weights) == set(scorer_names())
    register_scorer(ScorerPlugin("my-scorer", lambda setup: QueueScorer()))
    try:
        assert load_spec(write(tmp_path, "router:\n  weights: {my-scorer: 1.0}\n")).router.weights == {"my-scorer": 1.0}
    finally:
        unregister_scorer("my-scorer")
    message = issues_of(tmp_path, "router:\n  weights: {my-scorer: 1.0}\n")["router.weights.my-scorer"]
    assert message.startswith('unknown scorer "my-scorer"') and ", ".join(scorer_names()) in message
