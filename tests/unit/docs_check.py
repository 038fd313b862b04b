"""What the documentation tests check, as functions of a page's text (tests/unit/test_docs_commands.py runs them).

A page's commands are the lines of its fenced `bash` blocks (a `\\` continues a line; `#` starts a comment)
and the `$ ` lines of its `console` blocks; a preset's are the indented command lines of its header
comment. Each command is checked by what it runs, without running a job:

* `make T`: `make -n T` succeeds (the target exists, its prerequisites resolve);
* `megatron-rl SUB ...` (or `python -m megatron_rl.cli`): argparse takes every flag, the overrides are
  schema keys, and a preset loads with them; `train`, `serve` and `eval` also name a model with weights
  and a prompt file (the preset's, or an override): a GPU preset's model directory holds only its
  config.json, so a command that shows none of them cannot run as shown;
* `launch/torchrun.sh` / `sbatch ... launch/slurm.sbatch`: the script's `--dry-run` exits 0 (it plans the
  layout, and refuses what the script cannot start), plus the same input check;
* `python -m megatron_rl.X --flag`, `python tools/X.py --flag`: every flag is in the program's `--help`.

`section.key` mentions in inline code and code blocks are schema keys; the pages say nothing of how the
project is developed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("model", "parallel", "algorithm", "optimizer", "train", "rollout", "data", "checkpoint", "logging", "cluster")


@dataclass(frozen=True)
class Command:
    where: str
    """page:line, for the failure message."""
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return shlex.join(self.argv)


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first body line, body lines) of each fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"\s*```(\S*)", lines[i])
        if not opening:
            i += 1
            continue
        body, start = [], i + 2
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        blocks.append((opening.group(1), start, body))
        i += 1
    return blocks


def _split_commands(line: str) -> list[list[str]]:
    """One shell line -> the argv of each command in it (split at &&, ||, ;, |), comments dropped."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    commands, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in commands + [current] if c]


