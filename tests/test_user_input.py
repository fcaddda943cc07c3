"""Tests for helpers/user_input.py, the edges where a user's material enters a run: a rule per kind of input, each with
a test that fails when the rule is taken out. The files are written here as people make them (Pillow's modes, a
phone's rotated JPEG, Notepad's BOM and CRLF, a caption pasted from a web page), and each is compared with what the
person sees: the picture in a viewer, the lines in an editor.

    python -m pytest -q tests/test_user_input.py
"""

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

import dit_grpo
import grpo
from helpers import run, trainer, user_input
from conftest import ROOT, TINY, expect_exit, write_example

H, W = 6, 4  # not square: a rotation shows


def upright() -> np.ndarray:
    """(H, W, 3) uint8: the picture a viewer shows, every pixel different."""
    rows, cols = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    return np.stack([rows * 40, cols * 60, 255 - rows * 30 - cols * 10], axis=-1).astype(np.uint8)


def loaded(path, role="target", capsys=None) -> tuple[np.ndarray, str]:
    """user_input.load_image at the file's own size -> (H, W, 3) float array and the notes it printed."""
    array = user_input.load_image(path, H, W, role).permute(1, 2, 0).numpy()
    return array, capsys.readouterr().err if capsys else ""


# ---- Images: as a viewer shows them -------------------------------------------------------------

@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation(tmp_path, orientation, capsys):
    """Each of EXIF's 8 orientations, stored as a camera stores it (the pixels turned, the tag saying how to turn them
    back), loads upright; a phone's JPEG (orientation 6) too. Without exif_transpose 7 of 8 fail."""
    stored = {1: [], 2: [Image.Transpose.FLIP_LEFT_RIGHT], 3: [Image.Transpose.ROTATE_180],
              4: [Image.Transpose.FLIP_TOP_BOTTOM], 5: [Image.Transpose.TRANSPOSE], 6: [Image.Transpose.ROTATE_90],
              7: [Image.Transpose.TRANSVERSE], 8: [Image.Transpose.ROTATE_270]}[orientation]
    image = Image.fromarray(upright())
    for step in stored:
        image = image.transpose(step)
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    image.save(tmp_path / "photo.png", exif=exif)
    pixels, notes = loaded(tmp_path / "photo.png", capsys=capsys)
    assert np.array_equal(pixels, upright() / np.float32(255)), orientation
    assert notes == ""  # what a viewer shows: nothing to say
    if orientation == 6:  # the phone's JPEG: lossy, but upright
        image.save(tmp_path / "photo.jpg", exif=exif, quality=100, subsampling=0)
        jpeg, _ = loaded(tmp_path / "photo.jpg")
        assert np.abs(jpeg - upright() / 255).mean() < 0.02


def test_sixteen_bit_gray(tmp_path, capsys):
    """A 16-bit gray PNG (Pillow's I;16) is scaled by 65535, not clipped at 255 (convert("RGB") made it white)."""
    values = (np.arange(H * W).reshape(H, W) * 2700).astype(np.uint16)
    Image.fromarray(values).save(tmp_path / "depth.png")
    assert Image.open(tmp_path / "depth.png").mode == "I;16"
    pixels, notes = loaded(tmp_path / "depth.png", capsys=capsys)
    assert np.allclose(pixels, np.repeat(values[..., None] / 65535, 3, axis=-1), atol=1e-6) and notes == ""


def test_thirty_two_bit(tmp_path, capsys):
    """32-bit integers (I) within 16 bits are scaled by 65535; beyond, and 32-bit floats (F) outside [0, 1], are
    stretched from their minimum to their maximum, with a note; F in [0, 1] is kept; NaN is refused."""
    small = (np.arange(H * W).reshape(H, W) * 1000).astype(np.int32)
    Image.fromarray(small).save(tmp_path / "i.tiff")
    assert np.allclose(loaded(tmp_path / "i.tiff")[0][..., 0], small / 65535, atol=1e-6)
    capsys.readouterr()
    large = small * 100
    Image.fromarray(large).save(tmp_path / "big.tiff")
    pixels, notes = loaded(tmp_path / "big.tiff", capsys=capsys)
    assert np.allclose(pixels[..., 0], large / large.max(), atol=1e-6) and "stretched to [0, 1]" in notes
    unit = np.linspace(0, 1, H * W, dtype=np.float32).reshape(H, W)
    Image.fromarray(unit).save(tmp_path / "f.tiff")
    pixels, notes = loaded(tmp_path / "f.tiff", capsys=capsys)
    assert np.allclose(pixels[..., 1], unit) and notes == ""
    Image.fromarray(unit * 255 + 10).save(tmp_path / "f255.tiff")
    pixels, notes = loaded(tmp_path / "f255.tiff", capsys=capsys)
    assert np.allclose(pixels[..., 2], unit, atol=1e-5) and "span [10, 265]" in notes
    unit[0, 0] = math.nan
    Image.fromarray(unit).save(tmp_path / "nan.tiff")
    with pytest.raises(ValueError, match="NaN or inf"):
        loaded(tmp_path / "nan.tiff")


