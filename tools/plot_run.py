"""curves.png for any grpo.py run directory, finished or not: training reward, eval rewards, KL, clip fraction and
the share of groups with no spread, per step (grpo.py draws the same picture at the end of every run).

  python tools/plot_run.py runs/shapes [more runs ...]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # helpers/ lives in the repository root

from helpers.run_io import plot_curves  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (grpo.py --out)")
    for run in parser.parse_args(argv).runs:
        if not (run / "metrics.jsonl").is_file():
            raise SystemExit(f"plot_run.py: error: {run} has no metrics.jsonl; give a grpo.py --out directory")
        try:
            print(plot_curves(run))
        except (ValueError, OSError) as error:
            raise SystemExit(f"plot_run.py: error: {error}") from None


if __name__ == "__main__":
    main()
