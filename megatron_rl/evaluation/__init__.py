"""Evaluation as papers report it: whole held-out sets, k samples per prompt, mean@k / pass@k / maj@k per data source.

config/evaluation.py: the sets' settings (data.eval_sets); scores.py: the
estimators, pure Python; answers.py: final answers compared the way the reward
compares them, and which rows a reward can score; runner.py: load, generate
(samples.py: its one call site, `generate_samples`), score, report; samples.py: a set's samples,
single-turn or, with rollout.agent set, whole episodes scored by their reward; standalone.py:
`megatron-rl eval` on a checkpoint or an HF directory. The trainer evaluates
at step 0, every train.eval_every steps and after the last step.
"""

from megatron_rl.evaluation.answers import EvalSetError
from megatron_rl.evaluation.runner import EvalReport, Evaluator
from megatron_rl.evaluation.samples import generate_samples
from megatron_rl.evaluation.scores import PromptResult, aggregate, majority_vote, pass_at_k

__all__ = ["EvalReport", "EvalSetError", "Evaluator", "PromptResult", "aggregate", "generate_samples", "majority_vote", "pass_at_k"]
