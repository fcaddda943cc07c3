"""A small synthetic world of flat shapes with captions that say exactly what is drawn.

A 96x96 picture is a 3x3 grid of 32-pixel cells (one cell per token of GLM-Image's large grid); each cell is empty
(white) or holds one shape (circle, square, triangle) in one colour (red, green, blue, yellow), 20-26 pixels wide,
near the cell's centre. Captions come in five kinds: three are GenEval's tags (single_object, counting, two_object);
GenEval's `position` (relative: a X left of a Y) is this world's relation; position here is an absolute cell, which
GenEval has no tag for (GenEval's colors and color_attr: every object here has its colour):

  single       "a red circle"                         one object, anywhere
  position     "a red circle at the top left"         one object in a named cell
  counting     "two red circles"                      two or three alike, anywhere
  two_objects  "a red circle and a blue square"       two different objects, anywhere
  relation     "a red circle left of a blue square"   two objects, one left of / right of / above / below the other

`caption_split()` sets aside held-out captions (combinations never used in pre-training or in GRPO training);
`sample_scene` draws a scene that satisfies a caption; `render` paints it; `parse_caption` turns a caption back into
what must be drawn, and `check_scene` scores a scene against it (the `shapes` reward reads the scene off the pixels
with `read_scene`, then calls `check_scene`). `valid_scenes` counts the scenes that satisfy a caption, and
`expected_distinct` says how diverse a policy that is always right can be.

Edits: an instruction changes one object of a source picture, in four kinds:

  recolour   "make the red circle blue"
  move       "move the red circle to the top left"
  remove     "remove the red circle"
  add        "add a blue square at the bottom right"

`edit_split()` holds out (kind, object, argument) combinations; `edit_source` draws a source scene the edit applies
to; `apply_edit` gives the scene asked for, and `check_edit` scores a picture's scene against it (the `edit` reward).
"""

import itertools
import random
import re

import numpy as np
from PIL import Image, ImageDraw

SIZE, GRID, CELL = 96, 3, 32
COLOURS = {"red": (220, 50, 47), "green": (40, 160, 70), "blue": (40, 90, 225), "yellow": (240, 190, 20)}
SHAPES = ("circle", "square", "triangle")
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
NUMBERS = {2: "two", 3: "three"}
# label 0 is an empty cell; labels 1..12 are the objects; the tiny model's VQ code of a cell is its label
OBJECTS = [(colour, shape) for shape in SHAPES for colour in COLOURS]
LABEL = {obj: i + 1 for i, obj in enumerate(OBJECTS)}
CELL_NAMES = {(0, 0): "the top left", (0, 1): "the top", (0, 2): "the top right", (1, 0): "the left",
              (1, 1): "the center", (1, 2): "the right", (2, 0): "the bottom left", (2, 1): "the bottom",
              (2, 2): "the bottom right"}
RELATIONS = {"left of": (1, -1), "right of": (1, 1), "above": (0, -1), "below": (0, 1)}  # (axis, sign of a - b)
INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
KINDS = ("single", "position", "counting", "two_objects", "relation")


# ---- Captions ------------------------------------------------------------------------------------

def name(obj) -> str:
    return f"{obj[0]} {obj[1]}"


def caption_of(kind: str, *args) -> str:
    """('position', obj, cell) -> 'a red circle at the top left', and so on for each kind."""
    if kind == "single":
        return f"a {name(args[0])}"
    if kind == "position":
        preposition = {(1, 1): "in", (1, 0): "on", (1, 2): "on"}.get(args[1], "at")
        return f"a {name(args[0])} {preposition} {CELL_NAMES[args[1]]}"
    if kind == "counting":
        (colour, shape), n = args
        return f"{NUMBERS[n]} {colour} {PLURAL[shape]}"
    if kind == "two_objects":
        return f"a {name(args[0])} and a {name(args[1])}"
    return f"a {name(args[0])} {args[2]} a {name(args[1])}"  # relation


def all_captions() -> dict[str, list[tuple]]:
    """Every caption of the world by kind, as (caption, group key); a group holds the captions that say the same
    thing in other words ("A and B" / "B and A"; "A left of B" / "B right of A"), so they are held out together."""
    out = {kind: [] for kind in KINDS}
    for obj in OBJECTS:
        out["single"].append((caption_of("single", obj), ("single", obj)))
        for cell in CELL_NAMES:
            out["position"].append((caption_of("position", obj, cell), ("position", obj, cell)))
        for n in NUMBERS:
            out["counting"].append((caption_of("counting", obj, n), ("counting", obj, n)))
    for a, b in itertools.permutations(OBJECTS, 2):
        out["two_objects"].append((caption_of("two_objects", a, b), ("two_objects", *sorted([a, b]))))
        for relation in RELATIONS:
            key = (a, relation, b) if relation in ("left of", "above") else (b, INVERSE[relation], a)
            out["relation"].append((caption_of("relation", a, b, relation), ("relation", *key)))
    return out