def over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha[..., None] / 255
    return rgb / 255 * a + (1 - a)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_over_white(tmp_path, mode, capsys):
    """Transparent pixels are shown over white, as a web page shows the picture (convert("RGB") gave the colour stored
    under them: black, here), with a note; an opaque RGBA picture has nothing to note."""
    rgb = upright()
    alpha = np.full((H, W), 255, np.uint8)
    alpha[:2] = 0  # the top rows transparent
    alpha[2] = 128  # one row half
    if mode == "RGBA":
        rgb[:2] = 0
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(tmp_path / "x.png")
        want = over_white(rgb, alpha)
    elif mode == "LA":
        gray = rgb[..., 0]
        Image.fromarray(np.dstack([gray, alpha]), "LA").save(tmp_path / "x.png")
        want = over_white(np.repeat(gray[..., None], 3, axis=-1), alpha)
    else:  # a palette with a transparent index: GIF's and small PNGs' transparency
        palette = Image.fromarray(rgb).quantize(colors=16, dither=Image.Dither.NONE)
        index = np.asarray(palette).copy()
        index[:2] = 15
        image = Image.fromarray(index, "P")
        image.putpalette(palette.getpalette())
        image.save(tmp_path / "x.png", transparency=15)
        colours = np.asarray(image.convert("RGB")).astype(np.float32) / 255
        want = np.where((index == 15)[..., None], 1.0, colours)
    pixels, notes = loaded(tmp_path / "x.png", capsys=capsys)
    assert np.allclose(pixels, want, atol=1 / 255 + 1e-6), mode
    assert "transparent pixels are shown over white" in notes
    Image.fromarray(np.dstack([upright(), np.full((H, W), 255, np.uint8)]), "RGBA").save(tmp_path / "opaque.png")
    pixels, notes = loaded(tmp_path / "opaque.png", capsys=capsys)
    assert np.array_equal(pixels, upright() / np.float32(255)) and notes == ""


@pytest.mark.parametrize("mode", ["L", "1", "P", "CMYK", "YCbCr"])
def test_other_modes(tmp_path, mode):
    """Gray, 1-bit, palette, CMYK and YCbCr files load as RGB, the picture a viewer shows (the conversion Pillow's
    convert("RGB") makes, which for these modes is the picture)."""
    picture = Image.fromarray(upright()).convert(mode)
    suffix = "jpg" if mode == "YCbCr" else "tiff"  # JPEG stores YCbCr
    picture.save(tmp_path / f"x.{suffix}", **({"quality": 100, "subsampling": 0} if suffix == "jpg" else {}))
    want = np.asarray(picture.convert("RGB")).astype(np.float32) / 255
    tolerance = 0.02 if suffix == "jpg" else 1e-6
    assert np.abs(loaded(tmp_path / f"x.{suffix}")[0] - want).mean() <= tolerance, mode
    if mode in ("CMYK", "YCbCr"):  # a round trip from RGB: the original picture, within Pillow's rounding
        assert np.abs(loaded(tmp_path / f"x.{suffix}")[0] - upright() / 255).max() <= 3 / 255 + tolerance


def test_animation_and_refusals(tmp_path, capsys):
    """An animation gives its first frame (noted); a mode with no RGB, a missing file, a file that is not an image
    and a truncated one are each one ValueError naming the file."""
    frames = [Image.fromarray(upright()), Image.fromarray(255 - upright())]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:])
    pixels, notes = loaded(tmp_path / "a.gif", capsys=capsys)
    first = np.asarray(Image.open(tmp_path / "a.gif").convert("RGB")).astype(np.float32) / 255
    assert np.array_equal(pixels, first) and "has 2 frames; the first is used" in notes
    Image.fromarray(upright()).convert("LAB").save(tmp_path / "lab.tiff")
    (tmp_path / "text.png").write_text("not a picture")
    Image.fromarray(upright()).save(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:60])
    for name, needle in [("lab.tiff", "mode LAB"), ("nope.png", "does not exist"), ("text.png", "not a readable"),
                         ("cut.png", "not a readable")]:
        with pytest.raises(ValueError, match=needle) as error:
            user_input.load_image(tmp_path / name, H, W, "source")
        assert str(error.value).startswith(f"source {tmp_path / name}") and "\n" not in str(error.value)


def test_load_image_resizes(tmp_path, capsys):
    """(3, H, W) float32 in [0, 1], channels in RGB order, resized in float (a 16-bit picture keeps its precision)
    with a note."""
    pixels = np.zeros((40, 50, 3), np.uint8)
    pixels[..., 0] = 255
    Image.fromarray(pixels).save(tmp_path / "red.png")
    target = user_input.load_image(tmp_path / "red.png", 64, 96)
    assert target.shape == (3, 64, 96) and target.dtype == torch.float32
    assert torch.allclose(target[0], torch.ones(64, 96)) and target[1:].abs().max() == 0
    assert "note: target " in capsys.readouterr().err
    Image.fromarray(np.full((8, 8), 257 * 100, np.uint16)).save(tmp_path / "flat16.png")
    assert torch.allclose(user_input.load_image(tmp_path / "flat16.png", 16, 16), torch.tensor(100 / 255))


def test_load_examples_reads_every_image_so(tmp_path):
    """Targets and edit sources go through the same loader: a rotated source and a 16-bit target of a prompts file
    load upright and scaled."""
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(upright()).transpose(Image.Transpose.ROTATE_90).save(tmp_path / "s.png", exif=exif)
    Image.fromarray(np.full((H, W), 65535, np.uint16)).save(tmp_path / "t.png")
    (tmp_path / "p.jsonl").write_text('{"prompt": "make it night", "source": "s.png", "target": "t.png"}\n')
    [example] = user_input.load_examples(user_input.read_prompts(tmp_path / "p.jsonl"), {}, H, W)
    assert torch.equal(example["source"], torch.from_numpy(upright() / np.float32(255)).permute(2, 0, 1))
    assert torch.equal(example["target"], torch.ones(3, H, W))


