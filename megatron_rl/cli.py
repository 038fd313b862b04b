"""The `megatron-rl` command: `train` and `plan`.

    megatron-rl train --config configs/tiny-gspo.yaml train.steps=5
    megatron-rl plan  --config configs/qwen3-30b-a3b-gspo-4x8h100.yaml parallel.expert_parallel=8

Nothing heavy is imported at module level, so `--help` answers at once; each
subcommand imports what it needs when it runs. Also `python -m megatron_rl.cli`
(what the launch scripts run under torchrun).
"""

from __future__ import annotations

import argparse
import sys

EXIT_DOES_NOT_FIT = 1
EXIT_CONFIG_ERROR = 2


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML preset, e.g. configs/tiny-gspo.yaml")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides parsed as YAML, e.g. algorithm.eps_high=4e-4"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl", description="RL post-training of mixture-of-experts LLMs on megatron-core with vLLM rollouts."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,plan}")
    train = sub.add_parser("train", help="run the RL loop (under torchrun for several processes)")
    _add_config_args(train)
    planner = sub.add_parser("plan", help="check a preset against its cluster and estimate memory per device, no GPU needed")
    _add_config_args(planner)
    planner.add_argument("--model-config", help="the model's config.json, instead of <model.path>/config.json")
    planner.add_argument(
        "--launch-env", action="store_true", help="only print NNODES= and NPROC_PER_NODE= for the launch scripts"
    )
    return parser


def _train(args: argparse.Namespace) -> int:
    from megatron_rl import trainer
    from megatron_rl.config.core import ConfigError

    try:
        trainer.main(args.config, list(args.overrides))
    except ConfigError as err:  # a bad key or value: say which, no traceback
        print(f"megatron-rl train: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


def _plan(args: argparse.Namespace) -> int:
    from megatron_rl.config.core import ConfigError
    from megatron_rl.plan.launch import launch_env

    try:
        if args.launch_env:
            sys.stdout.write(launch_env(args.config, list(args.overrides)))
            return 0
        from megatron_rl.plan.report import plan_preset, render

        result = plan_preset(args.config, list(args.overrides), args.model_config)
    except ConfigError as err:
        print(f"megatron-rl plan: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    render(result)
    return 0 if result.fits else EXIT_DOES_NOT_FIT


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    return _plan(args)


if __name__ == "__main__":
    sys.exit(main())
