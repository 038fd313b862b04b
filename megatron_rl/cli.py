"""The `megatron-rl` command: `train`, `plan`, `serve`, `eval` and `doctor`.

    megatron-rl train --config configs/tiny-gspo.yaml train.steps=5
    megatron-rl plan  --config configs/qwen3-30b-a3b-gspo-4x8h100.yaml parallel.expert_parallel=8
    megatron-rl serve --config configs/tiny-gspo.yaml --port 8000   # a rollout server (rollout.engine=vllm_server)
    megatron-rl doctor --config configs/tiny-gspo.yaml              # check this machine (or, under torchrun, every rank)
    megatron-rl eval  --config configs/tiny-gspo.yaml checkpoint.load=outputs/checkpoints/step_00000050

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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,plan,serve,eval,doctor}")
    train = sub.add_parser("train", help="run the RL loop (under torchrun for several processes)")
    _add_config_args(train)
    train.add_argument(
        "--debug", action="store_true",
        help="on an error in the input, also print its traceback (always in <logging.dir>/logs/error.log)",
    )
    planner = sub.add_parser("plan", help="check a preset against its cluster and estimate memory per device, no GPU needed")
    _add_config_args(planner)
    planner.add_argument("--model-config", help="the model's config.json, instead of <model.path>/config.json")
    planner.add_argument(
        "--launch-env", action="store_true",
        help="only print the launch scripts' variables (NNODES, NPROC_PER_NODE, ROLLOUT_NODES, SERVERS_PER_NODE, GPUS_PER_SERVER)",
    )
    planner.add_argument(
        "--server-urls", metavar="HOSTS",
        help="only print the trainer's rollout.server_urls override for the servers the launch script starts on "
        "these comma-separated rollout hosts",
    )
    planner.add_argument("--server-port", type=int, default=8000, help="first port of the servers on a host (default 8000)")
    planner.add_argument(
        "--check", action="store_true",
        help="print nothing and exit 0 when the layout fits its GPUs; else the verdict and exit 2 (what the launch "
        "scripts run before they start a process)",
    )
    serve = sub.add_parser(
        "serve",
        help="run a vLLM OpenAI server on model.path set up for the trainer (rollout.engine=vllm_server): "
        "worker extension for weight pushes and routed experts, the preset's rollout settings",
    )
    _add_config_args(serve)
    serve.add_argument(
        "--host", default="0.0.0.0",
        help="address to listen on (default 0.0.0.0); one other hosts can reach needs the run's token "
        "(rollout.server_token_file=FILE or MEGATRON_RL_SERVER_TOKEN)",
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--dry-run", action="store_true", help="print the environment and the command, run nothing")
    doctor = sub.add_parser("doctor", help="check this machine (under torchrun/srun: every rank) for a preset; see megatron_rl.doctor")
    doctor.add_argument("--config", help="YAML preset whose needs are checked (optional)")
    doctor.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides parsed as YAML")
    evaluate = sub.add_parser(
        "eval",
        help="score data.eval_sets (mean@k, pass@k, maj@k per source) with checkpoint.load=DIR (converted on the fly) "
        "or model.path=HF_DIR, the preset's engine settings, no optimizer",
    )
    _add_config_args(evaluate)
    evaluate.add_argument("--out", help="write the JSON here (default <logging.dir>/eval/step_<n>.json)")
    return parser


def _eval(args: argparse.Namespace) -> int:
    from megatron_rl.evaluation.standalone import eval_errors, run_eval

    try:
        run_eval(args.config, list(args.overrides), args.out)
    except eval_errors() as err:  # a bad key, file, row or checkpoint: say which, no traceback
        print(f"megatron-rl eval: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


def _train(args: argparse.Namespace) -> int:
    from megatron_rl.errors import replay_bad_input, report_error

    code = replay_bad_input()  # a restart of a job that stopped on bad input ends the same way, at once
    if code is not None:
        return code
    from megatron_rl import trainer
    from megatron_rl.parallel.watch import StopSignals

    stop = StopSignals()  # SIGTERM / SIGUSR1: save at the next step boundary; until the error, if any, is reported
    stop.install()
    try:
        trainer.main(args.config, list(args.overrides), stop=stop)
    except Exception as error:  # bad input: one line naming the value and the fix (megatron_rl.errors)
        code = report_error("megatron-rl train", error, debug=args.debug, log_dir=_run_log_dir(args))
        if code is None:
            raise  # a bug: its full traceback
        return code
    finally:
        stop.restore()
    return 0


def _run_log_dir(args: argparse.Namespace) -> str | None:
    """logging.dir of the run, where its error log goes (None when the config itself does not load)."""
    from megatron_rl.config.core import ConfigError, load_config
    from megatron_rl.config.schema import RLConfig

    try:
        return load_config(RLConfig, args.config, list(args.overrides)).logging.dir
    except ConfigError:
        return None


def _plan(args: argparse.Namespace) -> int:
    from megatron_rl.config.core import ConfigError
    from megatron_rl.config.core import load_config
    from megatron_rl.config.schema import RLConfig
    from megatron_rl.plan.launch import launch_env, server_urls_override

    try:
        if args.launch_env:
            sys.stdout.write(launch_env(args.config, list(args.overrides)))
            return 0
        if args.check:
            from megatron_rl.plan.report import require_fit

            require_fit(load_config(RLConfig, args.config, list(args.overrides)))
            return 0
        if args.server_urls is not None:
            cfg = load_config(RLConfig, args.config, list(args.overrides))
            print(server_urls_override(cfg, [h for h in args.server_urls.split(",") if h], args.server_port))
            return 0
        from megatron_rl.plan.report import plan_preset, render

        result = plan_preset(args.config, list(args.overrides), args.model_config)
    except ConfigError as err:
        print(f"megatron-rl plan: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    render(result)
    return 0 if result.fits else EXIT_DOES_NOT_FIT


def _serve(args: argparse.Namespace) -> int:
    """exec the vLLM server (signals reach it directly), or print what would run."""
    import os
    import shlex

    from megatron_rl.config.core import ConfigError, load_config
    from megatron_rl.config.schema import RLConfig

    try:
        cfg = load_config(RLConfig, args.config, list(args.overrides))
    except ConfigError as err:
        print(f"megatron-rl serve: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from megatron_rl.rollout import server_auth
    from megatron_rl.rollout.engine import EngineStartError
    from megatron_rl.rollout.server_supervisor import VLLMServer

    try:
        token = server_auth.configured_token(cfg.rollout.server_token_file)
    except server_auth.ServerTokenError as err:
        print(f"megatron-rl serve: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if token is None and not server_auth.is_loopback(args.host):
        print(
            f"megatron-rl serve: --host {args.host} lets other hosts reach the server, and no token is set: "
            f"set rollout.server_token_file=FILE (mode 600), {server_auth.TOKEN_FILE_ENV}=FILE or "
            f"{server_auth.TOKEN_ENV}, or listen on --host 127.0.0.1", file=sys.stderr,
        )
        return EXIT_CONFIG_ERROR
    server = VLLMServer(cfg.model.path, cfg.rollout, host=args.host, port=args.port, seed=cfg.train.seed,
                        token=token, open_control_plane=token is None)
    try:
        server.check_model_dir()
    except EngineStartError as err:
        print(f"megatron-rl serve: model.path={cfg.model.path!r}: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    # the server in megatron_rl.rollout.server_main: it removes the sockets between its processes when it ends
    command, env = server.command("megatron_rl.rollout.server_main"), server.environment()
    if token is None:
        print(f"megatron-rl serve: no token: every user of this host can drive the server on {args.host}:{args.port}",
              file=sys.stderr)
    if args.dry_run:
        secret = set(server_auth.server_env(""))
        for name, value in env.items():  # the token never printed: the line reads it where it came from
            print(f"export {name}={_token_source(cfg.rollout.server_token_file) if name in secret else shlex.quote(value)}")
        print(shlex.join(command))
        return 0
    sys.stdout.flush()
    os.execvpe(command[0], command, {**os.environ, **env})
    return 0  # not reached


def _token_source(token_file: str) -> str:
    """Shell text that reads the token from where `serve` found it (rollout.server_auth.token_origin)."""
    import shlex

    from megatron_rl.rollout.server_auth import TOKEN_ENV, TOKEN_FILE_ENV, token_origin

    named_by, path = token_origin(token_file) or (TOKEN_ENV, "")
    if named_by == TOKEN_FILE_ENV:
        return f'"$(cat "${TOKEN_FILE_ENV}")"'
    return f'"$(cat {shlex.quote(path)})"' if path else f'"${TOKEN_ENV}"'


def main(argv: list[str] | None = None, *, process: bool = False) -> int:
    """Run one command. process: this is the process's command (a console script or `python -m` entry point):
    train's run imports its long-lived packages frozen, and the closes of a train or eval run skip their garbage
    collections, which the exit makes pointless (megatron_rl.heap)."""
    parser = build_parser()
    # key=value overrides may also come after options (`serve --config c.yaml --port 8001 model.path=...`)
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    if process and args.command in ("train", "eval"):
        from megatron_rl.heap import process_ends_after_close

        process_ends_after_close()
    if args.command == "train":
        return _train(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "doctor":
        from megatron_rl import doctor

        return doctor.run(args.config, args.overrides)
    if args.command == "eval":
        return _eval(args)
    return _plan(args)


def finished(code: int) -> int:
    """A process entry point's last step: freeze every object alive now (gc.freeze) and return the exit code.

    The run is over and what it opened is closed; frozen, torch's, megatron-core's and vLLM's objects are passed by
    the interpreter's collections at exit, which otherwise scan them all (megatron_rl.heap)."""
    import gc

    gc.freeze()
    return code


def console_main() -> int:
    """`megatron-rl ...` (setup.py's console script)."""
    return finished(main(process=True))


if __name__ == "__main__":
    sys.exit(console_main())