def joined_lines(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Lines with `\\` continuations joined, each with its first line's number."""
    out, pending, at = [], "", first
    for offset, line in enumerate(lines):
        if not pending:
            at = first + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((at, pending + line))
        pending = ""
    return out + ([(at, pending)] if pending else [])


def page_commands(path: Path, text: str | None = None) -> list[Command]:
    """The commands of a page's bash blocks and console blocks."""
    text = path.read_text(encoding="utf-8") if text is None else text
    name = path.relative_to(REPO) if path.is_absolute() and REPO in path.parents else path
    found = []
    for language, first, body in fenced_blocks(text):
        if language == "console":
            body = [line[2:] for line in body if line.startswith("$ ")]
        elif language not in ("bash", "sh"):
            continue
        for number, line in joined_lines(body, first):
            found += [Command(f"{name}:{number}", tuple(argv)) for argv in _split_commands(line)]
    return found


def preset_commands(path: Path) -> list[Command]:
    """The command lines of a preset's header comment (`#   command ...`, `\\` continuing it)."""
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    body, first = [], None
    for number, line in enumerate(header, start=1):
        stripped = line[1:].strip()
        if re.match(r"(megatron-rl|launch/|sbatch|python)\b", stripped) or (body and body[-1].endswith("\\")):
            first = first or number
            body.append(stripped)
    joined = joined_lines(body, first or 1)
    return [Command(f"{path.relative_to(REPO)}:{n}", tuple(argv)) for n, line in joined for argv in _split_commands(line)]


def unlabelled_command_blocks(path: Path, text: str | None = None) -> list[str]:
    """Fenced blocks without a language whose first line is a command: label them bash so they are checked."""
    text = path.read_text(encoding="utf-8") if text is None else text
    starts = ("make ", "megatron-rl ", "launch/", "sbatch ", "python -m megatron_rl", "python tools/", "pip ")
    return [f"{path.name}:{first}" for language, first, body in fenced_blocks(text)
            if not language and body and body[0].lstrip().startswith(starts)]


# ---- schema keys -------------------------------------------------------------------------------------------


def schema_keys() -> set[str]:
    """Every `section.key` of megatron_rl.config.RLConfig."""
    from megatron_rl.config.schema import RLConfig

    keys = set()
    for section in dataclasses.fields(RLConfig):
        value = section.default_factory() if section.default_factory is not dataclasses.MISSING else section.default
        keys |= {f"{section.name}.{f.name}" for f in dataclasses.fields(value)}
    return keys


_KEY = re.compile(r"(?<![\w./<-])(%s)\.([A-Za-z_]\w*)" % "|".join(SECTIONS))
_FILE_SUFFIXES = {"safetensors", "json", "jsonl", "parquet", "yaml", "py", "md", "model", "log", "png", "pt"}


def key_mentions(text: str) -> list[tuple[int, str]]:
    """(line, `section.key`) for each dotted mention in inline code or a code block (file names left out)."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for span in re.findall(r"`([^`]+)`", line) or ([line] if not line.lstrip().startswith("#") else []):
            for match in _KEY.finditer(span):
                if match.group(2) not in _FILE_SUFFIXES:
                    found.append((number, f"{match.group(1)}.{match.group(2)}"))
    return found


def unknown_keys(text: str, keys: set[str]) -> list[tuple[int, str]]:
    return [(number, key) for number, key in key_mentions(text) if key not in keys]


# ---- words of how the project is developed ----------------------------------------------------------------

DEVELOPMENT_WORDS = re.compile(
    r"\blent\b|\bgoals?\b|\bsessions?\b|\bissues? \d+|\b(this|last|next|two|earlier) stops?\b"
    r"|\bstops? (earlier|ago)\b|\baimed at\b|\bno GPU (was )?(lent|here)\b|\bthe lead\b|\bCEO\b",
    re.IGNORECASE,
)


def development_words(text: str) -> list[tuple[int, str]]:
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), start=1) for m in DEVELOPMENT_WORDS.finditer(line)]


# ---- running what a command runs ---------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """The suite's Python first on PATH (launch scripts call `python3`), no Slurm or launcher variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NPROC_", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _run(argv: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _flags(argv) -> list[str]:
    return [a.split("=")[0] for a in argv if a.startswith("--") and len(a) > 2]


def _help_lacks(program: list[str], argv) -> list[str]:
    """Flags of `argv` that `program --help` does not list."""
    result = _run([*program, "--help"])
    if result.returncode != 0:
        return [f"`{shlex.join(program)} --help` exits {result.returncode}: {result.stderr.strip()[-300:]}"]
    return [f"{flag} is not an option of {shlex.join(program)}" for flag in _flags(argv) if flag not in result.stdout]


def _cli_problems(argv: list[str], keys: set[str]) -> list[str]:
    """megatron-rl SUB ...: argparse, the overrides' keys, the preset with them, and the inputs of a run."""
    from megatron_rl.cli import build_parser

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return [f"megatron-rl does not take {shlex.join(argv)} (see megatron-rl {argv[0] if argv else ''} --help)"]
    overrides = list(getattr(args, "overrides", []) or [])
    problems = [f"{o.split('=')[0]} is not a config key" for o in overrides if "=" in o and o.split("=")[0] not in keys]
    config = getattr(args, "config", None)
    if problems or not config or not (REPO / config).is_file():
        return problems  # a user's own preset (my-preset.yaml): its keys were checked above
    return preset_problems(config, overrides, runs=args.command in ("train", "serve", "eval"), needs_data=args.command == "train")


def preset_problems(config: str, overrides: list[str], *, runs: bool, needs_data: bool) -> list[str]:
    """A preset with overrides loads; a run of it has a model with weights and, for training, prompts."""
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.models.tiny import preset_model_path, tiny_family_to_build

    try:
        cfg = load_config(RLConfig, str(REPO / config), overrides)
    except Exception as err:  # noqa: BLE001 - a config error of any kind is the finding
        return [f"{config} with {overrides} does not load: {err}"]
    if not runs:
        return []
    given = {o.split("=")[0] for o in overrides if "=" in o}
    problems = []
    model = Path(cfg.model.path) if os.path.isabs(cfg.model.path) else REPO / cfg.model.path
    has_weights = model.is_dir() and any(model.glob("*.safetensors"))
    builds_tiny = bool(tiny_family_to_build(cfg.model, preset_model_path(str(REPO / config))))
    if "model.path" not in given and cfg.model.load_weights and not (has_weights or builds_tiny):
        problems.append(f"model.path={cfg.model.path} holds no *.safetensors weights: show model.path=<the model> with it")
    data = cfg.data.path
    if needs_data and "data.path" not in given and not (data.startswith("synthetic:") or (data and (REPO / data).is_file())):
        problems.append(f"data.path={data!r} is no prompt file: show data.path=<prompts> with it")
    return problems


def _launch_problems(script: str, argv: list[str], nodes: str | None, keys: set[str]) -> list[str]:
    args = [a for a in argv if a != "--dry-run"]
    if not args or not (REPO / args[0]).is_file():  # a user's own preset (my-preset.yaml): its override keys only
        return [f"{a.split('=')[0]} is not a config key" for a in args if "=" in a and a.split("=")[0] not in keys]
    result = _run(["bash", script, "--dry-run", *(["--nodes", nodes] if nodes else []), *args])
    if result.returncode != 0:
        return [f"its --dry-run exits {result.returncode}: {result.stderr.strip().splitlines()[-1:]}"]
    return preset_problems(args[0], [a for a in args[1:] if "=" in a], runs=True, needs_data=True)


def command_problems(command: Command, keys: set[str]) -> list[str]:
    """What is wrong with one documented command ([] when it does what the page says)."""
    argv = list(command.argv)
    while argv and re.match(r"[A-Z_]+=", argv[0]):  # VAR=value before the program
        argv.pop(0)
    if not argv:
        return []
    program = argv[0]
    if program == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        variables = [a for a in argv[1:] if "=" in a]
        result = _run(["make", "-n", *targets, *variables], timeout=60)
        return [] if result.returncode == 0 else [f"make -n exits {result.returncode}: {result.stderr.strip()[-300:]}"]
    if program == "megatron-rl":
        return _cli_problems(argv[1:], keys)
    if program in ("python", "python3") and argv[1:3] == ["-m", "megatron_rl.cli"]:
        return _cli_problems(argv[3:], keys)
    if program == "torchrun" and "megatron_rl.cli" in argv:
        return _cli_problems(argv[argv.index("megatron_rl.cli") + 1:], keys)
    if program in ("python", "python3") and len(argv) > 2 and argv[1] == "-m" and argv[2].startswith("megatron_rl"):
        return _help_lacks([sys.executable, "-m", argv[2]], argv[3:])
    if program in ("python", "python3") and len(argv) > 1 and argv[1].startswith("tools/"):
        return _help_lacks([sys.executable, argv[1]], argv[2:])
    if program.lstrip("./").startswith("launch/"):
        return _launch_problems(program.lstrip("./"), argv[1:], None, keys)
    if program == "sbatch":
        script = next((a for a in argv[1:] if a.startswith("launch/")), None)
        nodes = next((a.split("=")[1] for a in argv if a.startswith("--nodes=")), None)
        return _launch_problems(script, argv[argv.index(script) + 1:], nodes, keys) if script else []
    return []  # pip, git, chmod, ...: not this project's commands


def console_problems(path: Path) -> list[str]:
    """A console block's `$ ... --dry-run` lines print what the block shows after them ("..." ends the comparison)."""
    problems = []
    for language, first, body in fenced_blocks(path.read_text(encoding="utf-8")):
        if language != "console":
            continue
        for index, line in enumerate(body):
            if not (line.startswith("$ ") and "--dry-run" in line):
                continue
            shown = []
            for later in body[index + 1:]:
                if later.startswith("$ ") or later.strip() == "...":
                    break
                shown.append(later)
            # the repository's own path, as a user reads it in their clone: $PWD (the command runs from its root)
            printed = _run(["bash", "-c", line[2:]]).stdout.replace(str(REPO), "$PWD").splitlines()
            if printed[:len(shown)] != shown:
                differs = next(i for i, s in enumerate(shown) if i >= len(printed) or printed[i] != s)
                problems.append(f"{path.relative_to(REPO)}:{first + index}: `{line[2:]}` prints, at line {differs + 1}, "
                                f"{printed[differs] if differs < len(printed) else '(nothing)'!r}; the page shows {shown[differs]!r}")
    return problems