# ---- Prompts files: as editors save them --------------------------------------------------------

def test_notepad_bom_and_crlf(tmp_path):
    """Notepad's UTF-8: a BOM, CRLF line ends; old Macs' CR; PowerShell's UTF-16: all read as the captions typed."""
    for name, data in [("bom.txt", "\ufeffa red circle\r\ntwo blue squares\r\n".encode("utf-8")),
                       ("cr.txt", b"a red circle\rtwo blue squares\r"),
                       ("utf16.txt", "a red circle\r\ntwo blue squares\r\n".encode("utf-16"))]:
        (tmp_path / name).write_bytes(data)
        assert [e["prompt"] for e in user_input.read_prompts(tmp_path / name)] == ["a red circle", "two blue squares"]


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"])
def test_line_ends_only_where_editors_end_them(tmp_path, separator):
    """A caption holding a character where str.splitlines also splits (U+2028 pasted from a web page, ...) stays one
    caption: a 2-line file is 2 prompts, and a JSON line holding it unescaped is valid JSON."""
    caption = f"a red circle{separator}on the left"
    (tmp_path / "p.txt").write_text(f"{caption}\ntwo blue squares\n", encoding="utf-8", newline="")
    assert [e["prompt"] for e in user_input.read_prompts(tmp_path / "p.txt")] == [caption, "two blue squares"]
    line = json.dumps({"prompt": caption}, ensure_ascii=False)
    (tmp_path / "p.jsonl").write_text(f"{line}\n", encoding="utf-8", newline="")
    assert [e["prompt"] for e in user_input.read_prompts(tmp_path / "p.jsonl")] == [caption]


def test_json_lines_whatever_the_name(tmp_path):
    """A file whose first line is a JSON object is JSON Lines (named .txt or .json); a JSON object in a text file is
    refused, never a caption; a .json list of examples is refused with the fix; bytes that are not UTF-8 name their
    line, and a NUL byte (UTF-16 saved without a byte-order mark) its line."""
    (tmp_path / "p.txt").write_text('{"prompt": "a red circle", "target": "t.png"}\n{"prompt": "two squares"}\n')
    a, b = user_input.read_prompts(tmp_path / "p.txt")
    assert (a["prompt"], a["target"], b["prompt"]) == ("a red circle", tmp_path / "t.png", "two squares")
    (tmp_path / "mixed.txt").write_text('a red circle | t.png\n{"prompt": "two squares"}\n')
    with pytest.raises(ValueError, match=r"mixed.txt:2: a JSON object in a file whose first line is text"):
        user_input.read_prompts(tmp_path / "mixed.txt")
    (tmp_path / "list.json").write_text('[\n  {"prompt": "a red circle"},\n  {"prompt": "two squares"}\n]\n')
    with pytest.raises(ValueError, match="is one JSON document; write one example per line"):
        user_input.read_prompts(tmp_path / "list.json")
    (tmp_path / "latin1.txt").write_bytes("a red circle\ncafé crème\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt:2 is not UTF-8 text"):
        user_input.read_prompts(tmp_path / "latin1.txt")
    for name, data in [("utf16le.txt", "a red circle\ncafé crème\n".encode("utf-16-le")),  # no byte-order mark
                       ("utf16be.jsonl", '{"prompt": "a red circle"}\n'.encode("utf-16-be")),
                       ("nul.txt", b"a red circle\ntwo\0squares\n"),
                       ("utf32.txt", "a red circle\n".encode("utf-32"))]:  # its BOM starts as UTF-16's
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"{name}:{2 if name == 'nul.txt' else 1} holds a NUL: UTF-16"):
            user_input.read_prompts(tmp_path / name)
    (tmp_path / "braces.txt").write_text("{curly} braces in a caption\n")  # not JSON: a caption
    assert user_input.read_prompts(tmp_path / "braces.txt")[0]["prompt"] == "{curly} braces in a caption"


def test_read_prompts(tmp_path):
    """Text lines: split at the LAST '|', or a prompt alone (no target); paths relative to the file; comments and
    blanks skipped; the text to render comes from quotes; bad lines are named."""
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub" / "p.txt"
    f.write_text('# comment\n\na | b | img.png\nplain prompt|x/y.png\na sign that says "OPEN" and \u201cnow\u201d\n')
    a, b, c = user_input.read_prompts(f)
    assert (a["prompt"], a["target"], a["source"], a["text"]) == ("a | b", tmp_path / "sub" / "img.png", None, None)
    assert (b["prompt"], b["target"], b["where"]) == ("plain prompt", tmp_path / "sub/x/y.png", f"{f}:4")
    assert (c["target"], c["text"]) == (None, "OPEN now")
    f.write_text("ok | a.png\n# c\n | no prompt\n")
    with pytest.raises(ValueError, match=":3:"):
        user_input.read_prompts(f)
    f.write_text("# only comments\n")
    with pytest.raises(ValueError, match="no examples"):
        user_input.read_prompts(f)


