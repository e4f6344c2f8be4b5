"""A launcher, as ``accelerate launch`` and ``trl sft`` are: it trains nothing itself and runs
the training script in a child Python process (here one that only prints)."""

import subprocess
import sys

subprocess.run([sys.executable, "-c", "print('child: training would run here')"], check=True)
