"""How well does the distance --gardo-diversity tokens measures on the tiny world (the share of a large grid's codes
that differ) agree with the layout the world's reader sees in the decoded pictures?

  OMP_NUM_THREADS=2 python tools/code_distance.py                      # the pre-trained tiny model, 40 captions x 8
  OMP_NUM_THREADS=2 python tools/code_distance.py --model runs/bench_learning/default_seed0    # a run's final/

For each pair of a caption's samples (the held-out captions that leave the place free, the evaluation's seeds) it
takes the codes' distance (helpers/variants.py `code_distance`: the share of the 9 codes that differ) and the reader's
(world.read_scene on each decoded picture: the share of the 9 cells whose object, colour and shape, or emptiness,
differ), and reports their correlation over the pairs, how often "the same codes" means "the same layout read" and
back, and the same for GARDO's d (each sample's distance to its nearest group-mate), the quantity the factor uses.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpo  # noqa: E402
from helpers import trainer, variants, world  # noqa: E402


def cells(scene: list[tuple]) -> list:
    """world.read_scene's [(row, col, object)] -> the 9 cells' contents, None where empty."""
    grid = [None] * 9
    for row, col, obj in scene:
        grid[3 * row + col] = obj
    return grid


def reader_distance(scenes: list[list]) -> torch.Tensor:
    """(G,) read cell lists -> (G, G) the share of cells whose content differs."""
    G = len(scenes)
    D = torch.zeros(G, G)
    for i in range(G):
        for j in range(G):
            D[i, j] = sum(a != b for a, b in zip(scenes[i], scenes[j])) / 9
    return D


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, or a tools/bench_learning.py run's folder")
    parser.add_argument("--captions", type=int, default=40, help="the first N free-place held-out captions")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "records" / "code_distance.jsonl")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = trainer.parse_config(grpo, ["--model", "tiny"])
    if args.model == "tiny":
        pipe = grpo.load_glm_image("tiny", "cpu")
    else:  # a run's folder: the tiny pipeline with the AR of its final/
        from tools.bench_learning import trained_pipe
        pipe = trained_pipe(Path(args.model))
    free = [c for c in world.caption_split()[1] if world.parse_caption(c)["kind"] != "position"][:args.captions]
    codes, read, nearest_codes, nearest_read = [], [], [], []
    for i, caption in enumerate(free):
        with torch.no_grad():
            rollout, = trainer.sample_groups(grpo, pipe, [caption], args.samples, cfg.height, cfg.width,
                                             cfg.temperature, [1_000_003 + i])
            images = grpo.decode_images(pipe, caption, rollout.tokens, rollout.prompt.large_hw, cfg.height, cfg.width,
                                        cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale)
        grid = variants.large_grids([rollout])[0]
        Dc = variants.code_distance(grid)
        Dr = reader_distance([cells(world.read_scene(img.permute(1, 2, 0).numpy())) for img in images])
        pairs = torch.triu_indices(len(grid), len(grid), offset=1)
        codes += Dc[pairs[0], pairs[1]].tolist()
        read += Dr[pairs[0], pairs[1]].tolist()
        nearest_codes += variants.nearest(Dc).tolist()
        nearest_read += variants.nearest(Dr).tolist()
    codes, read = np.array(codes), np.array(read)
    nc, nr = np.array(nearest_codes), np.array(nearest_read)

    def rank_corr(a, b):  # Spearman's: the correlation of the ranks, ties sharing their mean rank
        ra, rb = (variants.ranks(torch.from_numpy(x)).numpy() for x in (a, b))
        return float(np.corrcoef(ra, rb)[0, 1])

    result = {"model": args.model, "captions": len(free), "samples": args.samples, "pairs": len(codes),
              "pearson": float(np.corrcoef(codes, read)[0, 1]), "spearman": rank_corr(codes, read),
              "same_codes_same_read": float((read[codes == 0] == 0).mean()) if (codes == 0).any() else None,
              "same_read_same_codes": float((codes[read == 0] == 0).mean()) if (read == 0).any() else None,
              "share_same_codes": float((codes == 0).mean()), "share_same_read": float((read == 0).mean()),
              "nearest_pearson": float(np.corrcoef(nc, nr)[0, 1]), "nearest_spearman": rank_corr(nc, nr)}
    print(json.dumps(result, indent=1))
    with open(args.results, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