def test_read_prompts_jsonl(tmp_path):
    """.jsonl: one object per line with a prompt and optional target, source, text and extra fields; a bad line is
    named with its number and the fix."""
    f = tmp_path / "edits.jsonl"
    f.write_text('{"prompt": "make it night", "target": "night.png", "source": "day.png", "strength": 2}\n\n'
                 '# a comment\n{"prompt": "a sign", "text": "OPEN"}\n')
    edit, sign = user_input.read_prompts(f)
    assert (edit["target"], edit["source"], edit["strength"]) == (tmp_path / "night.png", tmp_path / "day.png", 2)
    assert (sign["target"], sign["source"], sign["text"], sign["where"]) == (None, None, "OPEN", f"{f}:4")
    for line, needle in [("not json", "not JSON"), ('["a list"]', '"prompt" string'), ('{"target": "a.png"}',
                         '"prompt" string'), ('{"prompt": "x", "target": 3}', '"target" must be'),
                         ('{"prompt": "x", "source": ""}', '"source" must be')]:
        f.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"edits.jsonl:2: .*{needle}"):
            user_input.read_prompts(f)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


CAPTION = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), min_size=1).map(str.strip)


@settings(max_examples=200, deadline=None)
@given(captions=st.lists(CAPTION.filter(bool), min_size=1, max_size=4), bom=st.booleans(),
       end=st.sampled_from(["\n", "\r\n", "\r"]))
def test_captions_read_back_as_written(tmp_path_factory, captions, bom, end):
    """Any caption (any character but \\r and \\n, its ends stripped) written into a JSON Lines file, with or without
    a BOM, with any line end, reads back as itself; so does one written as a text line, where the format allows it
    (no '|', no NUL, not a comment, not JSON)."""
    folder = tmp_path_factory.mktemp("captions")
    lines = end.join(json.dumps({"prompt": c}, ensure_ascii=False) for c in captions) + end
    (folder / "p.jsonl").write_bytes(("\ufeff" * bom + lines).encode("utf-8"))
    assert [e["prompt"] for e in user_input.read_prompts(folder / "p.jsonl")] == captions
    text = [c for c in captions if "|" not in c and "\0" not in c and not c.startswith("#") and not is_json(c)]
    if text:
        (folder / "p.txt").write_bytes(("\ufeff" * bom + end.join(text) + end).encode("utf-8"))
        assert [e["prompt"] for e in user_input.read_prompts(folder / "p.txt")] == text


# ---- Rewards: only their scores reach training ----------------------------------------------------

def test_reward_cannot_change_the_others(tmp_path):
    """A weight-0 reward that normalises the images in place (torchvision's habit) and scales the target in place,
    listed before ssim, changes neither ssim's scores nor a later call's target."""
    def normalising(images, example):
        images.sub_(0.5).div_(0.5)
        example["target"].mul_(2)
        return images.mean(dim=(1, 2, 3))

    table = {**grpo.REWARDS, "normalising": normalising}
    rewards = user_input.parse_rewards("normalising=0,ssim=1", table)
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(4, 3, 32, 32, generator=g)]
    example = {"target": torch.rand(3, 32, 32, generator=g)}
    kept = (images[0].clone(), example["target"].clone())
    _, each = grpo.group_rewards(images, [example], rewards)
    assert torch.equal(each["ssim"][0], grpo.ssim_reward(*kept[:1], {"target": kept[1]}))
    assert torch.equal(images[0], kept[0]) and torch.equal(example["target"], kept[1])


def test_reward_with_a_graph_trains_nothing():
    """A reward computed by a trainable module without no_grad returns scores with no graph: the GRPO loss cannot
    backpropagate into it (it crashed with 'backward through the graph a second time', or trained the head)."""
    head, grad_inside = torch.nn.Linear(3, 1), []

    def learned(images, example):
        grad_inside.append(torch.is_grad_enabled())  # no graph is built (and no memory kept for one)
        return head(images.mean(dim=(2, 3))).squeeze(-1)

    def graph_on_purpose(images, example):  # a reward that needs autograd inside may open it: its scores still detach
        with torch.enable_grad():
            return head(images.mean(dim=(2, 3))).squeeze(-1)

    rewards = user_input.parse_rewards("learned,graph_on_purpose", {"learned": learned,
                                                                     "graph_on_purpose": graph_on_purpose})
    value = rewards["learned"][0](torch.rand(4, 3, 8, 8), {})
    assert value.shape == (4,) and not value.requires_grad and value.grad_fn is None and grad_inside == [False]
    assert not rewards["graph_on_purpose"][0](torch.rand(4, 3, 8, 8), {}).requires_grad
    advantages = grpo.group_advantages(value)
    logprobs = torch.zeros(4, 5, requires_grad=True)
    for _ in range(2):  # two updates on the same samples: the second backward found the reward's freed graph
        loss, _ = grpo.grpo_loss(logprobs, logprobs.detach(), None, advantages, 0.2, 0.0)
        loss.backward()
    assert head.weight.grad is None


