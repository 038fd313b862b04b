"""Bad input as users make it: each case ends in one clean line naming the culprit, the right exit code, no traceback,
in bounded time, and loses nothing saved before.

The config, data, model, tokenizer, reward and checkpoint cases run `megatron_rl.cli.main(argv)` in this process with
the console captured at the file-descriptor level: the console script calls exactly that function, so this is what a
user sees, without one interpreter (and one torch import) per case. A few run as real processes: the command line
itself, two processes under torchrun (the message printed once), the conversion tools, and a run killed with SIGKILL
while it saves a checkpoint, then resumed.

Exit codes (megatron_rl.errors): 2 bad input, 1 a runtime failure the project explains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.models.tiny import make_tiny_model_dir
from tests.distributed.harness import run_distributed
from tests.extras import VLLM_EXTRA
from tests.unit.test_checkpoint_no_code import EXTRA_STATE, RunsCodeAndReturns, _repoint, _save, _torch_save

REPO = Path(__file__).resolve().parents[2]
PRESET = str(REPO / "configs" / "tiny-gspo.yaml")
CASE_SECONDS = 60  # one in-process case; a hang would take forever
needs_vllm = pytest.mark.extra(VLLM_EXTRA, "vllm")  # the case gets as far as the engine
FAST = ["train.steps=1", "train.prompts_per_step=2", "rollout.n_samples=2", "logging.progress_bar=false"]
RESUMED_STATE = {"weight_version": 1, "optimizer_steps": 1, "scheduler": {}, "data": None}
"""What a resume reads of trainer_state.json besides the step (checkpoint.state.RESUME_FIELDS)."""


@dataclass(kw_only=True)
class Case:
    name: str
    argv: Callable[[Path, Path], list[str]]
    """(corpus root, this case's directory) -> the command's arguments after `megatron-rl`."""
    code: int
    culprit: list[str]
    """Substrings the one-line message must hold (the value, the file/row/key, the fix)."""
    untouched: list[str] = field(default_factory=list)
    """Paths under the corpus root that must not change (saved checkpoints, inputs)."""
    absent: list[str] = field(default_factory=list)
    """Paths under the case directory that must not be created."""
    engine: bool = False
    """The case gets past the start-up checks to the engine (vLLM)."""


def _train(*extra: str, model: str = "model") -> Callable[[Path, Path], list[str]]:
    def argv(root: Path, case: Path) -> list[str]:
        subst = [e.replace("{root}", str(root)).replace("{case}", str(case)) for e in extra]
        return ["train", "--config", PRESET, f"model.path={root / model}", f"logging.dir={case / 'out'}",
                f"checkpoint.dir={case / 'ckpt'}", *FAST, *subst]
    return argv


def _raw(*args: str) -> Callable[[Path, Path], list[str]]:
    return lambda root, case: [a.replace("{root}", str(root)).replace("{case}", str(case)) for a in args]


def _write_rows(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """One tiny model, its broken variants, data files, rewards and checkpoints (saved, half-written, foreign)."""
    root = tmp_path_factory.mktemp("corpus")
    model = make_tiny_model_dir(root / "model", "qwen3_moe", seed=0)
    config = json.loads((model / "config.json").read_text())

    def variant(name: str, change: Callable[[Path], None]) -> None:
        shutil.copytree(model, root / name)
        change(root / name)

    variant("no_config", lambda d: (d / "config.json").unlink())
    variant("bad_json", lambda d: (d / "config.json").write_text("{\"model_type\": \"qwen3_moe\", "))
    variant("no_hidden", lambda d: (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"})))
    variant("unsupported", lambda d: (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"]})))
    # model_type names another model than architectures: megatron_rl builds it (by architectures), vLLM cannot start
    variant("engine_refuses", lambda d: (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt_bigcode"})))
    variant("list_config", lambda d: (d / "config.json").write_text("[1, 2]"))

    def truncate(d: Path) -> None:
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])

    variant("truncated", truncate)

    def reshape(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:-8].clone()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    variant("wrong_shape", reshape)

    def reshape_query(d: Path) -> None:  # 120 rows where config.json implies 128: the split per head group fails
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        name = "model.layers.0.self_attn.q_proj.weight"
        tensors[name] = tensors[name][:-8].clone()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    variant("wrong_shape_query", reshape_query)

    def nan_weights(d: Path) -> None:  # a diverged or corrupt checkpoint: every logit NaN, in the engine as in the actor
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    variant("nan_weights", nan_weights)
    variant("no_weights", lambda d: (d / "model.safetensors").unlink())

    def drop_tokenizer(d: Path) -> None:
        for name in ("tokenizer.model", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"):
            (d / name).unlink(missing_ok=True)

    variant("no_tokenizer", drop_tokenizer)

    data = root / "data"
    data.mkdir()
    good = [{"prompt": "abc", "answer": "a"}] * 8
    _write_rows(data / "good.jsonl", good)
    (data / "empty.jsonl").write_text("")
    (data / "truncated.jsonl").write_text(json.dumps(good[0]) + "\n" + '{"prompt": "ab')
    _write_rows(data / "no_prompt.jsonl", [{"question": "abc", "answer": "a"}] * 4)
    _write_rows(data / "no_answer.jsonl", [{"prompt": "abc"}] * 4)
    _write_rows(data / "empty_prompt.jsonl", [{"prompt": "", "answer": "a"}] * 4)
    _write_rows(data / "not_object.jsonl", [[1, 2]] * 4)
    _write_rows(data / "long.jsonl", [{"prompt": "abc " * 60, "answer": "a"}] * 4)
    _write_rows(data / "one_long.jsonl", [*good, {"prompt": "abc " * 60, "answer": "a"}])
    (data / "rows.csv").write_text("prompt,answer\nabc,a\n")
    (data / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    (data / "dict.json").write_text(json.dumps({"prompt": "abc"}))
    (data / "broken.json").write_text('[{"prompt": "abc", ')

    (root / "bad.yaml").write_text("train:\n  steps: [1, 2\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "self.yaml").write_text("defaults: [self.yaml]\n")
    (root / "includes_missing.yaml").write_text("defaults: [models/tiny-mo.yaml]\n")
    (root / "afile").write_text("a file where a directory is expected\n")
    (root / "rewards_mod.py").write_text("def always_raises(response, answer, *, prompt=''):\n    raise KeyError('score')\n")

    ckpts = root / "ckpts"
    half = ckpts / "half" / "step_00000002"
    half.mkdir(parents=True)
    (half / "metadata.json").write_text("{}")
    nowhere = ckpts / "nowhere"
    nowhere.mkdir()
    (nowhere / "latest").write_text("step_00000099\n")
    garbage = ckpts / "garbage"
    garbage.mkdir()
    (garbage / "latest").write_text("yesterday\n")
    foreign = ckpts / "foreign" / "step_00000001"
    foreign.mkdir(parents=True)
    (foreign / "metadata.json").write_text("{}")
    arch = {"num_layers": 4, "hidden_size": 4096}  # another model's architecture, as a save records it
    (foreign / "trainer_state.json").write_text(json.dumps({"step": 1, "model_architecture": arch}))
    (ckpts / "foreign" / "latest").write_text("step_00000001\n")
    pickled = ckpts / "pickled" / "step_00000001"  # a checkpoint from elsewhere whose rank file would run code
    pickled.mkdir(parents=True)
    (pickled / "metadata.json").write_text("{}")
    (pickled / "trainer_state.json").write_text(json.dumps({"step": 1, **RESUMED_STATE}))
    torch.save({"rng": {}, "extra": RunsCode(pickled / "code_ran")}, pickled / "rank_00000.pt")
    (ckpts / "pickled" / "latest").write_text("step_00000001\n")
    not_utf8 = ckpts / "not_utf8"  # `latest` and trainer_state.json with bytes that are not UTF-8
    (not_utf8 / "step_00000001").mkdir(parents=True)
    (not_utf8 / "latest").write_bytes(b"step_0000000\xb9\n")
    (not_utf8 / "step_00000001" / "metadata.json").write_text("{}")
    (not_utf8 / "step_00000001" / "trainer_state.json").write_bytes(b'{"step": 1, "note": "caf\xe9"}')
    # a checkpoint this project saved (the model's actor after one step), one bytes item of its data files replaced by
    # a well-formed torch.save that writes a file and gives back the item's own value when unpickled
    run_distributed(_save, 1, str(model), str(ckpts / "code_in_data"), timeout=300)
    _repoint(ckpts / "code_in_data" / "step_00000001", EXTRA_STATE,
             _torch_save(RunsCodeAndReturns(ckpts / "code_in_data" / "code_ran", [None])))
    (root / "token_644").write_text("a-token-of-the-bad-input-corpus-0123\n")
    (root / "token_644").chmod(0o644)
    return root


class RunsCode:
    """Unpickling it writes `marker` (a checkpoint file that would run code)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


CASES = [
    # -- the config file and the command line
    Case(name="malformed_yaml", argv=_raw("train", "--config", "{root}/bad.yaml"), code=2, culprit=["bad.yaml", "not valid YAML"]),
    Case(name="missing_config_file", argv=_raw("train", "--config", "{root}/nope.yaml"), code=2, culprit=["nope.yaml", "does not exist"]),
    Case(name="yaml_not_a_mapping", argv=_raw("train", "--config", "{root}/list.yaml"), code=2, culprit=["list.yaml", "mapping"]),
    Case(name="preset_includes_itself", argv=_raw("train", "--config", "{root}/self.yaml"), code=2, culprit=["self.yaml", "includes itself"]),
    Case(name="preset_includes_a_missing_file", argv=_raw("train", "--config", "{root}/includes_missing.yaml"), code=2,
         culprit=["includes_missing.yaml' includes", "models/tiny-mo.yaml", "does not exist", "defaults list"]),
    Case(name="unknown_key", argv=_train("train.stepz=5"), code=2, culprit=["stepz", "steps"]),
    Case(name="unknown_section", argv=_train("trainer.steps=5"), code=2, culprit=["trainer"]),
    Case(name="wrong_type", argv=_train("train.steps=many"), code=2, culprit=["train.steps", "many"]),
    Case(name="bad_choice", argv=_train("model.dtype=float8"), code=2, culprit=["model.dtype", "float8"]),
    Case(name="override_without_value", argv=_raw("train", "--config", PRESET, "train.steps"), code=2, culprit=["train.steps"]),
    Case(name="unknown_option", argv=_raw("train", "--config", PRESET, "--stepz", "3"), code=2, culprit=["--stepz"]),
    Case(name="impossible_layout", argv=_train("parallel.expert_parallel=3"), code=2, culprit=["expert_parallel", "3"]),
    Case(name="negative_weight_decay", argv=_train("optimizer.weight_decay=-0.5"), code=2, culprit=["optimizer.weight_decay=-0.5", ">= 0"]),
    Case(name="beta2_above_one", argv=_train("optimizer.adam_beta2=1.5"), code=2, culprit=["optimizer.adam_beta2=1.5", "[0, 1)"]),
    Case(name="zero_adam_eps", argv=_train("optimizer.adam_eps=0"), code=2, culprit=["optimizer.adam_eps=0"]),
    Case(name="negative_lr", argv=_train("optimizer.lr=-1"), code=2, culprit=["optimizer.lr=-1"]),
    Case(name="prompt_and_response_exceed_positions", argv=_train("rollout.max_prompt_tokens=500", "rollout.max_new_tokens=100"), code=2,
         culprit=["rollout.max_prompt_tokens + rollout.max_new_tokens", "600", "512 positions"], absent=["ckpt/step_00000001"]),
    Case(name="plan_missing_model_config", argv=_raw("plan", "--config", PRESET, "--model-config", "{root}/none.json"), code=2,
         culprit=["none.json", "not a file", "leave --model-config out"]),
    # -- the model directory
    Case(name="missing_model_dir", argv=_train(model="typo/tiny-moe"), code=2, culprit=["typo/tiny-moe", "does not exist", "model.make_tiny=true"],
         absent=["out", "ckpt"]),
    Case(name="model_dir_without_config_json", argv=_train(model="no_config"), code=2, culprit=["no_config", "no config.json"]),
    Case(name="config_json_not_json", argv=_train(model="bad_json"), code=2, culprit=["bad_json/config.json", "not valid JSON"]),
    Case(name="config_json_without_hidden_size", argv=_train(model="no_hidden"), code=2, culprit=["hidden_size"]),
    Case(name="unsupported_model_type", argv=_train(model="unsupported"), code=2, culprit=["gpt_bigcode"]),
    Case(name="config_json_not_an_object", argv=_train(model="list_config"), code=2, culprit=["list_config", "list"]),
    Case(name="truncated_safetensors", argv=_train(model="truncated"), code=2, culprit=["truncated/model.safetensors", "truncated or damaged"]),
    Case(name="wrong_shape_safetensors", argv=_train(model="wrong_shape"), code=2, culprit=["model.norm.weight", "download"]),
    Case(name="wrong_shape_query_projection", argv=_train(model="wrong_shape_query"), code=2,
         culprit=["'model.layers.0.self_attn.q_proj.weight' of shape (120, 64)", "do not match config.json", "download"]),
    Case(name="no_weights", argv=_train(model="no_weights"), code=2, culprit=["no_weights", "safetensors", "model.load_weights=false"]),
    Case(name="missing_tokenizer", argv=_train(model="no_tokenizer"), code=2, culprit=["no_tokenizer", "holds no tokenizer", "data.tokenizer"]),
    Case(name="tokenizer_path_missing", argv=_train("data.tokenizer={root}/tok.model"), code=2, culprit=["tok.model", "data.tokenizer"]),
    Case(name="unwritable_logging_dir", argv=_train("logging.dir={root}/afile/run"), code=2, culprit=["logging.dir=", "afile/run", "not writable"]),
    Case(name="unwritable_checkpoint_dir", argv=_train("checkpoint.dir={root}/afile/ckpt"), code=2, culprit=["checkpoint.dir=", "afile/ckpt", "not writable"]),
    # -- data
    Case(name="missing_dataset", argv=_train("data.path={root}/data/none.jsonl"), code=2, culprit=["none.jsonl", "does not exist", "data.path"]),
    Case(name="empty_dataset", argv=_train("data.path={root}/data/empty.jsonl"), code=2, culprit=["empty.jsonl", "no rows"]),
    Case(name="truncated_jsonl", argv=_train("data.path={root}/data/truncated.jsonl"), code=2, culprit=["truncated.jsonl:2", "not valid JSON"]),
    Case(name="rows_without_prompt", argv=_train("data.path={root}/data/no_prompt.jsonl"), code=2, culprit=["no_prompt.jsonl", "'prompt'", "data.prompt_key"]),
    Case(name="rows_without_answer", argv=_train("data.path={root}/data/no_answer.jsonl"), code=2, culprit=["no_answer.jsonl", "'answer'", "data.answer_key"]),
    Case(name="empty_prompts", argv=_train("data.path={root}/data/empty_prompt.jsonl"), code=2, culprit=["empty_prompt.jsonl", "empty"]),
    Case(name="rows_not_objects", argv=_train("data.path={root}/data/not_object.jsonl"), code=2, culprit=["not_object.jsonl", "JSON object"]),
    Case(name="all_prompts_too_long", argv=_train("data.path={root}/data/long.jsonl"), code=2, culprit=["long.jsonl", "rollout.max_prompt_tokens=32"]),
    Case(name="long_prompt_refused", argv=_train("data.path={root}/data/one_long.jsonl", "data.long_prompts=error"), code=2,
         culprit=["one_long.jsonl", "rollout.max_prompt_tokens=32"]),
    Case(name="unsupported_dataset_format", argv=_train("data.path={root}/data/rows.csv"), code=2, culprit=["rows.csv", ".jsonl"]),
    Case(name="corrupt_parquet", argv=_train("data.path={root}/data/bad.parquet"), code=2, culprit=["bad.parquet"]),
    Case(name="json_not_json", argv=_train("data.path={root}/data/broken.json"), code=2, culprit=["broken.json", "not valid JSON"]),
    Case(name="json_not_a_list", argv=_train("data.path={root}/data/dict.json"), code=2, culprit=["dict.json", "list of rows"]),
    # -- rewards
    Case(name="unknown_reward", argv=_train("data.reward=exactly"), code=2, culprit=["exactly", "exact"]),
    Case(name="unimportable_reward_module", argv=_train("data.reward=no_such_module:score"), code=2, culprit=["no_such_module", "PYTHONPATH"]),
    Case(name="reward_function_missing", argv=_train("data.reward=json:no_such_function"), code=2, culprit=["json", "no_such_function"]),
    Case(name="unimportable_agent_class", argv=_train("rollout.agent=no_such_agents:Solver"), code=2,
         culprit=["rollout.agent", "no_such_agents", "PYTHONPATH"]),
    Case(name="agent_class_missing", argv=_train("rollout.agent=json:NoSuchAgent"), code=2, culprit=["rollout.agent", "NoSuchAgent"]),
    # -- checkpoints
    Case(name="resume_half_written", argv=_train("checkpoint.resume={root}/ckpts/half/step_00000002"), code=2,
         culprit=["step_00000002", "incomplete"], untouched=["ckpts/half"]),
    Case(name="latest_points_nowhere", argv=_train("checkpoint.dir={root}/ckpts/nowhere", "checkpoint.resume=auto"), code=2,
         culprit=["step_00000099", "does not exist"], untouched=["ckpts/nowhere"]),
    Case(name="latest_garbage", argv=_train("checkpoint.dir={root}/ckpts/garbage", "checkpoint.resume=auto"), code=2,
         culprit=["latest", "yesterday"], untouched=["ckpts/garbage"]),
    Case(name="resume_missing_dir", argv=_train("checkpoint.resume={root}/ckpts/gone"), code=2, culprit=["ckpts/gone", "checkpoint.resume"]),
    Case(name="resume_another_model", argv=_train("checkpoint.dir={root}/ckpts/foreign", "checkpoint.resume=auto"), code=2,
         culprit=["foreign/step_00000001", "another model", "model.path=", "hidden_size"], untouched=["ckpts/foreign"]),
    Case(name="resume_pickled_code", argv=_train("checkpoint.dir={root}/ckpts/pickled", "checkpoint.resume=auto"), code=2,
         culprit=["pickled/step_00000001/rank_00000.pt", "unpickling can run code", "tools/convert_rank_state.py"],
         untouched=["ckpts/pickled"]),  # no code_ran file appears
    Case(name="resume_code_in_a_data_file", argv=_train("checkpoint.dir={root}/ckpts/code_in_data", "checkpoint.resume=auto"),
         code=2, culprit=["code_in_data/step_00000001/__0_0.distcp", EXTRA_STATE, "asks to load builtins.eval",
                          "checkpoint.resume=none"], untouched=["ckpts/code_in_data"]),  # no code_ran file appears
    Case(name="latest_not_utf8", argv=_train("checkpoint.dir={root}/ckpts/not_utf8", "checkpoint.resume=auto"), code=2,
         culprit=["not_utf8/latest is not UTF-8 text", "checkpoint.resume=none"], untouched=["ckpts/not_utf8"]),
    Case(name="trainer_state_not_utf8", argv=_train("checkpoint.resume={root}/ckpts/not_utf8/step_00000001"), code=2,
         culprit=["not_utf8/step_00000001/trainer_state.json is not UTF-8 text", "checkpoint.resume=none"],
         untouched=["ckpts/not_utf8"]),
    # -- rollout servers: `serve` where other hosts reach it needs the run's token
    Case(name="serve_other_hosts_without_token", argv=_raw("serve", "--dry-run", "--config", PRESET, "model.path={root}/model",
                                                           "--host", "0.0.0.0"), code=2,
         culprit=["--host 0.0.0.0", "rollout.server_token_file", "MEGATRON_RL_SERVER_TOKEN"]),
    Case(name="server_token_file_others_can_read", argv=_raw("serve", "--dry-run", "--config", PRESET, "model.path={root}/model",
                                                             "rollout.server_token_file={root}/token_644"), code=2,
         culprit=["token_644", "mode 644", "chmod 600"]),
    # -- the engine (one that cannot start runs as a process of its own below: a vLLM start that fails in a process
    # leaves vLLM's process-group state behind, which would break every later engine of this test process)
    # (a run that gets past the start-up checks: they said where it writes and the free space there)
    Case(name="nan_engine_logprobs", argv=_train(model="nan_weights"), code=1, culprit=["NaN", "checkpoint.dir=", "GiB free"],
         absent=["ckpt/step_00000001"], engine=True),
]


def _snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under `path` with its size and modification time."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}


def _check_console(text: str, culprit: list[str]) -> None:
    assert "Traceback" not in text and "Logging error" not in text, text[-4000:]
    for piece in culprit:
        assert piece in text, f"{piece!r} not in the console output:\n{text[-3000:]}"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[needs_vllm] if c.engine else []) for c in CASES])