def caption_split(held_out: float = 0.2, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held_out) captions: in every kind a seeded `held_out` share of the groups of captions that mean the
    same thing. Every word and every object occurs in training; the held-out combinations never do."""
    rng = random.Random(seed)
    train, held = [], []
    for captions in all_captions().values():
        groups = sorted({key for _, key in captions})
        rng.shuffle(groups)
        out = set(groups[: max(1, round(held_out * len(groups)))])
        train += [c for c, key in captions if key not in out]
        held += [c for c, key in captions if key in out]
    return train, held


# ---- Parsing a caption ---------------------------------------------------------------------------

_OBJ = r"(red|green|blue|yellow) (circle|square|triangle)"
_PATTERNS = [
    ("position", re.compile(rf"^an? {_OBJ} (?:at|in|on) (the top left|the top right|the bottom left|the bottom right|"
                            r"the top|the bottom|the left|the right|the center)$")),
    ("relation", re.compile(rf"^an? {_OBJ} (left of|right of|above|below) an? {_OBJ}$")),
    ("two_objects", re.compile(rf"^an? {_OBJ} and an? {_OBJ}$")),
    ("counting", re.compile(r"^(two|three) (red|green|blue|yellow) (circles|squares|triangles)$")),
    ("single", re.compile(rf"^an? {_OBJ}$")),
]


def parse_caption(caption: str) -> dict | None:
    """A caption of the world -> {"kind", "objects": [(colour, shape, cell or None)], "relation": (i, word, j) or
    None}; None for text the world's grammar does not cover. Case, spaces and a final full stop are ignored."""
    text = " ".join(caption.lower().strip().rstrip(".").split())
    for kind, pattern in _PATTERNS:
        m = pattern.match(text)
        if not m:
            continue
        g = m.groups()
        if kind == "position":
            cell = {v: k for k, v in CELL_NAMES.items()}[g[2]]
            return {"kind": kind, "objects": [(g[0], g[1], cell)], "relation": None}
        if kind == "relation":
            return {"kind": kind, "objects": [(g[0], g[1], None), (g[3], g[4], None)], "relation": (0, g[2], 1)}
        if kind == "two_objects":
            return {"kind": kind, "objects": [(g[0], g[1], None), (g[2], g[3], None)], "relation": None}
        if kind == "counting":
            n = {"two": 2, "three": 3}[g[0]]
            return {"kind": kind, "objects": [(g[1], g[2][:-1], None)] * n, "relation": None}
        return {"kind": kind, "objects": [(g[0], g[1], None)], "relation": None}
    return None


# ---- Scenes --------------------------------------------------------------------------------------
# A scene is a dict {(row, col): (colour, shape)} of the non-empty cells.

def satisfies(scene: dict, spec: dict) -> bool:
    """Does the scene hold exactly the caption's objects, where and as it says?"""
    return check_scene([(r, c, obj) for (r, c), obj in scene.items()], spec) == 1.0


def sample_scene(caption: str, rng: random.Random) -> dict:
    """A scene drawn uniformly from those that satisfy the caption."""
    spec = parse_caption(caption)
    if spec is None:
        raise ValueError(f"'{caption}' is not a caption of the world")
    cells = list(CELL_NAMES)
    while True:
        chosen = rng.sample(cells, len(spec["objects"]))
        scene = {}
        for (colour, shape, cell), free in zip(spec["objects"], chosen):
            scene[cell if cell is not None else free] = (colour, shape)
        if len(scene) == len(spec["objects"]) and satisfies(scene, spec):
            return scene


def valid_scenes(caption: str) -> int:
    """How many scenes satisfy the caption: its right layouts (a scene is one large grid of the tiny model)."""
    spec = parse_caption(caption)
    objects, n = sorted({(colour, shape) for colour, shape, _ in spec["objects"]}), len(spec["objects"])
    return sum(satisfies(dict(zip(cells, chosen)), spec) for cells in itertools.combinations(CELL_NAMES, n)
               for chosen in itertools.product(objects, repeat=n))