@pytest.mark.parametrize("kind", ["torch out=", "numpy buffer"])
def test_reward_with_a_reused_buffer(kind):
    """A reward that writes every group's scores into one buffer it keeps (torch's out=, a numpy array) gives each
    group its own scores: group_rewards stacks them after the last group, so a returned buffer itself would give every
    group the last one's (issue 84: group 0 got [0.1, 0.2, 0.3, 0.4] for its own [0.05, 0.1, 0.15, 0.2])."""
    buffer = {"torch out=": torch.zeros(4), "numpy buffer": np.zeros(4, dtype=np.float32)}[kind]

    def reused(images, example):
        if isinstance(buffer, np.ndarray):
            buffer[:] = images.mean(dim=(1, 2, 3)).numpy()
            return buffer
        return torch.mean(images, dim=(1, 2, 3), out=buffer)

    rewards = user_input.parse_rewards("reused", {"reused": reused})
    groups = [torch.linspace(0.05, 0.2, 4)[:, None, None, None].repeat(1, 3, 8, 8),
              torch.linspace(0.1, 0.4, 4)[:, None, None, None].repeat(1, 3, 8, 8)]
    total, each = grpo.group_rewards(groups, [{}, {}], rewards)
    expected = torch.stack([g.mean(dim=(1, 2, 3)) for g in groups])  # each group's own
    assert torch.equal(each["reused"], expected) and torch.equal(total, expected)


@pytest.mark.parametrize("value, kind", [
    ([0.1, 0.2, 0.3, 0.4], "list"), (np.array([0.1, 0.2, 0.3, 0.4]), "numpy"), (np.array([[1], [0], [1], [0]]), "(G, 1)"),
    (torch.tensor([True, False, True, False]), "bool"), (torch.tensor([1, 2, 3, 4], dtype=torch.int64), "int"),
    ([torch.tensor(0.5)] * 4, "list of tensors"), (torch.arange(4.0, dtype=torch.float64)[None], "(1, G) float64")])
def test_reward_returns_accepted(value, kind):
    """Returns whose meaning is one score per image are taken: a (G,) float32 tensor on the images' device."""
    [(fn, _)] = user_input.parse_rewards("r", {"r": lambda images, example: value}).values()
    out = fn(torch.zeros(4, 3, 8, 8), {})
    assert out.shape == (4,) and out.dtype == torch.float32, kind
    assert torch.equal(out, torch.as_tensor(np.asarray([float(v) for v in np.asarray(
        [float(x) for x in (value.flatten() if hasattr(value, "flatten") else value)])])).float()), kind


@pytest.mark.parametrize("value, needle", [
    (0.5, "returned one number for 4 images"), (torch.tensor(0.5), "returned one number"),
    ([0.1, 0.2], r"returned shape \(2,\) for 4 images"), (torch.zeros(4, 3), r"returned shape \(4, 3\)"),
    ("good", "returned a str"), (None, "returned a NoneType"), (["a", "b", "c", "d"], "returned a list of str"),
    (torch.zeros(4, dtype=torch.complex64), "returned a Tensor of torch.complex64"), (np.array(["a"] * 4), "returned a ndarray")])
def test_reward_returns_refused(value, needle):
    """Returns that are not one score per image are one line naming the reward: at start-up, before anything is
    written (check_rewards), as in a step."""
    table = {"mine": lambda images, example: value}
    [(fn, _)] = user_input.parse_rewards("mine", table).values()
    with pytest.raises(user_input.RewardError, match="reward 'mine' " + needle):
        fn(torch.zeros(4, 3, 8, 8), {})
    with pytest.raises(ValueError, match="reward 'mine' .* on three gray test images") as error:
        user_input.check_rewards(user_input.parse_rewards("mine", table), {}, 8, 8)
    assert "\n" not in str(error.value)


def test_reward_that_raises_is_named():
    """A reward that raises is a RewardError naming it and what it raised, the traceback kept (for the run's error
    file); a missing optional package keeps its own line (ImportError)."""
    def broken(images, example):
        return images.mean(dim=(1, 2, 3)) / 0 if example["x"] else None

    [(fn, _)] = user_input.parse_rewards("broken", {"broken": broken}).values()
    with pytest.raises(user_input.RewardError, match="reward 'broken' raised KeyError: 'x'") as error:
        fn(torch.zeros(2, 3, 8, 8), {})
    assert "in broken" in error.value.details and "Traceback" in error.value.details

    def exits(images, example):  # sys.exit, or argparse's parse_args() inside the reward: not a silent exit 3
        sys.exit(3)

    [(fn, _)] = user_input.parse_rewards("exits", {"exits": exits}).values()
    with pytest.raises(user_input.RewardError, match=r"reward 'exits' exited \(sys.exit\(3\)\)"):
        fn(torch.zeros(2, 3, 8, 8), {})

    def needs_package(images, example):
        raise ImportError("the reward needs easyocr: pip install easyocr")

    with pytest.raises(ValueError, match="^reward 'ocr': the reward needs easyocr"):
        user_input.check_rewards(user_input.parse_rewards("ocr", {"ocr": needs_package}), {}, 8, 8)