def test_bad_input_in_process(case: Case, corpus: Path, tmp_path: Path, capfd):
    before = {u: _snapshot(corpus / u) for u in case.untouched}
    argv = case.argv(corpus, tmp_path)
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage errors exit 2 by themselves
        code = stop.code
    seconds = time.perf_counter() - start
    out, err = capfd.readouterr()
    assert code == case.code, f"exit {code}, wanted {case.code}:\n{err[-3000:]}"
    _check_console(out + err, case.culprit)
    assert seconds < CASE_SECONDS, f"{case.name} took {seconds:.0f} s"
    for u in case.untouched:
        assert _snapshot(corpus / u) == before[u], f"{u} changed"
    for a in case.absent:
        assert not (tmp_path / a).exists(), f"{a} was created"


# ---- real processes ------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _run(cmd: list[str], timeout: float, cwd: Path = REPO, **extra_env: str) -> tuple[int, str, float]:
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env={**_env(), **extra_env}, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr, time.perf_counter() - start




def test_command_line_refuses_a_typed_model_path_and_creates_nothing(corpus, tmp_path):
    """A tiny preset with a mistyped model.path once trained a random model in silence."""
    typo = tmp_path / "nonexistent"
    code, text, seconds = _run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", PRESET, f"model.path={typo}",
                                f"logging.dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ckpt'}"], timeout=120, cwd=tmp_path)
    assert code == 2, text
    _check_console(text, [f"model.path={str(typo)!r} does not exist", "model.make_tiny=true"])
    assert len([line for line in text.splitlines() if line.strip()]) == 1, text
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing may be created"
    assert seconds < 60


