"""Scores of an evaluation set from its per-prompt results: mean@k, pass@k, maj@k, lengths, truncation, errors.

Pure Python, no engine: `aggregate(results, pass_ks)` turns the PromptResults
of a set (or of one data source's prompts) into one flat dict of numbers.

- mean@k: accuracy averaged over the k samples of a prompt, then over prompts
  (a sample is correct when its reward reaches the set's correct_at).
- pass@j: the unbiased estimator of Chen et al. 2021 ("Evaluating Large
  Language Models Trained on Code", eq. 1) from the n = k samples of a prompt
  of which c are correct, averaged over prompts:
      pass@j = 1 - C(n - c, j) / C(n, j)
  computed as 1 - prod_{i = n - c + 1}^{n} (1 - j / i) (their numerically
  stable form), and 1 when n - c < j.
- maj@k: majority vote over the k samples' final answers (answers are grouped
  by the equivalence the reward uses, megatron_rl.evaluation.answers); the
  prompt scores the correctness of the winning group's first sample. Ties:
  among groups of equal size the one whose first sample comes first (lowest
  sample index) wins, a rule that looks at nothing but the samples' order.
  Empty final answers do not vote; a prompt where none votes scores 0.
- response length mean / p50 / p95 / max over every sample, in tokens
  (percentiles interpolate linearly between order statistics, as numpy's
  default); truncated_fraction: samples cut at the length limit;
  reward_errors: samples whose reward function raised or returned NaN/inf.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence


@dataclass(kw_only=True)
class PromptResult:
    """One prompt's k samples, scored. Lists hold one entry per sample, in sample order."""

    index: int
    """Row of the prompt in its file (0-based)."""
    data_source: str
    """The row's data_source column ("" when the file has none)."""
    answer: Any
    """Reference answer."""
    rewards: list[float]
    """Reward of each sample."""
    correct: list[bool]
    """reward >= the set's correct_at."""
    lengths: list[int]
    """Response length in tokens."""
    truncated: list[bool]
    """Cut at the length limit (no EOS)."""
    final_answers: list[str]
    """The answer each response gives, as the reward extracts it ("" = none)."""
    majority: int
    """Sample index of the maj@k vote's winner (its first sample); -1 when no sample gave an answer."""
    reward_errors: int
    """Samples whose reward function failed."""
    responses: list[str] | None = None
    """Response texts (eval set's save_responses)."""

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["answer"] = self.answer if isinstance(self.answer, (str, int, float, bool)) or self.answer is None else str(self.answer)
        if self.responses is None:
            del row["responses"]
        return row


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples, c correct (Chen et al. 2021, eq. 1; their stable product form)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_vote(final_answers: Sequence[str], same: Callable[[str, str], bool]) -> int:
    """Index of the first sample of the largest group of equivalent answers (ties: earliest first sample); -1 if none."""
    groups: list[list[int]] = []  # sample indices, groups in order of their first sample
    for i, answer in enumerate(final_answers):
        if not answer:
            continue
        for group in groups:
            if same(final_answers[group[0]], answer):
                group.append(i)
                break
        else:
            groups.append([i])
    if not groups:
        return -1
    best = max(len(g) for g in groups)
    return next(g[0] for g in groups if len(g) == best)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def aggregate(results: Sequence[PromptResult], pass_ks: Sequence[int]) -> dict[str, float]:
    """The set's numbers (see the module docstring); every prompt must have the same number of samples k."""
    if not results:
        raise ValueError("aggregate: no prompt results")
    k = len(results[0].rewards)
    if any(len(r.rewards) != k for r in results):
        raise ValueError(f"aggregate: prompts have different sample counts ({sorted({len(r.rewards) for r in results})})")
    num = len(results)
    lengths = [length for r in results for length in r.lengths]
    metrics = {
        "num_prompts": float(num),
        "samples_per_prompt": float(k),
        f"mean@{k}": sum(sum(r.correct) / k for r in results) / num,
        "reward_mean": sum(sum(r.rewards) / k for r in results) / num,
    }
    for j in pass_ks:
        metrics[f"pass@{j}"] = sum(pass_at_k(k, sum(r.correct), j) for r in results) / num
    metrics[f"maj@{k}"] = sum(float(r.majority >= 0 and r.correct[r.majority]) for r in results) / num
    metrics.update({
        "length_mean": sum(lengths) / len(lengths),
        "length_p50": percentile(lengths, 50),
        "length_p95": percentile(lengths, 95),
        "length_max": float(max(lengths)),
        "truncated_fraction": sum(t for r in results for t in r.truncated) / len(lengths),
        "reward_errors": float(sum(r.reward_errors for r in results)),
    })
    return metrics


def by_source(results: Sequence[PromptResult], pass_ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """aggregate() over each data source's prompts alone ({} when no prompt names a source)."""
    sources = sorted({r.data_source for r in results if r.data_source})
    return {s: aggregate([r for r in results if r.data_source == s], pass_ks) for s in sources}
