"""The RL loop: generate -> reward -> advantages -> old/ref logprobs -> train -> sync -> log -> save.

    megatron-rl train --config configs/tiny-gspo.yaml train.steps=50
    torchrun --nproc-per-node 2 -m megatron_rl.train --config configs/tiny-gspo-cpu2.yaml

Rank 0 holds the rollout engine (in-process vLLM, or a client of vLLM
servers: external ones, or colocated ones hosted by trainer ranks when
rollout.engines > 1); every rank holds its shard of the actor. One step:

1. experience (rank 0): prompts -> samples -> rewards -> advantages, with
   dynamic sampling and overlong shaping (megatron_rl.experience); then
   actor.distribute sends each rank only its DP rank's rows (over gloo);
2. actor.prepare_batch: old-policy logprobs (recording routes for R2) and
   reference logprobs when algorithm.beta > 0;
3. actor.train_step: mini-batches of microbatches through megatron's
   schedule, the loss normalised by the step's global counts;
4. weight sync (weight_sync.pusher.WeightPusher, one call on every rank):
   the actor's HF-named buckets into the engines as version step + 1, by
   the path the placement picks (rank 0's funnel, every owner rank, or
   vLLM's own engines);
5. metrics (rank 0), evaluation, checkpoint.

On a cluster (megatron_rl.parallel.watch): SIGTERM or SIGUSR1 (pre-emption, a
time limit) makes every rank save at the next step boundary and stop
(StoppedBySignal, exit code 3); a collective that fails or waits past
parallel.timeout_s names the ranks that did not answer and the phase
(generate, train, push, save); a run torchrun restarts resumes from the newest
complete checkpoint and says why it restarted.

Each step's experience comes from one experience source
(megatron_rl.experience_source), chosen once from the config; the loop never
asks which: generated inside the step (the default), one step ahead on a
background thread with the weights before the step's update
(train.off_policy_lag=1), or continuously, each step training on groups at most
S weight versions old (train.max_staleness = S > 0, megatron_rl.async_experience,
where train.partial_rollouts lets a push interrupt the samples in flight). Off
the policy, the algorithm's importance-sampling correction (algorithm.tis_mode)
accounts for the lag; config load refuses asynchronous training without one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from megatron_rl.config import RLConfig, load_config, to_dict
from megatron_rl.console import LibraryLogs, library_logs
from megatron_rl.metrics import process_memory_metrics

if TYPE_CHECKING:
    from megatron_rl.checkpoint.resume import ResumeDecision

logger = logging.getLogger(__name__)

class NoSignalWatch:
    """Counts steps in a row whose advantages are all zero (every prompt's samples got the same reward: the reward
    gives the loss no gradient); `update` returns the warning once the count reaches `steps`, then nothing until a
    step has a signal again."""

    def __init__(self, steps: int = 5):
        self.steps, self.count = steps, 0

    def update(self, step: int, metrics: dict[str, float], n_samples: int) -> str | None:
        if "advantage/abs_mean" not in metrics:  # not rank 0: the experience's metrics are rank 0's
            return None
        self.count = self.count + 1 if metrics["advantage/abs_mean"] == 0 else 0
        if self.count != self.steps:
            return None
        return (f"steps {step - self.steps + 1}-{step}: every prompt's {n_samples} samples got the same reward (mean "
                f"{metrics.get('reward/mean', float('nan')):.3f}), so every advantage is 0 and the reward gives no gradient; "
                "a policy that never earns a reward cannot learn one: start from a model that sometimes does (a random "
                "tiny model needs the answer format first: `make demo` warms one up in outputs/demo/model), or use a "
                "reward that grades partial answers")


class StoppedBySignal(Exception):
    """SIGTERM / SIGUSR1 asked the run to stop: every rank saved at the step boundary (megatron_rl.errors: exit 3)."""


def main(config_path: str | None = None, overrides: Sequence[str] = (), *, stop=None) -> dict[str, float]:
    """Entry point of `megatron-rl train`: load the config, start the parallel context, run.

    stop: the command's StopSignals (megatron_rl.parallel.watch), installed for its whole life so that a SIGTERM
    arriving while a failed run cleans up does not kill it before it reports; None: the run installs its own."""
    from megatron_rl.config.core import replace
    from megatron_rl.models.tiny import preset_model_path, tiny_family_to_build

    cfg = load_config(RLConfig, config_path, list(overrides))
    if tiny_family_to_build(cfg.model, preset_model_path(config_path)):  # the preset's own tiny model, first use
        cfg = replace(cfg, model=replace(cfg.model, make_tiny=True))
    return run(cfg, stop=stop)


def run(cfg: RLConfig, engine=None, *, stop=None) -> dict[str, float]:
    """Train with `cfg` in this process (one rank of a torchrun job, or alone); returns the last metrics.

    engine: a rollout engine already started on cfg.model.path (one process only), which the run
    uses instead of starting its own and leaves running: several runs in one process share it.
    """
    from megatron_rl.checkpoint.resume import decide_resume
    from megatron_rl.heap import TRAINER_PACKAGES, ends_after_close, import_long_lived
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.models.tiny import ensure_tiny_model_dir, tiny_family_to_build
    from megatron_rl.preflight import check_before_start
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.plan.report import require_fit

    tiny_family = tiny_family_to_build(cfg.model, None)  # only with model.make_tiny (trainer.main sets it for a preset's own path)
    if tiny_family:
        ensure_tiny_model_dir(cfg.model.path, tiny_family, seed=cfg.model.init_seed)
    load_hf_config(cfg.model.path)  # a missing or broken model directory: one error naming it, first
    require_fit(cfg)  # GPU clusters: a layout that does not fit its GPUs stops here, before any device is touched
    resume = decide_resume(cfg.checkpoint)  # the checkpoint this process starts from, chosen once: checked, then loaded
    check_before_start(cfg, resume)  # writable directories, lengths, the resume checkpoint's model: before any work
    with library_logs(cfg.logging.dir) as logs:
        if ends_after_close():  # the process's own run: what it imports lives as long as the process
            import_long_lived(*TRAINER_PACKAGES)
        shape = model_shape(load_hf_config(cfg.model.path))
        ctx = init_parallel(cfg.parallel, shape=shape, seed=cfg.train.seed)
        trainer = None
        try:
            trainer = Trainer(cfg, ctx, resume, logs=logs, engine=engine, stop=stop)
            return trainer.fit()
        finally:
            if trainer is not None:
                trainer.close()
            destroy_parallel(ctx)


def _every(period: int, step: int) -> bool:
    """Whether a period's action (checkpoint.save_every, train.eval_every; 0: never) falls after step count `step`."""
    return bool(period) and step % period == 0