@needs_vllm
def test_an_engine_that_cannot_start_on_the_model_is_one_line(corpus, tmp_path):
    code, text, seconds = _run([sys.executable, "-m", "megatron_rl.cli", *_train(model="engine_refuses")(corpus, tmp_path)],
                               timeout=180)
    assert code == 2, text[-4000:]
    _check_console(text, ["vLLM could not start on model directory", "engine_refuses"])
    assert not (tmp_path / "ckpt" / "step_00000001").exists() and seconds < 150


@needs_vllm
def test_torchrun_ends_in_rank0s_line_when_the_reward_raises(corpus, tmp_path):
    """Two processes under the launch scripts' torchrun (megatron_rl.elastic) with a restart allowed: the reward raises
    on rank 0 while rank 1 waits for the step; the job's last line is rank 0's, naming the function, exit 2 (bad input);
    the restarted attempt ends the same way at once instead of training again; torchrun's summary is in its log."""
    log = tmp_path / "out" / "logs" / "torchrun.log"
    code, text, seconds = _run([sys.executable, "-m", "megatron_rl.elastic", f"--log-file={log}", "--standalone",
                                "--nproc-per-node=2", "--max-restarts=1", "-m", "megatron_rl.cli", "train", "--config",
                                str(REPO / "configs" / "tiny-gspo-cpu2.yaml"), f"model.path={corpus / 'model'}",
                                "data.reward=rewards_mod:always_raises", f"logging.dir={tmp_path / 'out'}",
                                f"checkpoint.dir={tmp_path / 'ckpt'}", *FAST], timeout=300,
                               PYTHONPATH=os.pathsep.join([str(REPO), str(corpus)]))
    assert code == 2, text[-4000:]
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[-1].startswith("megatron-rl train: error: ") and "rewards_mod:always_raises" in lines[-1], text[-4000:]
    assert text.count("rewards_mod:always_raises") == 1, text[-4000:]
    assert "Traceback" not in text and "[rank" not in text and "FAILED" not in text and "killed" not in text, text[-4000:]
    summary = log.read_text()  # torchrun's own account, ending in the restarted attempt's replayed verdict
    assert "FAILED" in summary and "exitcode  : 2" in summary and "rewards_mod:always_raises" in summary, summary[-4000:]
    assert not (tmp_path / "ckpt" / "step_00000001").exists()
    assert seconds < 240


