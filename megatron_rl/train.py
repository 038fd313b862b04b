"""`python -m megatron_rl.train --config <preset> key=value ...` (also under torchrun): same as `megatron-rl train`."""

import sys

from megatron_rl.cli import finished, main

if __name__ == "__main__":
    sys.exit(finished(main(["train", *sys.argv[1:]], process=True)))