def test_parse_rewards(tmp_path, monkeypatch):
    """Built-in names, module:function import paths and path/to/file.py:function with weights, each guarded; bad
    names, weights (negative, not finite) and imports (a missing file or name, a module that raises or exits while
    importing) are refused in one line."""
    rewards = user_input.parse_rewards("ssim=1,mse=0.5", trainer.reward_table(grpo))
    assert {k: w for k, (_, w) in rewards.items()} == {"ssim": 1.0, "mse": 0.5}
    assert rewards["ssim"][0].__wrapped__ is grpo.ssim_reward and rewards["ssim"][0].needs == ("target",)
    (tmp_path / "my_rewards.py").write_text("import torch\ndef brightness(images, example):\n"
                                            "    return images.mean(dim=(1, 2, 3))\nnot_a_function = 3\n")
    monkeypatch.chdir(tmp_path)  # module:function is found in the current directory, as `python -m` would
    custom = user_input.parse_rewards("my_rewards:brightness=2,ssim=0", trainer.reward_table(grpo))
    assert custom["my_rewards:brightness"][1] == 2.0 and custom["my_rewards:brightness"][0].__name__ == "brightness"
    monkeypatch.setattr(sys, "path", [*sys.path])  # (the imports below add their folders)
    # a file path, as people write one: path/to/file.py:function, imported once, beside files it imports; two files
    # named alike stay two; an '@' in the path is the path's
    for folder, value in [("sub", 1), ("me@work", 2)]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "helper_value.py").write_text(f"VALUE = {value}\n")
        (tmp_path / folder / "mine.py").write_text(
            "import helper_value\nLOADS = globals().get('LOADS', 0) + 1\n"
            f"def dark(images, example):\n    return {value} - images.mean(dim=(1, 2, 3))\n")
    rewards = user_input.parse_rewards(f"sub/mine.py:dark=1,{tmp_path}/sub/mine.py : dark=0,me@work/mine.py:dark=1",
                                       trainer.reward_table(grpo))
    assert [w for _, w in rewards.values()] == [1, 0, 1]
    assert [float(fn(torch.zeros(1, 3, 8, 8), {})) for fn, _ in rewards.values()] == [1, 1, 2]
    first, again, other = (fn.__wrapped__ for fn, _ in rewards.values())
    assert first is again and first.__globals__["LOADS"] == 1 and other is not first
    (tmp_path / "bad_syntax.py").write_text("def broken(:\n")
    (tmp_path / "argv.py").write_text("import argparse\nargparse.ArgumentParser(prog='mine').parse_args(['--no'])\n")
    (tmp_path / "quits.py").write_text("raise SystemExit\n")  # as sys.exit(); (wandb.init, in another test of this
    # process, replaces sys.exit with its own, whose code defaults to 0)
    for bad, needle in [("ssmi=1", "unknown reward"), ("ssim=x", "name=number"), ("ssim=", "name=number"),
                        ("ssim=-1", "negative"), ("ssim=inf", "not finite"), ("ssim=nan", "not finite"),
                        ("ssim=1e400", "not finite"), ("ssim=0,mse=0", "every reward weight 0"),
                        ("no_such_module:f=1", "cannot import"), ("my_rewards:nope=1", "my_rewards has no 'nope'"),
                        ("my_rewards:not_a_function=1", "not a function"), ("sub/none.py:f", "no file"),
                        ("sub/mine.py:light", r"sub/mine.py has no 'light'"),
                        ("bad_syntax:broken", r"cannot import it \(SyntaxError: invalid syntax \(bad_syntax.py, line 1"),
                        ("argv.py:f", r"importing it exited \(sys.exit\(2\): mine: error: unrecognized arguments: --no\)"),
                        ("quits.py:f", r"importing it exited \(sys.exit\(\)\)")]:
        with pytest.raises(ValueError, match=needle):
            user_input.parse_rewards(bad, trainer.reward_table(grpo))


# ---- Numbers: each in its range -----------------------------------------------------------------

def numeric_fields() -> list[dataclasses.Field]:
    config = run.with_run_settings(dit_grpo.DitConfig)  # grpo.py's, the SDE's, the variants' and the run's
    return [f for f in dataclasses.fields(config) if user_input.field_kind(f) in (int, float)]


def test_every_number_has_a_rule():
    """Every int and float flag has a rule in user_input.RULES (a new flag without one fails here), and --help says it."""
    fields = numeric_fields()
    assert {f.name for f in fields} <= set(user_input.RULES), {f.name for f in fields} - set(user_input.RULES)
    help_text = " ".join(run.config_parser(run.with_run_settings(dit_grpo.DitConfig)).format_help().split())
    for name in ("clip_eps", "top_p", "kl_beta", "height", "cluster_radius", "sde_noise"):
        assert f"[{user_input.RULES[name].text()}]" in help_text, name


def test_rules_refuse_what_cannot_mean_anything():
    """Each rule refuses NaN and, for a float, both infinities; each holds at the values it names and refuses the
    step beyond a bound."""
    for f in numeric_fields():
        rule = user_input.RULES[f.name]
        assert not rule.holds(math.nan) and not rule.holds(math.inf) and not rule.holds(-math.inf), f.name
        if rule.low is not None:
            low_ok = rule.low + (1 if rule.open in ("low", "both") and user_input.field_kind(f) is int else 0)
            inside = rule.low + (0.5 if rule.open in ("low", "both") else 0) if user_input.field_kind(f) is float else max(
                low_ok, rule.multiple)
            assert rule.holds(inside) and not rule.holds(rule.low - 1), f.name
            assert rule.holds(rule.low) == (rule.open not in ("low", "both") and rule.low % rule.multiple == 0), f.name
        if rule.high is not None:
            assert rule.holds(rule.high) == (rule.open not in ("high", "both")) and not rule.holds(rule.high + 1)


