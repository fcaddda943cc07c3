"""What a learned reward costs per image: helpers/rewards.py's clip, pickscore, dino and aesthetic at their published sizes.

  python tools/bench_rewards.py                  # CPU (~3 min on 2 cores, ~7 GB of memory)
  python tools/bench_rewards.py --device cuda    # one GPU

No download: each checkpoint's architecture is built from its published config with random weights (the cost does not
depend on the weights), saved to a temporary folder with a processor, and loaded through helpers/rewards.py's own path
(`name@folder`), as a user's hub id would be. A group of --group images at --size x --size (the processor resizes them
to the checkpoint's 224 x 224) is scored --repeats times; the table gives the first call (loading included) and the
median of the others per image.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # helpers/ lives in the repository root

from helpers import rewards, run  # noqa: E402

# the published architectures (their config.json), the parts a score runs through
CLIP_L14 = dict(text_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
                vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                   num_attention_heads=16, image_size=224, patch_size=14),
                projection_dim=768)  # openai/clip-vit-large-patch14: clip, aesthetic
CLIP_H14 = dict(text_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
                vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                   num_attention_heads=16, image_size=224, patch_size=14),
                projection_dim=1024)  # laion/CLIP-ViT-H-14 (PickScore_v1 is a fine-tuned copy)
DINOV2_BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   patch_size=14, image_size=518)  # facebook/dinov2-base


def save_clip(folder: Path, spec: dict, head: bool = False) -> Path:
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    chars = sorted(ByteLevel.alphabet())  # a character-level stand-in for CLIP's 49408-token BPE vocabulary
    tokenizer = CLIPTokenizer(vocab={c: i for i, c in enumerate(
        chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}, merges=[])
    config = CLIPConfig(text_config={**spec["text_config"], "vocab_size": 49408, "max_position_embeddings": 77},
                        vision_config=spec["vision_config"], projection_dim=spec["projection_dim"])
    CLIPModel(config).save_pretrained(folder)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(folder)
    if head:  # LAION's aesthetic MLP: 768 -> 1024 -> 128 -> 64 -> 16 -> 1, dropouts between
        sizes = [spec["projection_dim"], 1024, 128, 64, 16, 1]
        state = {}
        for i, (a, b) in zip((0, 2, 4, 6, 7), zip(sizes, sizes[1:])):
            state[f"layers.{i}.weight"], state[f"layers.{i}.bias"] = torch.randn(b, a) / a ** 0.5, torch.zeros(b)
        torch.save(state, folder / rewards.AESTHETIC_HEAD[1])
    return folder


def save_dino(folder: Path) -> Path:
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model
    Dinov2Model(Dinov2Config(**DINOV2_BASE)).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    run.quiet_libraries()  # no "Writing model shards" bars between the table's rows
    images = torch.rand(args.group, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    images = images.to(args.device)
    example = {"prompt": "a photo of a red circle above a blue square", "target": images[0]}
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"| reward | checkpoint's architecture (random weights) | first call, loading included | per image "
          f"({args.group} images of {args.size}x{args.size}, {name}, torch {torch.__version__}) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for reward, arch, build in [
                ("clip", "openai/clip-vit-large-patch14", lambda f: save_clip(f, CLIP_L14)),
                ("pickscore", "CLIP ViT-H/14 (yuvalkirstain/PickScore_v1)", lambda f: save_clip(f, CLIP_H14)),
                ("dino", "facebook/dinov2-base", save_dino),
                ("aesthetic", "CLIP ViT-L/14 + LAION's MLP head", lambda f: save_clip(f, CLIP_L14, head=True))]:
            folder = build(Path(tmp) / reward)
            fn = rewards.with_checkpoint(reward, rewards.MORE_REWARDS[reward], str(folder))
            start = time.perf_counter()
            fn(images, example)
            first = time.perf_counter() - start
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn(images, example)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            print(f"| {reward} | {arch} | {first:.1f} s | {statistics.median(times) / args.group * 1000:.0f} ms |",
                  flush=True)
            rewards.load_scorer.cache_clear()  # one model in memory at a time


if __name__ == "__main__":
    main()
