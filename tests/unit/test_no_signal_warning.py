"""trainer.NoSignalWatch: a run whose every advantage stays 0 (every prompt's samples got the same reward) says so
once, after the given number of steps in a row, and again only after a step with a signal."""

from megatron_rl.trainer import NoSignalWatch


def _step(abs_mean: float, reward: float = 0.0) -> dict[str, float]:
    return {"advantage/abs_mean": abs_mean, "reward/mean": reward}


def test_five_steps_without_a_signal_warn_once_and_a_signal_starts_the_count_again():
    watch = NoSignalWatch(steps=5)
    said = [watch.update(step, _step(0.0), n_samples=16) for step in range(7)]
    assert [s is not None for s in said] == [False, False, False, False, True, False, False]
    assert said[4].startswith("steps 0-4: every prompt's 16 samples got the same reward (mean 0.000)")
    assert "make demo" in said[4]
    assert watch.update(7, _step(0.3, 0.5), n_samples=16) is None  # a signal: the count starts again
    again = [watch.update(step, _step(0.0, 1.0), n_samples=16) for step in range(8, 13)]
    assert again[:4] == [None] * 4 and again[4].startswith("steps 8-12:") and "(mean 1.000)" in again[4]


def test_ranks_without_the_experience_metrics_say_nothing():
    watch = NoSignalWatch(steps=1)
    assert watch.update(0, {"loss/sum": 0.0}, n_samples=4) is None
    assert watch.update(1, _step(0.0), n_samples=4) is not None