@pytest.mark.parametrize("flag, value, needle", [
    ("--kl-beta", "inf", "--kl-beta inf is out of range; it must be >= 0"),
    ("--lr", "nan", "--lr nan is out of range; it must be in (0, 1)"),
    ("--temperature", "inf", "--temperature inf is out of range; it must be > 0"),
    ("--seed", str(2 ** 63), "--seed 9223372036854775808 is out of range; it must be in [0, 4.29497e+09)"),
    ("--guidance-scale", "0.5", "it must be >= 1 (1: no guidance)"),
    ("--top-p", "0", "--top-p 0.0 is out of range; it must be in (0, 1]"),
    ("--height", "48", "--height 48 is out of range; it must be a positive multiple of 32"),
    ("--group-size", "1", "it must be >= 2 (GRPO compares samples within a group)"),
    ("--cluster-radius", "1", "it must be in [0, 1)"), ("--diversity=-inf", None, "it must be >= 0")])
def test_numbers_out_of_range_stop_the_run(tmp_path, capsys, flag, value, needle):
    """A number outside its rule, on the command line: one line naming it, exit 2, nothing written."""
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    given = [flag] if value is None else [flag, value]  # (argparse reads "-inf" after a flag as a flag)
    expect_exit([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "run"), *given], 2, needle, capsys)
    assert not (tmp_path / "run").exists()


