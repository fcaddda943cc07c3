"""A finished run's final/ merged into its base model: RUN/final/pipeline/, the whole GlmImagePipeline that
GlmImagePipeline.from_pretrained loads alone (what grpo.py --save-merged writes at the end of a run).

    python tools/merge.py runs/grpo                 # the run's own model and dtype (config.json)
    python tools/merge.py runs/grpo --dtype bfloat16
"""

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpo  # noqa: E402
from helpers import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a grpo.py / dit_grpo.py --out directory with final/")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the merged weights' dtype (default: the run's: bfloat16 for the real model on a GPU)")
    args = parser.parse_args()
    run.PROG["name"] = "tools/merge.py"
    try:
        saved = json.loads((args.run / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        run.fail(f"cannot read {args.run / 'config.json'} ({error}); give a run directory")
    try:  # final/pipeline/ is written into the run: not while the run itself lives
        run.hold_run_dir(args.run)
    except ValueError as error:
        run.fail(str(error).replace("--out ", "", 1))
    if not (args.run / "final").is_dir():
        run.fail(f"{args.run} has no final/ (the run has not finished); finish it with --resume {args.run}")
    cfg = SimpleNamespace(model=saved["model"], revision=saved.get("revision", ""), train=saved.get("train", "ar"),
                          lora_rank=saved["lora_rank"])
    if cfg.model.split(":")[0] == "random":
        run.fail("random weights cannot be loaded again to merge into; final/ holds what was trained")
    dtype = run.compute_settings("cuda", args.dtype or saved.get("dtype", "auto"), cfg.model)  # a GPU run's dtype
    run.quiet_libraries()
    run.save_merged(cfg, args.run, dtype, grpo.load_glm_image)


if __name__ == "__main__":
    main()