def expected_distinct(m: int, k: int = 8) -> float:
    """The expected number of distinct values among k draws uniform over m: the most any distribution over m values
    gives (the ceiling of distinct layouts for a caption with m right ones, every sample right)."""
    return m * (1 - (1 - 1 / m) ** k)


ERRORS = ("extra", "missing", "colour", "position")


def corrupt(scene: dict, caption: str, rng: random.Random) -> dict:
    """The scene with one mistake a caption writer might not notice, so that the caption no longer fits it: one
    object too many ("extra"), one too few ("missing", when there are two or more), one in another colour ("colour"),
    or one moved ("position", where the caption says where). Pre-training pairs some captions with such scenes, the
    way web captions are noisy, so the pre-trained model makes these mistakes too and GRPO has something to fix."""
    spec = parse_caption(caption)
    kinds = ["extra", "colour"] + (["missing"] if len(scene) > 1 else []) + (
        ["position"] if spec["kind"] in ("position", "relation") else [])
    while True:
        wrong = dict(scene)
        kind = rng.choice(kinds)
        cell = rng.choice(sorted(wrong))
        free = [c for c in CELL_NAMES if c not in wrong]
        if kind == "extra":
            wrong[rng.choice(free)] = rng.choice(OBJECTS)
        elif kind == "missing":
            del wrong[cell]
        elif kind == "colour":
            colour, shape = wrong[cell]
            wrong[cell] = (rng.choice([c for c in COLOURS if c != colour]), shape)
        else:
            wrong[rng.choice(free)] = wrong.pop(cell)
        if not satisfies(wrong, spec):
            return wrong


def labels(scene: dict) -> list[int]:
    """The scene's 9 cell labels in raster order (0 empty, else LABEL[(colour, shape)])."""
    return [LABEL[scene[(r, c)]] if (r, c) in scene else 0 for r in range(GRID) for c in range(GRID)]