def test_config_file_numbers_and_text(tmp_path, capsys):
    """A config file is read as the prompts files are (Notepad's BOM and CRLF), and its numbers follow the same rules:
    YAML's .inf is refused in one line."""
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    config = tmp_path / "c.yaml"
    config.write_bytes(b"\xef\xbb\xbfgroup_size: 4\r\nlr: 5e-6\r\n")
    assert user_input.read_config_file(str(config), run.with_run_settings(grpo.Config)) == {"group_size": 4, "lr": 5e-6}
    config.write_text("lr: .inf\n")
    expect_exit([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--config", str(config)], 2,
                "--lr inf is out of range", capsys)
    json_config = tmp_path / "c.json"
    json_config.write_bytes(b'\xef\xbb\xbf{"group_size": 4}')
    assert user_input.read_config_file(str(json_config), run.with_run_settings(grpo.Config)) == {"group_size": 4}


def test_read_config_file(tmp_path):
    """--config: YAML or JSON, each value parsed as its flag's (a string too); null is the field's default (for a
    preset, the model's); resume / overwrite come from the command line only; an unknown key, a wrong type, a file
    that does not parse or is not a mapping: ValueError with the key and the file; the file's keys count as given
    flags (for --resume)."""
    config = run.with_run_settings(grpo.Config)
    yaml_file, json_file = tmp_path / "a.yaml", tmp_path / "a.json"
    yaml_file.write_text("lr: 5e-6\nsteps: '7'\nkl_beta: null\nshuffle: true\nresume: runs/x\nclip_eps: 1\n")
    assert user_input.read_config_file(str(yaml_file), config) == {"lr": 5e-6, "steps": 7, "shuffle": True,
                                                                     "clip_eps": 1.0}  # null: the default
    real = trainer.parse_config(grpo, ["--config", str(yaml_file), "--model", "zai-org/GLM-Image"])
    assert real.kl_beta == 0.04 and real.lr == 5e-6  # the real model's preset where the file says null
    json_file.write_text(json.dumps({"group_size": 4, "reward": "ssim=1"}))
    assert user_input.read_config_file(str(json_file), config) == {"group_size": 4, "reward": "ssim=1"}
    for text, needle in [("group_sise: 4\n", "unknown key group_sise"), ("steps: 4.5\n", "steps: 4.5 is not an integer"),
                         ("shuffle: 1\n", "shuffle: 1 is not true or false"), ("steps: [\n", "does not parse"),
                         ("- 1\n", "holds a list"), ("steps: 'x'\n", "steps: 'x' is not an integer")]:
        yaml_file.write_text(text)
        with pytest.raises(ValueError, match=re.escape(needle)):
            user_input.read_config_file(str(yaml_file), config)
    yaml_file.write_text("kl_beta: 0.2\n")
    assert run.given_flags(config, ["--config", str(yaml_file), "--steps", "3"]) == {"kl_beta", "steps"}
    assert run.given_flags(config, ["--config", str(yaml_file)], saved={"kl_beta": 0.2}) == set()  # a requeue
    assert trainer.parse_config(grpo, ["--config", str(yaml_file)]).kl_beta == 0.2
    real = trainer.parse_config(grpo, ["--config", str(ROOT / "examples" / "real_model.yaml")])  # the shipped first real run
    run.validate(real)
    assert (real.model, real.group_size, real.kl_beta, real.lr_scheduler) == ("zai-org/GLM-Image", 4, 0.01, "cosine")
    assert trainer.parse_config(grpo, ["--config", str(yaml_file), "--kl-beta", "0.3"]).kl_beta == 0.3  # the command line wins


@pytest.mark.parametrize("name, text", [
    ("a.yaml", "kl_beta: 0.5\ngroup_size: 4\nkl_beta: 0.0\n"), ("a.json", '{"kl_beta": 0.5, "kl_beta": 0.0}'),
    ("nested.yaml", "reward: ssim=1\nsteps: 3\nsteps: 3\n")])
def test_config_key_given_twice(tmp_path, name, text):
    """A key given twice in a config file is refused, naming it (and, in YAML, both lines): PyYAML and json keep the
    last silently (issue 85: kl_beta 0.5, then 0.0 lower down: the KL silently off, exit 0). The same value twice too:
    which one was meant is the user's to say."""
    (tmp_path / name).write_text(text)
    key = "steps" if name.startswith("nested") else "kl_beta"
    lines = {"a.yaml": " (line 1 and line 3)", "nested.yaml": " (line 2 and line 3)", "a.json": ""}[name]
    with pytest.raises(ValueError, match=re.escape(f"{key} is given twice{lines}; give it once")):
        user_input.read_config_file(str(tmp_path / name), run.with_run_settings(grpo.Config))


@pytest.mark.parametrize("text, needle", [
    ("kl_beta: 0.5\n\tgroup_size: 4\n", "found character '\\t' that cannot start any token at line 2, column 1 "
                                        "(while scanning for the next token); YAML indents with spaces, not tabs"),
    ("steps: [1,\n", "at line 2, column 1"), ('{"steps": 3,\n "lr" 1}', "Expecting ':' delimiter at line 2, column 7")])
def test_config_syntax_error_keeps_its_cause(tmp_path, text, needle):
    """A config file that does not parse is one line that keeps what was found and where (it kept only PyYAML's
    'while scanning for the next token')."""
    path = tmp_path / ("c.json" if text.startswith("{") else "c.yaml")
    path.write_text(text)
    with pytest.raises(ValueError, match="does not parse: .*" + re.escape(needle)) as error:
        user_input.read_config_file(str(path), run.with_run_settings(grpo.Config))
    assert "\n" not in str(error.value)


def test_config_paths_are_the_files(tmp_path, monkeypatch):
    """A path in a config file is relative to the file's folder, from any working directory (issue 85: cfgdir/run.yaml's
    prompts: prompts.txt trained on the working directory's prompts.txt): prompts, eval_prompts, out, a model folder,
    a reward file and a checkpoint folder; a hub id, tiny, a plain reward name and a URL stay as written. A run's
    config.json keeps the prompts absolute."""
    folder, elsewhere = tmp_path / "cfgdir", tmp_path / "elsewhere"
    (folder / "model").mkdir(parents=True)
    (folder / "lpips_weights").mkdir()
    elsewhere.mkdir()
    (folder / "run.yaml").write_text(
        "prompts: prompts.txt\neval_prompts: ../held.txt\nout: runs/x\nmodel: model\n"
        "reward: ssim=1,rewards/score.py:brightness=0.5,lpips@lpips_weights=0,http://127.0.0.1:9/r=0\n"
        "eval_reward: shapes_exact\n")
    monkeypatch.chdir(elsewhere)
    values = user_input.read_config_file(str(folder / "run.yaml"), run.with_run_settings(grpo.Config))
    assert values["prompts"] == str(folder / "prompts.txt") and values["out"] == str(folder / "runs" / "x")
    assert Path(values["eval_prompts"]).resolve() == tmp_path / "held.txt" and values["model"] == str(folder / "model")
    assert values["reward"] == (f"ssim=1,{folder / 'rewards' / 'score.py'}:brightness=0.5,"
                                f"lpips@{folder / 'lpips_weights'}=0,http://127.0.0.1:9/r=0")
    assert values["eval_reward"] == "shapes_exact"
    (folder / "hub.yaml").write_text("model: zai-org/GLM-Image\n")
    assert user_input.read_config_file(str(folder / "hub.yaml"), run.with_run_settings(grpo.Config)) == {
        "model": "zai-org/GLM-Image"}
    prompts = write_example(folder, ["a gray square | t.png"])
    (folder / "small.yaml").write_text(f"prompts: {prompts.name}\nsteps: 1\nheight: 64\nwidth: 64\nbefore_after: 0\n"
                                       "out: run\n")
    (elsewhere / prompts.name).write_text("the wrong prompts | nowhere.png\n")  # what the working directory holds
    grpo.main(["--config", str(folder / "small.yaml")])
    assert json.loads((folder / "run" / "config.json").read_text())["prompts"] == str(prompts)


# ---- Logged estimates keep their sign -------------------------------------------------------------

def test_logged_estimates_keep_their_sign():
    """The k3 KL of the sampler's rounding is >= 0 even where float32 rounds its terms below 0 (sampling/k3_kl
    logged -1.3e-12): here tokens whose exp(x) - 1 - x each round below 0, a mean of -2.9e-8 unclamped. The entropy
    needs no clamp: each term -p log p of a log-softmax is >= 0 (its largest log-prob never rounds above 0)."""
    from helpers import diagnostics, variants
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(1, 4096, generator=g) * 5
    sampled = old - (torch.rand(1, 4096, generator=g) - 0.5) * 2e-6  # gaps of 1e-6: the sampler's rounding
    x = old - sampled
    below = (x.exp() - 1 - x) < 0  # the tokens float32 rounds below 0
    old, sampled = old[below][None], sampled[below][None]
    x = old - sampled
    assert (x.exp() - 1 - x).mean() < 0  # what the log would show unclamped
    assert diagnostics.mismatch(old, sampled, "token_truncate", 2.0, grpo)["sampling/k3_kl"] == 0
    one_code = torch.log_softmax(torch.tensor([[40.0, -40.0, -40.0]]), dim=-1)
    assert one_code.max() <= 0 and variants.entropy(one_code).item() >= 0
    assert variants.entropy(torch.log(torch.full((1, 3), 1 / 3))).item() == pytest.approx(math.log(3))