def test_conversion_tool_exits_2_on_a_truncated_safetensors_file(corpus, tmp_path):
    code, text, seconds = _run([sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), str(corpus / "truncated"),
                                str(tmp_path / "mc"), "--no-progress"], timeout=120)
    assert code == 2, text
    _check_console(text, ["truncated/model.safetensors", "truncated or damaged"])
    assert len([line for line in text.splitlines() if line.strip()]) == 1, text
    assert not (tmp_path / "mc").exists() and seconds < 90


def _tools():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import convert_hf_to_mcore
        import convert_mcore_to_hf
    finally:
        sys.path.remove(str(REPO / "tools"))
    return convert_hf_to_mcore, convert_mcore_to_hf


def test_conversion_tools_exit_2_on_an_unwritable_output_and_a_truncated_dist_checkpoint_shard(corpus, tmp_path, capfd):
    """In-process: each tool's main(argv) is what its script runs."""
    to_mcore, to_hf = _tools()
    assert to_mcore.main([str(corpus / "model"), str(corpus / "afile" / "mc"), "--no-progress"]) == 2
    _check_console(capfd.readouterr().err, ["afile/mc", "cannot write"])
    assert to_mcore.main([str(corpus / "model"), str(tmp_path / "mc"), "--no-progress"]) == 0
    shard = sorted((tmp_path / "mc").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capfd.readouterr()
    assert to_hf.main([str(tmp_path / "mc"), str(tmp_path / "hf"), "--no-progress"]) == 2
    _check_console(capfd.readouterr().err, ["cannot read tensors", str(tmp_path / "mc"), "truncated or damaged", "older step_"])
    assert to_hf.main([str(tmp_path / "mc"), str(corpus / "afile" / "hf"), "--no-progress"]) == 2
    _check_console(capfd.readouterr().err, ["afile/hf", "cannot write"])
    assert not (tmp_path / "hf").exists()


@needs_vllm
def test_sigkill_during_a_save_loses_nothing_and_a_raising_reward_is_named(corpus, tmp_path, capfd):
    """Step 1 is saved; the run is killed while it writes step 2; the resume starts from step 1, intact; a reward that
    always raises then stops it with one line naming the function (exit 2), and step 1 is still there. A .distcp file
    of step 1 cut in half then stops the next resume with one line naming the file."""
    ckpt = tmp_path / "ckpt"
    base = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", PRESET, f"model.path={corpus / 'model'}",
            f"logging.dir={tmp_path / 'out'}", f"checkpoint.dir={ckpt}", *FAST, "train.steps=4", "checkpoint.save_every=1"]
    proc = subprocess.Popen(base, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, partial = time.monotonic() + 240, []
    try:
        while time.monotonic() < deadline and not partial:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            partial = [p for p in ckpt.glob(".step_*.partial") if p.name != ".step_00000001.partial"] if ckpt.is_dir() else []
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert partial and partial[0].exists(), "the run was not caught while saving a checkpoint"
    killed_step = int(partial[0].name[len(".step_"):-len(".partial")])
    last = f"step_{killed_step - 1:08d}"
    assert (ckpt / "latest").read_text().strip() == last
    saved = _snapshot(ckpt / last)
    reward = "rewards_mod:always_raises"
    code, text, _ = _run([*base, "checkpoint.resume=auto", f"data.reward={reward}"], timeout=240,
                         PYTHONPATH=os.pathsep.join([str(REPO), str(corpus)]))
    assert "resumed from" in text and f"at step {killed_step - 1}" in text, text[-4000:]
    assert code == 2, text[-4000:]
    _check_console(text, ["rewards_mod:always_raises", "failed on all", "KeyError"])
    assert _snapshot(ckpt / last) == saved
    assert (ckpt / "latest").read_text().strip() == last

    shard = sorted((ckpt / last).glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capfd.readouterr()
    assert main([*base[3:], "checkpoint.resume=auto"]) == 2
    _check_console(capfd.readouterr().err, [str(shard), "of", "bytes", "truncated or damaged", "older checkpoint"])

def test_debug_prints_the_traceback_the_log_file_always_has_it_and_bugs_keep_theirs(corpus, tmp_path, capfd, monkeypatch):
    (tmp_path / "out").mkdir()
    argv = _train("data.path={root}/data/none.jsonl")(corpus, tmp_path)
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("none.jsonl") == 1
    logged = (tmp_path / "out" / "logs" / "error.log").read_text()
    assert "Traceback" in logged and "DatasetError" in logged and "none.jsonl" in logged
    assert main([*argv, "--debug"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" in err and "DatasetError" in err and "megatron-rl train: error:" in err

    from megatron_rl import trainer

    def bug(config_path, overrides, **kwargs):
        return {}["no such key"]

    monkeypatch.setattr(trainer, "main", bug)
    with pytest.raises(KeyError, match="no such key"):  # not bad input: the bug's own exception and traceback
        main(argv)