def read_prompt_sets(cfg: RLConfig, ctx):
    """(tokenizer, the training prompt set, the data.eval_sets' Evaluator or None), read and checked before the
    engine starts, on rank 0 only: the rank that samples, evaluates and records the data position ((None, None, None)
    elsewhere). Held on every rank, a prompt set's rows and token ids would cost a node as many copies as it has
    ranks. A bad tokenizer, row or set is raised on every rank."""
    from megatron_rl.actor.distribute import on_rank0
    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.data.tokenizer import load_tokenizer

    def read():
        tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.model.path)
        dataset = PromptDataset(
            cfg.data.path, tokenizer, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
            apply_chat_template=cfg.data.apply_chat_template, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
            long_prompts=cfg.data.long_prompts, shuffle=cfg.data.shuffle, seed=cfg.train.seed,
        )
        evaluator = None
        if cfg.data.eval_sets:
            from megatron_rl.evaluation import Evaluator

            evaluator = Evaluator.from_config(cfg, tokenizer)
        return tokenizer, dataset, evaluator

    return on_rank0(read, ctx) or (None, None, None)


class Trainer:
    """State of one run on this rank: data, actor, engine (rank 0), logger, step counters."""

    def __init__(self, cfg: RLConfig, ctx, resume: ResumeDecision, logs: LibraryLogs | None = None, engine=None,
                 stop=None):
        """resume: the checkpoint the run starts from (checkpoint.resume.decide_resume, as the start-up checks saw it).
        logs: where vLLM's start-up output goes (megatron_rl.console); None leaves it on the console.
        engine: an engine already started on cfg.model.path, used and left running (see `run`).
        stop: StopSignals installed by the caller (kept after the run); None: the trainer's own, removed by close().

        The start, in this order (each part uses the ones before it):
        1. the data (rank 0): prompt sets, reward, agent, and the experience source drawing from them;
        2. the actor, the phase watch and the stop signals;
        3. the checkpoint `resume` chose: the actor's state, the data position, the counters;
        4. the engine, started with the actor's state off the device (train.offload), and the weight pusher;
        5. the metrics logger (its progress bar counts the steps left after a resume);
        6. the first push: the engine serves the trainer's weights from the first step on;
        7. generation starts: the experience source gets the engine."""
        from megatron_rl.parallel.threads import cpu_threads_per_process, set_torch_threads

        self.cfg, self.ctx, self._logs = cfg, ctx, logs
        self.step, self.weight_version = 0, 0
        self._saved = False  # a save of this run checked its shards' coverage (megatron's access-integrity check)
        self._evaluated_at = -1
        self._recent_rewards: deque[float] = deque(maxlen=10)  # train.stop_at_reward looks at the last 10 steps
        self._no_signal = NoSignalWatch()
        if ctx.device.type == "cpu":  # training and an in-process engine's generation share these threads
            set_torch_threads(cpu_threads_per_process(cfg.cluster.cpu_threads, cfg.cluster.cpu_processes))
        self._read_data()
        self._build_actor(resume, stop)
        if resume.path is not None:
            self._resume(resume)
        self._connect_engine(engine)
        self._open_metrics_log(resume)
        self._first_push()
        self.experience_source.start(self.engine, first_step=self.step)

    def _read_data(self) -> None:
        """Rank 0's tokenizer, training prompts and evaluator (None elsewhere), the reward function, the agent
        (rollout.agent, rank 0), and the experience source that draws from them (the one place the mode is chosen:
        megatron_rl.experience_source)."""
        from megatron_rl.experience_source import experience_source
        from megatron_rl.rollout.rewards import get_reward_fn

        cfg, ctx = self.cfg, self.ctx
        self.tokenizer, self.dataset, self.evaluator = read_prompt_sets(cfg, ctx)
        self.reward_fn = get_reward_fn(cfg.data.reward)
        self.agent = None  # multi-turn episodes (rollout.agent), run on rank 0
        if cfg.rollout.agent and ctx.rank == 0:
            from megatron_rl.rollout.agents import EpisodeRunner, load_agent

            self.agent = EpisodeRunner(load_agent(cfg.rollout.agent), self.tokenizer, self.reward_fn, cfg.rollout)
        self.experience_source = experience_source(cfg, self.dataset, self.tokenizer, self.reward_fn, self.agent)

    def _build_actor(self, resume: ResumeDecision, stop) -> None:
        """The actor (from its HF weights unless a checkpoint overwrites them), the phase watch, the stop signals
        (installed now: a stop asked while the engine starts is acted on at the first step boundary), the offload."""
        from megatron_rl.actor import Actor
        from megatron_rl.actor.offload import ActorOffload
        from megatron_rl.parallel.watch import PhaseWatch, StopSignals

        cfg, ctx = self.cfg, self.ctx
        if resume.path is None and resume.kind == "restart" and ctx.rank == 0:
            logger.warning("no complete checkpoint in %s yet: starting again from step 0%s", cfg.checkpoint.dir, resume.why)
        # a resume overwrites every weight the policy has: its HF weights are not read (the reference model's are)
        self.actor = Actor.from_config(cfg, ctx, load_weights=resume.path is None)
        self._watch = PhaseWatch(ctx.rank, ctx.world_size, cfg.parallel.timeout_s)
        self._own_stop = stop is None
        self._stop = StopSignals() if stop is None else stop
        self._stop.install()
        self._offload = ActorOffload(self.actor.model, self.actor.optimizer, cfg.train.offload)

    def _connect_engine(self, engine) -> None:
        """Rank 0's rollout engine, started here or `engine` adopted (see `run`), and the run's weight pusher.
        train.offload: the actor's state leaves the device before the engines start, as while they generate: an
        engine takes its gpu_memory_utilization share of each device at start-up (vLLM refuses less free memory)."""
        self._colocated = None  # the colocated vLLM servers this rank hosts (rollout.engines > 1)
        self._placement = None  # the engines' placement (None for an engine started beforehand)
        self._own_engine = engine is None
        if engine is not None and self.ctx.world_size > 1:
            raise ValueError(f"an engine started beforehand serves a one-process run; this one has {self.ctx.world_size} ranks")
        self._offload.to_host()
        with self._logs.engine_start() if self._logs is not None else contextlib.nullcontext():
            self.engine = self._start_engine() if engine is None else self._adopt(engine)
        self._restarts_before = self._engine_restarts_so_far()  # an engine started beforehand counts from here
        self._pusher = self._make_pusher()

    def _open_metrics_log(self, resume: ResumeDecision) -> None:
        """The metrics logger (rank 0 writes); then the count of prompts the data dropped for their length."""
        from megatron_rl.metrics import MetricsLogger

        cfg, ctx = self.cfg, self.ctx
        self.logger = MetricsLogger(
            cfg.logging.dir,
            enabled=ctx.rank == 0,
            use_wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            use_tensorboard=cfg.logging.tensorboard,
            progress_total=(cfg.train.steps - self.step) if cfg.logging.progress_bar else None,
            config=to_dict(cfg),
            resume=resume.path is not None,
            summary_every=cfg.logging.summary_every,
        )
        if ctx.rank == 0 and self.dataset.num_dropped_long:
            logger.warning("%d prompts longer than rollout.max_prompt_tokens=%d were dropped", self.dataset.num_dropped_long, cfg.rollout.max_prompt_tokens)

    def _first_push(self) -> None:
        """The engine serves exactly the trainer's weights from the first step on (also after a resume), pushed in the
        step's order (plan.memory's push phase): the engine asleep (rollout.sleep_level), its weights woken and the
        actor's parameters back for the push, the parameters out again, then the engine's KV cache."""
        self._sleep_engine()
        with self._watch.phase(self.step, "push"):
            self._sync_weights(self.weight_version)
        self._offload.to_host()  # until the first step's old-policy forward (train.offload)
        self._wake_engine()

    # -- the loop ------------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Steps self.step .. train.steps - 1, each: take -> train -> push (train_one_step), log, save
        (checkpoint.save_every, and the last step), evaluate (train.eval_every, and the last step); a stop signal
        ends the run at a step boundary. Returns the last step's metrics."""
        cfg, metrics = self.cfg, {}
        if cfg.train.eval_before_train and self.step == 0:
            self.evaluate()
        self._stop.install()  # again: the engine's start may have set handlers of its own
        while self.step < cfg.train.steps:
            start = time.perf_counter()
            metrics = self.train_one_step(self.step)
            self.step += 1
            metrics["time/step_s"] = time.perf_counter() - start
            metrics.update(process_memory_metrics())  # the peak so far covers the evaluation and every phase of the step
            self.logger.log(self.step - 1, metrics)
            if warning := self._no_signal.update(self.step - 1, metrics, cfg.rollout.n_samples):
                logger.warning("%s", warning)
            done = self.step == cfg.train.steps or self._reached_target(metrics)
            saved = self.save() if done or _every(cfg.checkpoint.save_every, self.step) else None
            if done or _every(cfg.train.eval_every, self.step):
                self.evaluate()
            if done:
                break
            self._stop_if_signalled(saved)
        return metrics

    def train_one_step(self, step: int) -> dict[str, float]:
        """One step, in the order that keeps the least on the device at once (megatron_rl.plan.memory, phases):
        generate (the actor's offloaded state on the host) -> the engine sleeps -> the actor back -> train ->
        the optimizer state and gradients out -> the engine's weights wake, push -> the parameters out -> the
        engine's KV cache wakes."""
        from megatron_rl.actor import train_batch_from_rollouts

        with self._watch.phase(step, "generate"):
            experience = self._take_experience(step)  # rank 0's (None elsewhere)
        sleep_metrics = self._sleep_engine()
        self._offload.to_device()  # the actor's memory back from the host (train.offload)
        whole = None
        if experience is not None:
            whole = train_batch_from_rollouts(experience.rollouts, experience.advantages, policy_version=self.weight_version)
        with self._watch.phase(step, "train"):
            batch = self.actor.distribute(whole)  # this rank's rows only
            del whole
            batch, metrics = self.actor.prepare_batch(batch)
            metrics = {**(experience.metrics if experience is not None else {}), **metrics, **self.actor.train_step(batch), **sleep_metrics}
        if experience is not None:
            metrics.update(self._engine_restarts())
        metrics["batch/share_bytes"] = float(self.actor.last_share_bytes)
        del batch  # the push phase holds no rows of the step
        metrics.update(self._push(step))
        return metrics

    def _push(self, step: int) -> dict[str, float]:
        """The weights after step `step` into the engines as version step + 1: generation that must see the old ones
        finishes, the optimizer state and gradients leave the device, the push, the parameters leave
        (train.offload=all), the engine's KV cache wakes."""
        self.experience_source.before_weights_change()
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        offloaded = self._offload.to_host(["optimizer", "grads"])  # before the push: only the parameters stay
        offload_s = time.perf_counter() - start
        start = time.perf_counter()
        with self._watch.phase(step, "push"):
            metrics.update(self._sync_weights(step + 1))  # rollout.weight_senders=owners: what this rank sent
        metrics["time/weight_sync_s"] = time.perf_counter() - start
        start = time.perf_counter()
        offloaded += self._offload.to_host()  # the parameters (train.offload=all): the device is the engine's
        offload_s += time.perf_counter() - start
        self._wake_engine()
        if self._offload.mode != "none":
            metrics["offload/bytes"] = float(offloaded)
            metrics["time/offload_s"] = offload_s
        return metrics

    def _take_experience(self, step: int):
        """This step's experience from the experience source: rank 0's, None elsewhere.

        An engine that lost the trainer's weights (restarted on its model directory, a push broken midway)
        says so on rank 0 (WeightsLostError); every rank then joins a push of the current weights again
        (with several ranks, one broadcast of a flag per step tells them).
        """
        from megatron_rl.actor.distribute import broadcast_object
        from megatron_rl.weight_sync.engine_side import WeightsLostError

        while True:
            experience, lost = None, False
            try:
                experience = self.experience_source.take(step, self.weight_version)
            except WeightsLostError as error:
                logger.warning("%s", error)
                lost = True
            if self.ctx.world_size > 1:
                lost = bool(broadcast_object(lost, self.ctx))
            if not lost:
                return experience
            self._sync_weights(self.weight_version)

    def _stop_if_signalled(self, saved: Path | None) -> None:
        """Every rank agrees at the step boundary whether one of them received SIGTERM / SIGUSR1; if so they save
        (unless this step just did) and stop with StoppedBySignal."""
        with self._watch.phase(self.step, "save"):
            signal = self._stop.agreed(self.ctx.host_group)
            if signal is None:
                return
            path = saved or self.save()
        raise StoppedBySignal(
            f"stopped by {signal.name} after step {self.step} of {self.cfg.train.steps}: checkpoint {path} is complete; "
            "launch the same command again with checkpoint.resume=auto (the launch scripts pass it) to continue from it"
        )

    def _reached_target(self, metrics: dict[str, float]) -> bool:
        """train.stop_at_reward: the mean reward of the last 10 steps reached the target (decided on rank 0)."""
        if not self.cfg.train.stop_at_reward:
            return False
        recent = self._recent_rewards
        recent.append(metrics.get("reward/mean", 0.0))
        reached = len(recent) == recent.maxlen and sum(recent) / len(recent) >= self.cfg.train.stop_at_reward
        from megatron_rl.actor.distribute import broadcast_object

        return bool(broadcast_object(reached, self.ctx))

    # -- the engine and the push ---------------------------------------------------------------------

    def _engine_restarts_so_far(self) -> int | None:
        """The engine's restarts since it started (a failed batch or push, a dead engine process or server; at most
        rollout.max_restarts in a row); None where there is no engine here (ranks other than 0)."""
        return self.engine.restarts if self.engine is not None else None

    def _engine_restarts(self) -> dict[str, float]:
        """rollout/engine_restarts_total: the engine restarts in this run so far (rank 0)."""
        if self._restarts_before is None:
            return {}
        return {"rollout/engine_restarts_total": float(self.engine.restarts - self._restarts_before)}

    def _sleep_engine(self) -> dict[str, float]:
        """rollout.sleep_level: the engine sleeps while the actor trains (the push wakes its weights);
        engine/sleep_frees_memory says whether that released its memory (0 where vLLM has no sleep mode). Every rank
        waits for it: an engine's workers may sit on any rank's GPU, which that rank's actor takes back next."""
        if not self.cfg.rollout.sleep_level:
            return {}
        metrics = {"engine/sleep_frees_memory": float(self.engine.sleep())} if self.engine is not None else {}
        self._every_rank_here()
        return metrics

    def _wake_engine(self) -> None:
        """The rest of a sleeping engine (its KV cache) wakes once the actor's memory has left every rank's device."""
        if self.cfg.rollout.sleep_level:
            self._every_rank_here()
        if self.engine is not None:
            self.engine.wake_up()

    def _every_rank_here(self) -> None:
        """A barrier over the host group (no device work): the engine's sleep and wake are rank 0's calls."""
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.ctx.host_group)

    def _sync_weights(self, version: int) -> dict[str, float]:
        """Every rank pushes the actor's weights as `version` (weight_sync.pusher, which picks the path); returns
        this rank's push metrics. The engine's weights wake first, the actor's parameters come back for the push."""
        if self.engine is not None:
            self.engine.wake_up(["weights"])  # rollout.sleep_level: the weights for the push, the KV cache after it
        with self._offload.on_device(["params"]), self.experience_source.engine_held():
            pushed = self._pusher.push(version)
        self.weight_version = version
        return pushed

    def _make_pusher(self):
        """Every push of the run goes through one WeightPusher (weight_sync.pusher), which picks the path."""
        from megatron_rl.weight_sync.pusher import WeightPusher

        colocated = self._colocated
        return WeightPusher(
            self.cfg.rollout, self.ctx, self.actor.model, self.engine, placement=self._placement, cluster=self.cfg.cluster,
            relay=colocated.relay if colocated is not None else None,
            owner_relay=colocated.owner_relay if colocated is not None else None,
            engine_urls=colocated.urls if colocated is not None else None,
        )

    def _start_engine(self):
        """Rank 0's engine (None elsewhere); with several colocated engines every rank joins their start."""
        from megatron_rl.rollout import make_engine, resolve_placement
        from megatron_rl.rollout.colocated import start_colocated_servers

        ctx = self.ctx
        placement = resolve_placement(self.cfg.rollout, world_size=ctx.world_size, cluster=self.cfg.cluster)
        rollout = placement.rollout_config(self.cfg.rollout)
        self._placement = placement
        if ctx.rank == 0:
            logger.info("weight push by %s: %s", placement.transport, placement.reason)
        if placement.kind == "colocated_servers":
            self._colocated = start_colocated_servers(
                self.cfg.model.path, rollout, placement.engines, rank=ctx.rank, world_size=ctx.world_size,
                local_rank=ctx.local_rank, group=ctx.world_group, object_group=ctx.host_group, seed=self.cfg.train.seed,
                log_dir=self.cfg.logging.dir,
            )
        if ctx.rank != 0:
            return None
        if self._colocated is not None:
            return self._colocated.engine(rollout)
        engine = make_engine(self.cfg.model.path, rollout)
        if ctx.world_size == 1:  # the export needs no other rank: a restarted engine re-exports by itself
            engine.reexport_fn = partial(self._reexport, int(rollout.weight_bucket_mb * (1 << 20)))
        return engine

    def _reexport(self, bucket_bytes: int):
        """The run's weights for a restarted engine (one process), read while the actor's parameters are on the device:
        with train.offload=all they are on the host during generation (their device storage empty), and go back
        there once the export is read. Making the export reads only names and shapes: no copy back for it."""
        from megatron_rl.models.export import HFExport

        export = self.actor.export_hf_weights(bucket_bytes)

        def buckets():
            with self._offload.on_device(["params"]):
                yield from export

        return HFExport(export.entries, buckets())

    def _adopt(self, engine):
        """An engine started beforehand (one with every member of rollout.engine_protocol.RolloutEngine, else
        TypeError): its recovery re-exports this run's weights (its first push follows)."""
        from megatron_rl.rollout.engine_protocol import check_engine

        engine = check_engine(engine)
        engine.reexport_fn = partial(self._reexport, int(self.cfg.rollout.weight_bucket_mb * (1 << 20)))
        return engine

    def evaluate(self) -> dict[str, float]:
        """data.eval_sets scored with the weights of version self.step (rank 0; megatron_rl.evaluation): a table on the
        console, eval/<set>/... numbers logged at this step (eval/metrics.jsonl, wandb, tensorboard), eval/step_<n>.json. Evaluation has its own prompts and
        seeds: the training data position and sampling are untouched."""
        if self.evaluator is None or self._evaluated_at == self.step:
            return {}
        self._evaluated_at = self.step
        if self.ctx.rank != 0:
            return {}
        with self.experience_source.engine_held():  # the stream's producer pauses meanwhile
            report = self.evaluator.evaluate(self.engine, self.step)
        report.write(Path(self.cfg.logging.dir) / "eval")
        self.logger.print(report.table())
        self.logger.log_eval(self.step, report.metrics)
        return report.metrics

    # -- checkpoints ---------------------------------------------------------------------------------

    def save(self) -> Path:
        from megatron_rl.checkpoint.state import save_checkpoint
        from megatron_rl.models import load_hf_config
        from megatron_rl.preflight import model_architecture

        trainer_state = {
            "weight_version": self.weight_version,
            "data": self.experience_source.position(),  # rank 0's (None elsewhere): it writes trainer_state.json
            **self.actor.schedule_state(),
            "config": to_dict(self.cfg),
            "model_architecture": model_architecture(load_hf_config(self.cfg.model.path)),  # compared at resume
            "optimizer_format": self.cfg.checkpoint.optimizer_format,  # the optimizer state's sharding: loaded as saved
            "layout": self._layout(),
        }
        with self._offload.on_device(), self._watch.phase(self.step, "save"):
            state = self.actor.state_dict(optimizer_format=self.cfg.checkpoint.optimizer_format)
            path = save_checkpoint(self.cfg.checkpoint.dir, self.step, state, trainer_state, keep_last=self.cfg.checkpoint.keep_last,
                                   validate=not self._saved)  # the state's structure is the same at every save
            self._saved = True
            return path

    def _layout(self) -> dict[str, int]:
        ctx = self.ctx
        return {"tensor_parallel": ctx.tp_size, "pipeline_parallel": ctx.pp_size, "expert_parallel": ctx.ep_size,
                "expert_tensor_parallel": ctx.expert_tp_size, "context_parallel": ctx.cp_size, "data_parallel": ctx.dp_size}

    def _resume(self, resume: ResumeDecision) -> None:
        """The actor's state, the schedule, the data position and the counters of the checkpoint `resume` chose."""
        from megatron_rl.actor.distribute import on_rank0

        state, trainer_state = resume.load(partial(self.actor.state_dict, is_loading=True), self._layout())
        self.actor.load_state_dict(state)
        self.actor.load_schedule_state(trainer_state)
        # the data position is rank 0's; a prompt set that does not match it stops every rank
        on_rank0(lambda: self.experience_source.restore(trainer_state["data"]), self.ctx)
        self.step, self.weight_version = trainer_state["step"], trainer_state["weight_version"]
        if self.ctx.rank == 0:
            logger.warning("resumed from %s at step %d%s", resume.path, self.step, resume.why)

    def close(self) -> None:
        self.experience_source.close()
        self.logger.close()
        if self.agent is not None:
            self.agent.close()
        self._pusher.close()
        if self.engine is not None and self._own_engine:
            self.engine.shutdown()
        if self._colocated is not None:
            self._colocated.stop()
        self._offload = None  # it holds the model's chunks and their pinned host copies
        self.actor.close()
        if self._own_stop:
            self._stop.restore()