def scene_of_labels(cells: list[int]) -> dict:
    """Inverse of `labels` (codes outside 0..12 count as empty)."""
    return {(i // GRID, i % GRID): OBJECTS[v - 1] for i, v in enumerate(cells) if 1 <= v <= len(OBJECTS)}


def render(scene: dict, rng: random.Random | None = None, supersample: int = 4) -> Image.Image:
    """The scene painted on white, anti-aliased: each shape 20-26 pixels wide, its centre within 2 pixels of
    its cell's centre (random size and offset from `rng`; None: 24 pixels, centred)."""
    s = supersample
    image = Image.new("RGB", (SIZE * s, SIZE * s), "white")
    draw = ImageDraw.Draw(image)
    for (row, col), (colour, shape) in sorted(scene.items()):
        width = rng.randint(20, 26) if rng else 24
        dx, dy = (rng.randint(-2, 2), rng.randint(-2, 2)) if rng else (0, 0)
        cx, cy, half = (col * CELL + CELL / 2 + dx) * s, (row * CELL + CELL / 2 + dy) * s, width * s / 2
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse([cx - half, cy - half, cx + half, cy + half], fill=fill)
        elif shape == "square":
            half *= 0.9  # a square looks larger than a circle of the same width
            draw.rectangle([cx - half, cy - half, cx + half, cy + half], fill=fill)
        else:
            draw.polygon([(cx, cy - half), (cx + half, cy + half * 0.8), (cx - half, cy + half * 0.8)], fill=fill)
    return image.resize((SIZE, SIZE), Image.LANCZOS) if s > 1 else image


# ---- Reading a scene off the pixels --------------------------------------------------------------

def components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean (H, W) mask -> (labels (H, W) int, 0 = background, count)."""
    h, w = mask.shape
    ids = np.where(mask, np.arange(1, h * w + 1).reshape(h, w), 0)
    while True:  # every pixel takes the smallest id among itself and its neighbours, until nothing changes
        padded = np.pad(ids, 1, constant_values=h * w + 1)
        padded[padded == 0] = h * w + 1
        neighbours = np.minimum.reduce([padded[1:-1, 1:-1], padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2],
                                        padded[1:-1, 2:]])
        new = np.where(mask, neighbours, 0)
        if np.array_equal(new, ids):
            break
        ids = new
    uniques, relabelled = np.unique(ids, return_inverse=True)
    relabelled = relabelled.reshape(h, w)
    if uniques[0] != 0:  # no background pixel at all
        relabelled += 1
    return relabelled, len(uniques) - (uniques[0] == 0)


def read_scene(image: np.ndarray, min_area: int = 40) -> list[tuple]:
    """(H, W, 3) uint8 or float in [0, 1] picture -> the shapes seen: [(row, col, (colour, shape))].

    Each pixel takes the nearest colour of the palette if it is within 80 (of 255, Euclidean) of it, else counts as
    background; 4-connected regions of one colour with at least `min_area` pixels (at 96x96) are objects. The shape
    is the template (disc, square, upward triangle) that best overlaps the region inside its bounding box, the cell
    the one that holds its centroid.
    """
    pixels = np.asarray(image, dtype=np.float32)
    if pixels.max() <= 1.0:
        pixels = pixels * 255.0
    palette = np.array(list(COLOURS.values()), dtype=np.float32)  # (4, 3)
    distance = np.linalg.norm(pixels[:, :, None, :] - palette[None, None], axis=-1)  # (H, W, 4)
    nearest, close = distance.argmin(-1), distance.min(-1) < 80
    found = []
    scale = pixels.shape[0] / SIZE
    for k, colour in enumerate(COLOURS):
        regions, n = components(close & (nearest == k))
        for region in range(1, n + 1):
            mask = regions == region
            ys, xs = np.nonzero(mask)
            if len(ys) < min_area * scale ** 2:
                continue
            box = mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
            row, col = int(ys.mean() / scale // CELL), int(xs.mean() / scale // CELL)
            found.append((min(row, GRID - 1), min(col, GRID - 1), (colour, shape_of(box))))
    return found


def shape_of(box: np.ndarray) -> str:
    """The shape whose template, drawn to fill the (h, w) boolean box, overlaps it best (intersection over union)."""
    h, w = box.shape
    y, x = np.meshgrid((np.arange(h) + 0.5) / h * 2 - 1, (np.arange(w) + 0.5) / w * 2 - 1, indexing="ij")
    templates = {"circle": x ** 2 + y ** 2 <= 1, "square": np.ones_like(box), "triangle": np.abs(x) <= (y + 1) / 2}
    iou = {name: (box & t).sum() / (box | t).sum() for name, t in templates.items()}
    return max(iou, key=iou.get)


# ---- Scoring -------------------------------------------------------------------------------------

def check_scene(found: list[tuple], spec: dict) -> float:
    """Score in [0, 1] of the objects seen (read_scene's list) against a parsed caption: half for being fully right,
    half partial credit, the mean of (a) the count (1 when as many objects as asked, falling by 1/n per object too
    many or too few), (b) how well the asked objects are matched one-to-one by seen ones (per object: colour, shape,
    and the named cell when there is one, each an equal share), and (c) for a relation, whether the best match
    satisfies it. 1.0 exactly when the picture holds the caption's objects and nothing else, where it says; a nearly
    right picture scores below 0.5, so within a group GRPO always prefers a fully right one (with partial credit
    alone a nearly right sample could look as good as a right one; measured: +17 instead of +25 points of
    held-out accuracy in the same time)."""
    want = spec["objects"]
    n = len(want)
    count = max(0.0, 1 - abs(len(found) - n) / n)
    best_match, best_relation = 0.0, 0.0
    for chosen in itertools.permutations(range(len(found)), min(n, len(found))):
        match = 0.0
        for (colour, shape, cell), j in zip(want, chosen):
            row, col, (c, s) = found[j]
            parts = [c == colour, s == shape] + ([(row, col) == cell] if cell is not None else [])
            match += sum(parts) / len(parts)
        match /= n
        relation = 1.0
        if spec["relation"] is not None:
            i, word, j = spec["relation"]
            relation = 0.0
            if len(chosen) == n:
                axis, sign = RELATIONS[word]
                a, b = found[chosen[i]], found[chosen[j]]
                relation = float(np.sign(a[axis] - b[axis]) == sign)
        if (match + relation) > (best_match + best_relation):
            best_match, best_relation = match, relation
    parts = [count, best_match] + ([best_relation] if spec["relation"] is not None else [])
    partial = sum(parts) / len(parts)
    return float(0.5 * (partial == 1.0) + 0.5 * partial)


# ---- Edits ---------------------------------------------------------------------------------------

EDIT_KINDS = ("recolour", "move", "remove", "add")


def edit_of(kind: str, obj: tuple, arg=None) -> str:
    """('move', obj, cell) -> 'move the red circle to the top left', and so on for each kind (arg: the new colour of
    a recolour, the cell of a move or an add)."""
    if kind == "recolour":
        return f"make the {name(obj)} {arg}"
    if kind == "move":
        return f"move the {name(obj)} to {CELL_NAMES[arg]}"
    if kind == "remove":
        return f"remove the {name(obj)}"
    return f"add {caption_of('position', obj, arg)}"  # add a red circle at the top left


def all_edits() -> dict[str, list[tuple]]:
    """Every edit of the world by kind, as (kind, object, argument) keys."""
    return {"recolour": [("recolour", o, c) for o in OBJECTS for c in COLOURS if c != o[0]],
            "move": [("move", o, cell) for o in OBJECTS for cell in CELL_NAMES],
            "remove": [("remove", o, None) for o in OBJECTS],
            "add": [("add", o, cell) for o in OBJECTS for cell in CELL_NAMES]}


def edit_split(held_out: float = 0.25, seed: int = 0) -> tuple[list[tuple], list[tuple]]:
    """(train, held_out) edit keys: in every kind a seeded `held_out` share of the combinations. Every word occurs
    in training; the held-out combinations (e.g. making a red circle blue) never do."""
    rng = random.Random(seed)
    train, held = [], []
    for keys in all_edits().values():
        keys = list(keys)
        rng.shuffle(keys)
        n = max(1, round(held_out * len(keys)))
        held += sorted(keys[:n], key=str)
        train += sorted(keys[n:], key=str)
    return train, held


_CELL = ("(the top left|the top right|the bottom left|the bottom right|the top|the bottom|the left|the right|"
         "the center)")
_EDITS = [("recolour", re.compile(rf"^make the {_OBJ} (red|green|blue|yellow)$")),
          ("move", re.compile(rf"^move the {_OBJ} to {_CELL}$")),
          ("remove", re.compile(rf"^remove the {_OBJ}$")),
          ("add", re.compile(rf"^add an? {_OBJ} (?:at|in|on) {_CELL}$"))]


def parse_edit(instruction: str) -> tuple | None:
    """An instruction of the world -> its (kind, object, argument) key; None for text the grammar does not cover."""
    text = " ".join(instruction.lower().strip().rstrip(".").split())
    cells = {v: k for k, v in CELL_NAMES.items()}
    for kind, pattern in _EDITS:
        m = pattern.match(text)
        if m:
            g = m.groups()
            arg = g[2] if kind == "recolour" else None if kind == "remove" else cells[g[2]]
            return (kind, (g[0], g[1]), arg)
    return None


def apply_edit(scene: dict, key: tuple) -> dict | None:
    """The scene the edit asks for, or None where it does not apply: the object named must be in the scene once
    (recolour, move, remove) or not at all (add), a move's or an add's cell must be free, a recolour must not make
    a second object alike."""
    kind, obj, arg = key
    cells = [cell for cell, o in scene.items() if o == obj]
    out = dict(scene)
    if kind == "add":
        if cells or arg in scene:
            return None
        out[arg] = obj
        return out
    if len(cells) != 1:
        return None
    if kind == "recolour":
        if (arg, obj[1]) in scene.values():
            return None
        out[cells[0]] = (arg, obj[1])
    elif kind == "move":
        if arg in scene:
            return None
        out[arg] = out.pop(cells[0])
    else:
        del out[cells[0]]
    return out


def edit_source(key: tuple, rng: random.Random) -> dict:
    """A source scene the edit applies to: 1-3 different objects (the one named, except for an add, and up to two
    others) in random cells."""
    kind, obj, _ = key
    while True:
        n = rng.randint(0 if kind == "add" else 1, 2 if kind == "add" else 3)
        others = rng.sample([o for o in OBJECTS if o != obj], n - (kind != "add"))
        objects = others + ([obj] if kind != "add" else [])
        scene = dict(zip(rng.sample(list(CELL_NAMES), len(objects)), objects))
        if scene and apply_edit(scene, key) is not None:
            return scene


def check_edit(found: list[tuple], want: dict) -> float:
    """Score in [0, 1] of the objects seen (read_scene's list) against the scene asked for: half for being fully
    right (every cell as asked: the edit done, nothing else changed), half the share of the 9 cells that are as
    asked (a cell with two objects seen is wrong). A picture one cell off scores below 0.5."""
    seen: dict = {}
    for row, col, obj in found:
        seen[(row, col)] = None if (row, col) in seen else obj
    right = sum(seen.get(cell) == want.get(cell) and not (cell in seen and seen[cell] is None)
                for cell in CELL_NAMES) / len(CELL_NAMES)
    return float(0.5 * (right == 1.0) + 0.5 * right)
